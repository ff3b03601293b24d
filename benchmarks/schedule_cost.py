"""What the fixed schedule costs: the main job (`rl`, reverse-text) with `algorithm.schedule`
fixed (batch N by exactly version N - async_level: the run is a function of its config) and
newest (by the newest version published by then), and with `--before REV` the main job of
an earlier commit too (a git worktree of it, run with this environment), configurations
interleaved per seed, each run a process of its own. Prints each run's RL seconds (from the
first batch's generation to the last step's end), its final held-out exact match and
staleness, then per configuration mean +- sd and the ratio of RL time to the fixed
schedule's.

    uv run python benchmarks/schedule_cost.py [--seeds 3] [--before REV] [rl overrides...]
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


def run(checkout: Path, extra: list[str], seed: int, out: Path) -> dict[str, float]:
    """One main job of `checkout`; its RL seconds, final exact match and mean staleness."""
    argv = [sys.executable, "-m", "launcher.cli", f"seed={seed}", f"hydra.run.dir={out}", *extra]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    subprocess.run(argv, cwd=checkout, env=env, check=True, capture_output=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in records if r["kind"] == "rollout"]
    train = sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])
    evals = sorted((r for r in records if r["kind"] == "eval"), key=lambda r: r["step"])
    start = min(r["at/generate_start"] for r in rollouts)
    return {
        "rl_s": train[-1].get("at/published", train[-1]["at/train_end"]) - start,
        "exact": evals[-1]["eval/exact_match"],
        "staleness": statistics.mean(r["off_policy/staleness_mean"] for r in train),
    }


def mean_sd(values: list[float], digits: int = 1) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} +- {sd:.{digits}f}"


def measure(configs: dict[str, tuple[Path, list[str]]], seeds: int, tmp: Path) -> dict:
    """Every configuration once per seed, the order rotated from seed to seed."""
    results: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    names = list(configs)
    for seed in range(seeds):
        for name in names[seed % len(names) :] + names[: seed % len(names)]:
            checkout, extra = configs[name]
            found = run(checkout, extra, seed, tmp / f"{name.split()[0]}-{seed}")
            results[name].append(found)
            line = f"{name:16} seed {seed}: RL {found['rl_s']:.1f} s, exact "
            print(f"{line}{found['exact']:.3f}, staleness {found['staleness']:.2f}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--before", help="also run the main job of this commit")
    args, overrides = parser.parse_known_args()
    configs = {
        "fixed": (ROOT, ["algorithm.schedule=fixed", *overrides]),
        "newest": (ROOT, ["algorithm.schedule=newest", *overrides]),
    }
    with tempfile.TemporaryDirectory(prefix="relay-schedule-") as tmp:
        if args.before:
            before = Path(tmp) / "before"
            git = ["git", "-C", str(ROOT), "worktree"]
            subprocess.run([*git, "add", "--detach", str(before), args.before], check=True)
            configs[f"before {args.before[:7]}"] = (before, overrides)
        try:
            results = measure(configs, args.seeds, Path(tmp))
        finally:
            if args.before:
                subprocess.run([*git, "remove", "--force", str(before)], check=True)
    print()
    print(f"{'configuration':16} {'RL s':>14} {'exact match':>16} {'staleness':>12} {'RL time':>8}")
    fixed = statistics.mean(f["rl_s"] for f in results["fixed"])
    for name, found in results.items():
        ratio = statistics.mean(f["rl_s"] for f in found) / fixed
        print(f"{name:16} {mean_sd([f['rl_s'] for f in found]):>14} "
              f"{mean_sd([f['exact'] for f in found], 3):>16} "
              f"{mean_sd([f['staleness'] for f in found], 2):>12} {ratio:>7.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
