"""A trainer step's record for metrics.jsonl: the loss numbers summed over micro-batches and
ranks, the batch's rewards, staleness and environment metrics, its times, and memory.

What the record needs of the whole batch is a handful of sums (`BatchSummary`): each rank sums
its own shard and rank 0 adds up the ranks' summaries, so a step moves a few hundred bytes per
rank to rank 0 whatever the batch's size, instead of every sample to every rank."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rl.core.records import BatchShard, Sample

# Per-step numbers that are sums over micro-batches (and ranks).
SUMMED_STATS = (
    "loss",
    "entropy",
    "masked_fraction",
    "clipped_fraction",
    "mismatch_kl",
    "ratio_mean",
)


@dataclass
class BatchSummary:
    """Sums over some of a batch's samples: all a step's record reads of them."""

    samples: int = 0
    reward: float = 0.0
    tokens: int = 0
    filtered_groups: int = 0
    versions: Counter[int] = field(default_factory=Counter)
    """Samples by their oldest generating version."""
    env: dict[str, tuple[float, int]] = field(default_factory=dict)
    """Per environment metric: the sum of its values and how many samples had one."""

    @classmethod
    def of(cls, samples: list[Sample]) -> BatchSummary:
        summary = cls(len(samples))
        for s in samples:
            summary.reward += s.reward
            summary.tokens += s.tokens
            summary.filtered_groups += s.filtered_groups
            summary.versions[s.min_version] += 1
            for key, value in s.env_metrics.items():
                total, count = summary.env.get(key, (0.0, 0))
                summary.env[key] = (total + value, count + 1)
        return summary

    def add(self, other: BatchSummary) -> BatchSummary:
        """Both summaries' samples together (this one's first)."""
        env = dict(self.env)
        for key, (total, count) in other.env.items():
            mine, n = env.get(key, (0.0, 0))
            env[key] = (mine + total, n + count)
        return BatchSummary(
            self.samples + other.samples,
            self.reward + other.reward,
            self.tokens + other.tokens,
            self.filtered_groups + other.filtered_groups,
            self.versions + other.versions,
            env,
        )


def env_metrics(summary: BatchSummary) -> dict[str, float]:
    """Means over the batch of the per-episode metrics an environment keeps (`env/<name>`)."""
    return {f"env/{key}": total / count for key, (total, count) in summary.env.items()}


def memory_metrics(device: torch.device) -> dict[str, float]:
    """This process's resident memory, and the most GPU memory torch has held, in GB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    found = {"memory/rss_gb": pages * os.sysconf("SC_PAGE_SIZE") / 1e9}
    if device.type == "cuda":
        found["memory/gpu_max_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return found


def step_metrics(
    step: int,
    batch: BatchShard,
    whole: BatchSummary,
    stats: dict[str, float],
    times: dict[str, float],
) -> dict[str, Any]:
    """Step `step + 1`'s numbers: the loss numbers of `stats` (whole-batch sums, the same on
    every rank), the step's `times`, the rest from the whole batch's summary."""
    staleness = sum((step - version) * n for version, n in whole.versions.items())
    elapsed = times["time/step"]
    return {
        "reward/mean": whole.reward / whole.samples,
        "loss": stats["loss"],
        "entropy": stats["entropy"],
        "mismatch_kl": stats["mismatch_kl"],
        "masked_fraction": stats["masked_fraction"],
        "clipped_fraction": stats["clipped_fraction"],
        "ratio/mean": stats["ratio_mean"],
        "ratio/max": stats["ratio_max"],
        "ratio/min": stats["ratio_min"],
        "filter/zero_advantage_groups": whole.filtered_groups,
        "grad_norm": stats["grad_norm"],
        "off_policy/staleness_max": step - min(whole.versions),
        "off_policy/staleness_mean": staleness / whole.samples,
        "off_policy/dropped": batch.dropped,
        "queue/depth": batch.depth,
        "micro_batches": len(batch.micro_batches),
        "versions": sorted(whole.versions),
        "samples": whole.samples,
        **times,
        "throughput/tokens_per_s": whole.tokens / elapsed,
        "throughput/samples_per_s": whole.samples / elapsed,
    }
