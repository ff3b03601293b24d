"""What the fixed schedule costs: the main job (`rl`, reverse-text) with `algorithm.schedule`
fixed (batch N by exactly version N - async_level: the run is a function of its config) and
newest (by the newest version published by then), seeds interleaved, each run a process of
its own. Prints each run's RL seconds (from the first batch's generation to the last step's
end), its final held-out exact match and staleness, then per schedule mean +- sd and the
ratio of RL time.

    uv run python benchmarks/schedule_cost.py [--seeds 3] [rl overrides...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rl.core.paths import ROOT

SCHEDULES = ("fixed", "newest")


def run(schedule: str, seed: int, out: Path, overrides: list[str]) -> dict[str, float]:
    """One main job; its RL seconds, final exact match and mean staleness."""
    argv = [sys.executable, "-m", "launcher.cli", f"algorithm.schedule={schedule}",
            f"seed={seed}", f"hydra.run.dir={out}", *overrides]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled"}
    subprocess.run(argv, cwd=ROOT, env=env, check=True, capture_output=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in records if r["kind"] == "rollout"]
    train = sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])
    evals = sorted((r for r in records if r["kind"] == "eval"), key=lambda r: r["step"])
    start = min(r["at/generate_start"] for r in rollouts)
    return {
        "rl_s": train[-1]["at/train_end"] - start,
        "exact": evals[-1]["eval/exact_match"],
        "staleness": statistics.mean(r["off_policy/staleness_mean"] for r in train),
    }


def mean_sd(values: list[float], digits: int = 1) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} +- {sd:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    args, overrides = parser.parse_known_args()
    results: dict[str, list[dict[str, float]]] = {s: [] for s in SCHEDULES}
    with tempfile.TemporaryDirectory(prefix="relay-schedule-") as tmp:
        for seed in range(args.seeds):
            order = SCHEDULES if seed % 2 == 0 else SCHEDULES[::-1]  # interleaved
            for schedule in order:
                found = run(schedule, seed, Path(tmp) / f"{schedule}-{seed}", overrides)
                results[schedule].append(found)
                line = f"{schedule:6} seed {seed}: RL {found['rl_s']:.1f} s, exact "
                print(f"{line}{found['exact']:.3f}, staleness {found['staleness']:.2f}", flush=True)
    print()
    print(f"{'schedule':8} {'RL s':>14} {'exact match':>16} {'staleness':>12}")
    for schedule, found in results.items():
        print(f"{schedule:8} {mean_sd([f['rl_s'] for f in found]):>14} "
              f"{mean_sd([f['exact'] for f in found], 3):>16} "
              f"{mean_sd([f['staleness'] for f in found], 2):>12}")  # fmt: skip
    ratio = statistics.mean(f["rl_s"] for f in results["fixed"]) / statistics.mean(
        f["rl_s"] for f in results["newest"]
    )
    print(f"fixed / newest RL time: {ratio:.3f}")


if __name__ == "__main__":
    main()
