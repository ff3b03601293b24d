"""The relay-groups wire format: exact round trips and refusal of damaged messages."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.core import wire

f32 = st.floats(min_value=-50, max_value=0, width=32)
sample = st.builds(
    lambda p, c, r, a, v: {
        "prompt_ids": p,
        "completion_ids": [t for t, _ in c],
        "logprobs": [lp for _, lp in c],
        "reward": r,
        "advantage": a,
        "min_version": v,
        "max_version": v,
    },
    st.lists(st.integers(0, 2**31 - 1), max_size=20),
    st.lists(st.tuples(st.integers(0, 2**31 - 1), f32), max_size=20),
    st.floats(0, 1),
    st.floats(-1, 1),
    st.integers(0, 1000),
)
groups = st.lists(
    st.builds(lambda s: {"samples": s, "min_version": 0, "max_version": 1}, st.lists(sample)),
    max_size=4,
)


@settings(max_examples=100, deadline=None)
@given(groups, st.dictionaries(st.text(max_size=5), st.integers()))
def test_round_trip_is_exact(items: list[dict], meta: dict) -> None:
    decoded, decoded_meta = wire.decode(wire.encode(items, meta))
    assert decoded == items and decoded_meta == meta


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_wire_error_only(data: bytes) -> None:
    try:
        wire.decode(data)
    except wire.WireError:
        pass


def test_truncated_and_padded_messages_are_refused() -> None:
    message = wire.encode([{"samples": [{"prompt_ids": [1], "completion_ids": [2],
                                        "logprobs": [-0.1]}]}])  # fmt: skip
    with pytest.raises(wire.WireError, match="arrays hold"):
        wire.decode(message[:-1])
    with pytest.raises(wire.WireError, match="arrays hold"):
        wire.decode(message + b"\0\0\0\0")
    with pytest.raises(wire.WireError, match="bad magic"):
        wire.decode(b"JSON" + message[4:])
