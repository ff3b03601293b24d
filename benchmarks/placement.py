"""Split against colocated placement on this machine: the same reverse-text run side by side
(inference and trainer at once, half the cores each, async_level 1) and in turns (each with
every core, on-policy), in one invocation.

Prints, for each: trained samples per second (from the third step to the last, start-up
excluded), the wall time and trainer steps until held-out exact match first reaches the target
(evals every `--eval-every` versions), and the final exact match.

    uv run python benchmarks/placement.py [--steps 300] [--target 0.3] [extra overrides ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rl.core.kinds import is_eval, is_train
from rl.core.rundir import RunDir
from tests.support.runs import ROOT


def measure(run_dir: Path, target: float) -> dict[str, float | None]:
    records = RunDir(run_dir).read_metrics()
    train = sorted(filter(is_train, records), key=lambda r: r["step"])
    evals = sorted(filter(is_eval, records), key=lambda r: r["step"])
    steady = train[2:]
    span = steady[-1]["timestamp"] - (steady[0]["timestamp"] - steady[0]["time/step"])
    # Wall time to the target: from the end of warm-up (the first train step's start) to the
    # end of the step whose version first reached it.
    start = train[0]["timestamp"] - train[0]["time/step"]
    reached = next((e["step"] for e in evals if e["eval/exact_match"] >= target), None)
    # Version 0 is where RL starts: a target it already meets took no RL time.
    at = {0: start, **{r["step"]: r["timestamp"] for r in train}}.get(reached)
    return {
        "samples_per_s": sum(r["samples"] for r in steady) / span,
        "steps_to_target": reached,
        "seconds_to_target": None if at is None else at - start,
        "final_exact": evals[-1]["eval/exact_match"],
    }


def run(placement: str, args: argparse.Namespace, root: Path) -> dict[str, float | None]:
    run_dir = root / placement
    cmd = [
        sys.executable, "-m", "launcher.cli", f"hydra.run.dir={run_dir}", f"placement={placement}",
        f"max_steps={args.steps}", f"environment.eval_every={args.eval_every}",
        "environment.eval_size=200", *args.overrides,
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled"}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"placement={placement} failed:\n{out.stderr[-2000:]}")
    return measure(run_dir, args.target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--target", type=float, default=0.3)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("overrides", nargs="*", help="extra rl overrides for both runs")
    args = parser.parse_args()
    print(
        f"{'placement':<10} {'samples/s':>9} {'to exact >= ' + str(args.target):>22} {'final':>6}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for placement in ("split", "colocated"):
            m = run(placement, args, Path(tmp))
            reached = (
                f"{m['seconds_to_target']:.0f} s, step {m['steps_to_target']}"
                if m["steps_to_target"] is not None
                else "not reached"
            )
            print(
                f"{placement:<10} {m['samples_per_s']:>9.1f} {reached:>22} "
                f"{m['final_exact']:>6.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
