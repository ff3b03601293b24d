"""A LoRA learning-rate sweep with one shared inference service, against the same points run
one after another, each with its own.

Runs the real `rl` command twice, in one invocation, on the same points (reverse-text, tiny
model, `model.lora.rank`, the learning rates given):

- shared: `rl -m inference.shared=true ...`: one warm-up, one inference server holding every
  point's adapter, the points' queues, orchestrators and trainers side by side;
- sequential: `rl -m ...`: Hydra's basic launcher, each point a whole run of its own (its own
  warm-up and its own inference server), one after another.

Prints each side's wall time (the whole command, start-up included), the ratio
shared / sequential, the machine's load average before each, and each point's held-out exact
match before and after, so the speed is seen next to what was learned.

    uv run python benchmarks/shared_sweep.py [--steps 300] [--lrs 1e-3,3e-3,6e-3] [--rank 16]
        [extra overrides ...]

Extra overrides apply to every point of both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launcher.sweeps.summary import sweep_points
from rl.core.kinds import is_eval
from tests.support.runs import ROOT


def run_sweep(sweep_dir: Path, args: argparse.Namespace, shared: bool) -> float:
    argv = [
        sys.executable, "-m", "launcher.cli", "-m", f"max_steps={args.steps}",
        f"model.lora.rank={args.rank}", f"algorithm.lr={args.lrs}",
        f"hydra.sweep.dir={sweep_dir}", *(["inference.shared=true"] if shared else []),
        *args.overrides,
    ]  # fmt: skip
    log = sweep_dir.with_suffix(".log")
    sweep_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as out:
        code = subprocess.call(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                               env={**os.environ, "WANDB_MODE": "disabled"})  # fmt: skip
    seconds = time.monotonic() - t0
    if code != 0:
        sys.exit(f"{'shared' if shared else 'sequential'} sweep failed ({code}); see {log}")
    return seconds


def exact_matches(sweep_dir: Path) -> list[tuple[str, float, float, str]]:
    """Each point's learning rate, first and last held-out exact match, and status."""
    rows = []
    for run in sweep_points(sweep_dir):
        evals = sorted((r for r in run.read_metrics() if is_eval(r)), key=lambda r: r["step"])
        status = json.loads(run.summary.read_text())["status"]
        lr = str(run.load_config().algorithm.lr)
        rows.append((lr, evals[0]["eval/exact_match"], evals[-1]["eval/exact_match"], status))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lrs", default="1e-3,3e-3,6e-3")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("overrides", nargs="*", help="extra rl overrides for every point")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        walls, loads, results = {}, {}, {}
        for side in ("shared", "sequential"):
            loads[side] = os.getloadavg()[0]
            sweep_dir = Path(tmp) / side
            walls[side] = run_sweep(sweep_dir, args, side == "shared")
            results[side] = exact_matches(sweep_dir)
            print(f"{side}: {walls[side]:.0f} s", flush=True)
    points = len(args.lrs.split(","))
    print(f"\n{points} LoRA points (rank {args.rank}), {args.steps} steps each, this machine "
          f"({os.cpu_count()} cores)\n")  # fmt: skip
    print("| side | wall | load avg before | per point: lr, exact match first -> last |")
    print("|---|---|---|---|")
    for side in ("shared", "sequential"):
        cells = "; ".join(f"{lr}: {a:.3f} -> {b:.3f} ({s})" for lr, a, b, s in results[side])
        print(f"| {side} | {walls[side]:.0f} s | {loads[side]:.2f} | {cells} |")
    print(f"\nshared / sequential wall time: {walls['shared'] / walls['sequential']:.2f}")


if __name__ == "__main__":
    main()
