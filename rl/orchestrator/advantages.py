"""Advantage estimators over one group of rewards (the completions of one prompt).

Plain Python, no torch: the orchestrator computes advantages as it scores each group.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from rl.core.config import Advantage


def group_mean(rewards: list[float]) -> list[float]:
    """Dr.GRPO-style: reward minus the group mean, no std normalisation (the default)."""
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def zscore(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """GRPO: reward minus the group mean over the group's (sample) standard deviation."""
    centred = group_mean(rewards)
    std = math.sqrt(sum(c * c for c in centred) / max(len(rewards) - 1, 1))
    return [c / (std + eps) for c in centred]


def rloo(rewards: list[float]) -> list[float]:
    """Leave-one-out: reward minus the mean of the other completions of the prompt."""
    n = len(rewards)
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


ADVANTAGES: dict[str, Callable[[list[float]], list[float]]] = {
    Advantage.group_mean: group_mean,
    Advantage.zscore: zscore,
    Advantage.rloo: rloo,
}
"""Each `algorithm.advantage` (rl/core/config.py's `Advantage`, whose every value has one)."""


def advantage_bound(name: str, spread: float, group_size: int) -> float:
    """The largest advantage magnitude estimator `name` gives a group of `group_size` rewards
    that lie within `spread` of each other: the mean of a group (or of the others) lies among
    its rewards, so `group_mean` and `rloo` stay within `spread`; a z-score with the sample
    standard deviation within (n - 1) / sqrt(n) whatever the rewards (Samuelson's bound)."""
    if name == "zscore":
        return (group_size - 1) / math.sqrt(group_size)
    if name not in ADVANTAGES:
        raise ValueError(f"no advantage estimator {name!r}")
    return spread
