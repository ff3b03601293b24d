"""Wall time of whole `rl` commands that start nothing: `--help` and two dry runs.

Each command runs as a fresh process (`python -m launcher.cli`, the same entry point as the `rl`
script) from an empty temporary directory, `--repeats` times; prints the median and the
fastest wall time. This is what a user waits for before a run starts or a plan is printed, so
it covers interpreter start-up, imports and Hydra composition.

    uv run python benchmarks/cli_latency.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = [
    ["--help"],
    ["dry_run=true"],
    ["model=glm5", "parallel=ep8", "cluster=slurm", "dry_run=true"],
]


def time_command(args: list[str], cwd: str, repeats: int) -> list[float]:
    """Wall seconds of each run; `launcher.cli` comes from the installed project, not cwd."""
    cmd = [sys.executable, "-m", "launcher.cli", *args]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
        times.append(time.perf_counter() - t0)
        if out.returncode != 0:
            raise SystemExit(f"rl {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'command':<55} {'median s':>9} {'min s':>7}")
    with tempfile.TemporaryDirectory() as cwd:
        for command in COMMANDS:
            times = time_command(command, cwd, args.repeats)
            label = "rl " + " ".join(command)
            print(f"{label:<55} {statistics.median(times):>9.2f} {min(times):>7.2f}", flush=True)


if __name__ == "__main__":
    main()
