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

from rl.records import ARRAY_KEYS

MAGIC = b"RLY1"
CONTENT_TYPE = "application/x-relay-groups"


class WireError(ValueError):
    """A message that does not decode; the text says what is wrong."""


def encode(groups: list[dict[str, Any]], meta: dict[str, Any] | None = None) -> bytes:
    header_groups, ids, logprobs = [], [], []
    for group in groups:
        samples = []
        for sample in group["samples"]:
            scalars = {k: v for k, v in sample.items() if k not in ARRAY_KEYS}
            scalars["prompt_len"] = len(sample["prompt_ids"])
            scalars["completion_len"] = len(sample["completion_ids"])
            samples.append(scalars)
            ids.append(np.asarray(sample["prompt_ids"], dtype="<i4"))
            ids.append(np.asarray(sample["completion_ids"], dtype="<i4"))
            logprobs.append(np.asarray(sample["logprobs"], dtype="<f4"))
        scalars = {k: v for k, v in group.items() if k != "samples"}
        header_groups.append({**scalars, "samples": samples})
    header = json.dumps({"meta": meta or {}, "groups": header_groups}).encode()
    id_bytes = np.concatenate(ids).tobytes() if ids else b""
    lp_bytes = np.concatenate(logprobs).tobytes() if logprobs else b""
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, id_bytes, lp_bytes])


def decode(data: bytes, lists: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Groups and the meta dict; WireError on any inconsistency. Arrays come as Python lists,
    or with `lists=False` as read-only numpy views of `data` (no copy: for relaying)."""
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
    body = data[8 + header_len :]
    if len(body) != 4 * (n_ids + n_lp):
        raise WireError(f"arrays hold {len(body)} bytes, header says {4 * (n_ids + n_lp)}")
    ids: Any = np.frombuffer(body, dtype="<i4", count=n_ids)
    logprobs: Any = np.frombuffer(body, dtype="<f4", offset=4 * n_ids, count=n_lp)
    if lists:
        ids, logprobs = ids.tolist(), logprobs.tolist()
    at_id = at_lp = 0
    for group in groups:
        for sample in group["samples"]:
            p, c = sample.pop("prompt_len"), sample.pop("completion_len")
            sample["prompt_ids"] = ids[at_id : at_id + p]
            sample["completion_ids"] = ids[at_id + p : at_id + p + c]
            sample["logprobs"] = logprobs[at_lp : at_lp + c]
            at_id, at_lp = at_id + p + c, at_lp + c
    return groups, meta


def to_lists(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Samples with numpy arrays turned into lists (for JSON)."""
    return [
        {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in sample.items()}
        for sample in samples
    ]
