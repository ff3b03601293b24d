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
    Liveness,
    RunFailed,
    check_children,
    expand,
    spawn,
    stop_children,
)
from launcher.report import finish_run, read_records
from launcher.setup import prepare_run_dir
from rl.records import is_eval, is_train
from rl.rundir import RunDir, write_atomic

WALL_EVERY_S = 5.0  # how often the run's wall time so far is saved (for a resume's summary)


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


class Watch:
    """What the launcher checks while the run goes on: deaths and hangs of its roles (each
    restarted within `max_restarts`), and the run's wall time so far."""

    def __init__(self, cfg: DictConfig, run: RunDir, children: list[Child]) -> None:
        self.run, self.children, self.max_restarts = run, children, cfg.max_restarts
        timeouts = cfg.timeouts
        self.liveness = Liveness(run, timeouts.hung_s, timeouts.ready_s)
        self.ready_s = timeouts.ready_s
        self.done: set[str] = set()
        self.t0 = time.monotonic()
        self.before = _seconds(run.wall_time)  # earlier launches of this run (resumes)
        self.saved = self.t0

    def check(self) -> None:
        if check_children(self.children, self.done, self.max_restarts, self.liveness):
            record_pids(self.run, self.children)
        if time.monotonic() - self.saved > WALL_EVERY_S:
            self.save_wall_time()

    def wall_time(self) -> float:
        return self.before + time.monotonic() - self.t0

    def save_wall_time(self) -> None:
        write_atomic(self.run.wall_time, f"{self.wall_time():.1f}")
        self.saved = time.monotonic()


def _seconds(path: Path) -> float:
    try:
        return float(path.read_text())
    except (FileNotFoundError, ValueError):
        return 0.0


def wait_ready(run_plan: RunPlan, run: RunDir, watch: Watch) -> None:
    """Wait for every server to listen; a role that dies meanwhile is restarted like later."""
    servers = ["queue"] + [p.name for p in run_plan.role("inference")]
    deadline = time.monotonic() + watch.ready_s
    for name in servers:
        while not run.address_file(name).exists():
            watch.check()
            if time.monotonic() > deadline:
                raise RunFailed(
                    f"role {name} did not become ready in {watch.ready_s:.0f} s (timeouts.ready_s)"
                )
            time.sleep(0.1)
        print(f"ready: {name}", flush=True)


def supervise(run_plan: RunPlan, run: RunDir, watch: Watch, progress: Progress) -> None:
    """Wait for the servers, then restart roles that die or hang and show progress until the
    trainer and orchestrator have finished."""
    wait_ready(run_plan, run, watch)
    finishing = {c.name for c in watch.children if c.role in FINISHING_ROLES}
    while watch.done != finishing:
        watch.check()
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
    progress = Progress(run.metrics, cfg.max_steps)
    if resume is not None:
        progress.skip_existing()
    children = start_children(run_plan, run, token)
    watch = Watch(cfg, run, children)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        supervise(run_plan, run, watch, progress)
    except KeyboardInterrupt:
        print("interrupted: stopping every role", file=sys.stderr, flush=True)
        stop_children(children)
        watch.save_wall_time()
        print(resume_command(run), file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except RunFailed as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        stop_children(children)
        watch.save_wall_time()
        print(resume_command(run), file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    stop_children(children)
    watch.save_wall_time()
    finish_run(cfg, run, read_records(run.metrics), watch.wall_time())


def resume_command(run: RunDir) -> str:
    return f"to resume at {run.resume_point()}: uv run rl resume={run.root}"


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
