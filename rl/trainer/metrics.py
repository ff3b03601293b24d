"""A trainer step's record for metrics.jsonl: the loss numbers summed over micro-batches and
ranks, the batch's rewards, staleness and environment metrics, its times, and memory."""

from __future__ import annotations

import os
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


def env_metrics(samples: list[Sample]) -> dict[str, float]:
    """Means over the batch of the per-episode metrics an environment keeps (`env/<name>`)."""
    values: dict[str, list[float]] = {}
    for sample in samples:
        for key, value in sample.env_metrics.items():
            values.setdefault(f"env/{key}", []).append(value)
    return {key: sum(v) / len(v) for key, v in values.items()}


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
    samples: list[Sample],
    stats: dict[str, float],
    times: dict[str, float],
) -> dict[str, Any]:
    """Step `step + 1`'s numbers: the loss numbers of `stats` (whole-batch sums, the same on
    every rank), the step's `times`, the rest from the whole batch's `samples`."""
    staleness = [step - s.min_version for s in samples]
    tokens = sum(s.tokens for s in samples)
    elapsed = times["time/step"]
    return {
        "reward/mean": sum(s.reward for s in samples) / len(samples),
        "loss": stats["loss"],
        "entropy": stats["entropy"],
        "mismatch_kl": stats["mismatch_kl"],
        "masked_fraction": stats["masked_fraction"],
        "clipped_fraction": stats["clipped_fraction"],
        "ratio/mean": stats["ratio_mean"],
        "ratio/max": stats["ratio_max"],
        "ratio/min": stats["ratio_min"],
        "filter/zero_advantage_groups": sum(s.filtered_groups for s in samples),
        "grad_norm": stats["grad_norm"],
        "off_policy/staleness_max": max(staleness),
        "off_policy/staleness_mean": sum(staleness) / len(staleness),
        "off_policy/dropped": batch.dropped,
        "queue/depth": batch.depth,
        "micro_batches": len(batch.micro_batches),
        "versions": sorted({s.min_version for s in samples}),
        "samples": len(samples),
        **times,
        "throughput/tokens_per_s": tokens / elapsed,
        "throughput/samples_per_s": len(samples) / elapsed,
    }
