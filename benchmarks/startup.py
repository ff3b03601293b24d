"""Start-up of the main job, phase by phase: from the `rl` command to the first RL step.

Runs the real command (`rl warmup.steps=0 max_steps=2`, the model already built in the cache)
`--repeats` times and prints, for each phase, the seconds from the command's start, from:
- the launcher's console lines, timestamped as they arrive (the plan made, each server ready);
- the roles' logs (each line carries its wall-clock time);
- the trainer's first record (its step's start is its timestamp less `time/step`).

    uv run python benchmarks/startup.py [--repeats 3] [--cold] [overrides ...]

`--cold` gives each run an empty bytecode cache (PYTHONPYCACHEPREFIX): every process compiles
torch, transformers and the rest from source, as every run did before `rl` let its processes
write the cache (and as the first run on a fresh machine still does).

A warm-up, when a run has one, comes before the first RL step and is not start-up: it is left
out here (`warmup.steps=0`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Phase -> (log file, text of its line); the first such line marks the phase.
LOG_PHASES = {
    "queue listening": ("queue.log", "listening on"),
    "inference listening": ("inference-0.log", "listening on"),
    "trainer: weights read": ("trainer.log", "weights read"),
    "version 0 served": ("orchestrator.log", "loaded version 0 into inference"),
    "eval at version 0 done": ("orchestrator.log", "eval at version 0"),
    "batch 0 generated": ("orchestrator.log", "batch 0 generated"),
}
CONSOLE_PHASES = {"plan made (run directory)": "run directory:"}


def log_time(line: str, day: datetime.date) -> float:
    """A role log line's wall-clock time (lines start with HH:MM:SS.mmm)."""
    clock = datetime.datetime.strptime(line[:12], "%H:%M:%S.%f").time()
    return datetime.datetime.combine(day, clock).timestamp()


def one_run(overrides: list[str], cold: bool) -> dict[str, float]:
    run_dir = Path(tempfile.mkdtemp(prefix="relay-startup-")) / "run"
    cmd = [sys.executable, "-m", "launcher.cli", f"hydra.run.dir={run_dir}", "warmup.steps=0",
           "max_steps=2", *overrides]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as `rl` runs its roles
    if cold:
        env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="relay-pycache-")
    start = time.time()
    phases: dict[str, float] = {}
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            for phase, text in CONSOLE_PHASES.items():
                if text in line and phase not in phases:
                    phases[phase] = time.time() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited with {proc.returncode}")
    end = time.time() - start
    day = datetime.date.today()
    for phase, (name, text) in LOG_PHASES.items():
        lines = (run_dir / "logs" / name).read_text().splitlines()
        found = next(line for line in lines if text in line)
        phases[phase] = log_time(found, day) - start
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    first = next(r for r in records if r.get("kind") == "train" and r["step"] == 1)
    phases["first RL step starts"] = first["timestamp"] - first["time/step"] - start
    phases["first RL step done"] = first["timestamp"] - start
    phases["run ends (2 steps, final eval, plot)"] = end
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="an empty bytecode cache each run")
    args, overrides = parser.parse_known_args()
    runs = [one_run(overrides, args.cold) for _ in range(args.repeats)]
    cache = "an empty bytecode cache" if args.cold else "the bytecode cache written"
    print(f"seconds from the `rl` command, {args.repeats} runs with {cache} (median, min-max):")
    for phase in sorted(runs[0], key=lambda p: statistics.median(r[p] for r in runs)):
        values = [r[phase] for r in runs]
        median, low, high = statistics.median(values), min(values), max(values)
        print(f"  {phase:38s} {median:6.2f}  ({low:.2f}-{high:.2f})")


if __name__ == "__main__":
    main()
