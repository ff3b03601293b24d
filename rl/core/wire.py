"""A compact wire format for scored groups: token ids and logprobs as raw arrays.

JSON spends most of its bytes and time on long float lists; here each message is
`RLY1 | header length (uint32 LE) | JSON header | int32 token ids | float32 logprobs`.
The header holds the scalars (versions, rewards, advantages, lengths); the arrays hold every
sample's prompt ids then completion ids, and every sample's completion logprobs, in order.
Content type: `application/x-relay-groups`.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

from rl.core.records import ARRAY_KEYS

MAGIC = b"RLY1"
CONTENT_TYPE = "application/x-relay-groups"
LONG_POLL_S = 10.0
"""How long a trainer rank's `/batch` request waits for its step before the queue answers 204
(and the rank asks again)."""
RETRY_AFTER_S = 0.2
"""What a full queue's 429 tells the orchestrator to wait before pushing again."""


class WireError(ValueError):
    """A message that does not decode; the text says what is wrong."""


def encode(groups: list[dict[str, Any]], meta: dict[str, Any] | None = None) -> bytes:
    samples = [s for g in groups for s in g["samples"]]
    ids = [np.asarray(s[k], dtype="<i4") for s in samples for k in ("prompt_ids", "completion_ids")]
    logprobs = [np.asarray(s["logprobs"], dtype="<f4") for s in samples]
    n_ids = sum(map(len, ids))
    arrays = np.empty(n_ids + sum(map(len, logprobs)), dtype="<i4")
    if samples:  # written in place: one copy of the arrays, not three
        np.concatenate(ids, out=arrays[:n_ids])
        np.concatenate(logprobs, out=arrays[n_ids:].view("<f4"))
    header = _header(groups, meta)
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, arrays.data])


def reheader(data: bytes, groups: list[dict[str, Any]]) -> bytes:
    """`data` with its header rebuilt from `groups`, its arrays kept byte for byte: a checked
    message stored without whatever else its sender put in the header, for one copy instead of
    a re-encoding. `groups` are `data`'s own (from `unpack`), with the arrays it decoded."""
    (old,) = struct.unpack("<I", data[4:8])
    arrays = memoryview(data)[8 + old :]
    header = _header(groups, {})
    lengths = [len(s[k]) for g in groups for s in g["samples"] for k in ARRAY_KEYS]
    if 4 * sum(lengths) != len(arrays):
        raise WireError(f"arrays hold {len(arrays)} bytes, the groups {4 * sum(lengths)}")
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, arrays])


def _header(groups: list[dict[str, Any]], meta: dict[str, Any] | None) -> bytes:
    """The JSON header: every scalar, and each sample's array lengths in place of its arrays."""
    header_groups = []
    for group in groups:
        samples = []
        for sample in group["samples"]:
            scalars = {k: v for k, v in sample.items() if k not in ARRAY_KEYS}
            scalars["prompt_len"] = len(sample["prompt_ids"])
            scalars["completion_len"] = len(sample["completion_ids"])
            samples.append(scalars)
        scalars = {k: v for k, v in group.items() if k != "samples"}
        header_groups.append({**scalars, "samples": samples})
    return json.dumps({"meta": meta or {}, "groups": header_groups}).encode()


def decode(data: bytes, lists: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Groups and the meta dict; WireError on any inconsistency. Arrays come as Python lists,
    or with `lists=False` as read-only numpy views of `data` (no copy: for relaying)."""
    groups, meta, _, _ = unpack(data)
    if lists:
        for sample in (s for g in groups for s in g["samples"]):
            for key in ARRAY_KEYS:
                sample[key] = sample[key].tolist()
    return groups, meta


def unpack(data: bytes) -> tuple[list[dict[str, Any]], dict[str, Any], Any, Any]:
    """Groups (arrays as read-only numpy views of `data`), the meta dict, and the flat token-id
    and logprob arrays those views share: one vectorised pass over every value of a message
    checks them all, with no loop over samples. WireError on any inconsistency."""
    if len(data) < 8 or data[:4] != MAGIC:
        raise WireError("not a relay-groups message (bad magic)")
    (header_len,) = struct.unpack("<I", data[4:8])
    if 8 + header_len > len(data):
        raise WireError("header runs past the end of the message")
    try:
        header = json.loads(data[8 : 8 + header_len])
        groups, meta = header["groups"], header["meta"]
        lengths = [(s["prompt_len"], s["completion_len"]) for g in groups for s in g["samples"]]
    except (ValueError, KeyError, TypeError) as err:
        raise WireError(f"bad header: {err}") from err
    if not all(isinstance(n, int) and n >= 0 for pair in lengths for n in pair):
        raise WireError("lengths must be non-negative integers")
    n_ids = sum(p + c for p, c in lengths)
    n_lp = sum(c for _, c in lengths)
    body = memoryview(data)[8 + header_len :]
    if len(body) != 4 * (n_ids + n_lp):
        raise WireError(f"arrays hold {len(body)} bytes, header says {4 * (n_ids + n_lp)}")
    ids = np.frombuffer(body, dtype="<i4", count=n_ids)
    logprobs = np.frombuffer(body, dtype="<f4", offset=4 * n_ids, count=n_lp)
    at_id = at_lp = 0
    for group in groups:
        for sample in group["samples"]:
            p, c = sample.pop("prompt_len"), sample.pop("completion_len")
            sample["prompt_ids"] = ids[at_id : at_id + p]
            sample["completion_ids"] = ids[at_id + p : at_id + p + c]
            sample["logprobs"] = logprobs[at_lp : at_lp + c]
            at_id, at_lp = at_id + p + c, at_lp + c
    return groups, meta, ids, logprobs


def to_lists(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Samples with numpy arrays turned into lists (for JSON)."""
    return [
        {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in sample.items()}
        for sample in samples
    ]
