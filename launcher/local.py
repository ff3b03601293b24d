"""The local launcher: every role a child process in its own process group on this machine.

It writes the run directory, starts the roles from the plan, waits for each server to be
ready, shows progress from metrics.jsonl, and tears everything down together: on success, on
Ctrl-C, and as soon as any role dies (naming it and showing its last log lines). Only our own
process groups are signalled, by id (launcher/processes.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from launcher.plan import RunPlan
from launcher.processes import (
    FINISHING_ROLES,
    Child,
    RunFailed,
    check_children,
    expand,
    spawn,
    stop_children,
)
from launcher.report import finish_run, read_records
from launcher.setup import prepare_run_dir
from rl.records import is_eval, is_train
from rl.rundir import RunDir

READY_TIMEOUT_S = 600.0


def start_children(run_plan: RunPlan, run: RunDir, token: str) -> list[Child]:
    children = []
    for spec in run_plan.processes:
        values = {"RELAY_RUN_DIR": str(run.root)}
        env = {**os.environ, **spec.env, "RELAY_TOKEN": token, **values}
        argv = expand(spec.argv, values)
        children.append(spawn(spec.name, spec.role, argv, env, run.log(spec.name)))
    record_pids(run, children)
    return children


def record_pids(run: RunDir, children: list[Child]) -> None:
    """Each child leads its own process group (pgid == pid): recorded for audits, tests, and
    to refuse resuming a run that is still running."""
    run.write_pids({c.name: c.proc.pid for c in children})


class Progress:
    """Prints one line per trainer step and per eval from metrics.jsonl as they appear."""

    def __init__(self, metrics: Path, max_steps: int) -> None:
        self.metrics, self.max_steps = metrics, max_steps
        self.offset = 0
        self.last_eval: float | None = None
        self.records: list[dict] = []

    def skip_existing(self) -> None:
        """Show only what is recorded from now on (a resumed run's history is on disk)."""
        if self.metrics.exists():
            self.offset = self.metrics.stat().st_size

    def poll(self) -> None:
        if not self.metrics.exists():
            return
        if self.metrics.stat().st_size < self.offset:  # a resumed trainer dropped records
            self.offset = self.metrics.stat().st_size
        with open(self.metrics) as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self.offset += len(complete)
        for line in complete.splitlines():
            record = json.loads(line)
            self.records.append(record)
            text = self.format(record)
            if text:
                print(text, flush=True)

    def format(self, r: dict) -> str | None:
        """The line for a train or eval record (None for any other kind)."""
        if is_eval(r):
            self.last_eval = r["eval/exact_match"]
            return (
                f"eval  @ version {r['step']:>3}: exact_match {r['eval/exact_match']:.3f}  "
                f"reward {r['eval/reward/mean']:.3f}"
            )
        if not is_train(r):
            return None
        return (
            f"step {r['step']:>3}/{self.max_steps}  reward {r['reward/mean']:.3f}  "
            f"loss {r['loss']:+.4f}  samples/s {r['throughput/samples_per_s']:.0f}  "
            f"staleness {r['off_policy/staleness_max']}  step {r['time/step']:.2f}s"
        )


def wait_ready(run_plan: RunPlan, run: RunDir, children: list[Child]) -> None:
    servers = ["queue"] + [p.name for p in run_plan.role("inference")]
    deadline = time.monotonic() + READY_TIMEOUT_S
    for name in servers:
        while not run.address_file(name).exists():
            check_children(children, set())
            if time.monotonic() > deadline:
                raise RunFailed(f"role {name} did not become ready in {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.1)
        print(f"ready: {name}", flush=True)


def supervise(
    cfg: DictConfig, run_plan: RunPlan, run: RunDir, children: list[Child], progress: Progress
) -> None:
    """Wait for the servers, then restart roles that die and show progress until the trainer
    and orchestrator have finished."""
    wait_ready(run_plan, run, children)
    done: set[str] = set()
    finishing = {c.name for c in children if c.role in FINISHING_ROLES}
    while done != finishing:
        if check_children(children, done, cfg.max_restarts):
            record_pids(run, children)
        progress.poll()
        time.sleep(0.2)
    progress.poll()


def run_local(cfg: DictConfig, run_plan: RunPlan, resume: RunDir | None = None) -> None:
    """Start every role of the plan here and supervise it to the end; with `resume`, continue
    the run in that directory (each role picks up from its own state there)."""
    if resume is None:
        run, token = prepare_run_dir(cfg, run_plan)
    else:
        run, token = resume, resume.token()
    print(f"run directory: {run.root}", flush=True)
    t0 = time.monotonic()
    progress = Progress(run.metrics, cfg.max_steps)
    if resume is not None:
        progress.skip_existing()
    children = start_children(run_plan, run, token)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        supervise(cfg, run_plan, run, children, progress)
    except KeyboardInterrupt:
        print("interrupted: stopping every role", file=sys.stderr, flush=True)
        stop_children(children)
        raise SystemExit(130) from None
    except RunFailed as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        stop_children(children)
        raise SystemExit(1) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    stop_children(children)
    finish_run(cfg, run, read_records(run.metrics), time.monotonic() - t0)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
