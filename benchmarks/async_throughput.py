"""Throughput of the same RL workload with async_level=0 (on-policy) and async_level=1.

Runs `rl` twice through the real launcher (tiny model, reverse_text, no warm-up, no evals in
between) and prints trained samples per second for both and their ratio. Throughput counts from
the start of the first trainer step to the end of the last, so start-up is excluded.

    uv run python benchmarks/async_throughput.py [--steps 40] [extra overrides ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rl.core.kinds import is_train
from rl.core.rundir import RunDir
from tests.support.runs import ROOT


def samples_per_second(run_dir: Path) -> float:
    records = RunDir(run_dir).read_metrics()
    train = sorted(filter(is_train, records), key=lambda r: r["step"])
    # Skip the first steps: they include the first generation with nothing to overlap.
    steady = train[2:]
    span = steady[-1]["timestamp"] - (steady[0]["timestamp"] - steady[0]["time/step"])
    return sum(r["samples"] for r in steady) / span


def run(async_level: int, steps: int, extra: list[str], root: Path) -> float:
    run_dir = root / f"async{async_level}"
    cmd = [
        sys.executable, "-m", "launcher.cli", f"hydra.run.dir={run_dir}",
        f"max_steps={steps}", "warmup.steps=0", f"environment.eval_every={steps}",
        "environment.eval_size=32", f"algorithm.async_level={async_level}", *extra,
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled"}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"async_level={async_level} failed:\n{out.stderr[-2000:]}")
    return samples_per_second(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("overrides", nargs="*", help="extra rl overrides for both runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sync = run(0, args.steps, args.overrides, Path(tmp))
        print(f"async_level=0: {sync:8.1f} samples/s", flush=True)
        asynchronous = run(1, args.steps, args.overrides, Path(tmp))
        print(f"async_level=1: {asynchronous:8.1f} samples/s", flush=True)
    print(f"ratio async/sync: {asynchronous / sync:.2f}")


if __name__ == "__main__":
    main()
