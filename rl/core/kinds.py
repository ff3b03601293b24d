"""The kinds of metrics.jsonl's lines, and how a reader tells them apart.

Every line carries `kind`; rl/core/records.py types each kind's record. This module holds the
kinds alone, importing neither numpy nor the schema, so that reading a run (`rl action=status`)
starts in a fraction of a second.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class RecordKind(StrEnum):
    train = "train"
    eval = "eval"
    rollout = "rollout"
    warmup = "warmup"


def is_train(record: dict[str, Any]) -> bool:
    return record.get("kind") == RecordKind.train


def is_eval(record: dict[str, Any]) -> bool:
    return record.get("kind") == RecordKind.eval


STEP_FIELDS = ("reward", "loss", "signal", "clipped", "throughput", "times", "staleness", "eta")
"""What a step's console line may show, in this order (`console.fields`)."""


def eval_options(record: dict[str, Any]) -> list[str]:
    """The `eval.environments` options an eval record holds results of
    (`eval/<option>/exact_match`), in the order logged."""
    keys = [k.split("/") for k in record]
    return [k[1] for k in keys if len(k) == 3 and k[0] == "eval" and k[2] == "exact_match"]


def is_rollout(record: dict[str, Any]) -> bool:
    return record.get("kind") == RecordKind.rollout


def kind_of(record: dict[str, Any]) -> str:
    return str(record.get("kind", ""))
