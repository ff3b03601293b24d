"""The local launcher: every role a child process in its own process group on this machine.

It writes the run directory, starts the roles from the plan, waits for each server to be
ready, shows progress and logs to wandb as metrics.jsonl grows (launcher/watch/tracking.py), and
tears everything down together: on success, on Ctrl-C, and as soon as any role dies (naming
it and showing its last log lines), writing summary.json with how it ended. Only our own
process groups are signalled, by id (launcher/clusters/processes.py).

Ctrl-C (or SIGTERM) first asks the trainer to checkpoint the step under way, as a Slurm job's
time-limit signal does, and waits for it (up to `timeouts.interrupt_s`); a second one stops
every role at once. Either way the run ends in a few lines, with the command that resumes it,
and no traceback.

A full disk, met by a role or by the launcher's own writes (pids, wall time, how far metrics
were followed), ends the run the same way, in one line naming the file and the space left:
the summary is written if there is room for it (the console says where, or that there was
not), and the command that resumes the run is printed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from omegaconf import DictConfig

from launcher.clusters.processes import (
    FINISHING_ROLES,
    POLL_S,
    Child,
    Liveness,
    RoleDiskFull,
    RunFailed,
    check_children,
    expand,
    signal_group,
    spawn,
    stop_children,
)
from launcher.clusters.run_dir import prepare_run_dir
from launcher.plan.planner import RunPlan, plan_header, warm_up_line
from launcher.watch.report import finish_run, override, sweep_group
from launcher.watch.tracking import Follow
from rl.core.disk import DiskFull
from rl.core.rundir import RunDir, write_atomic
from rl.core.runtime import CHECKPOINT_ON_TERM_ENV, RUN_DIR_ENV

WALL_EVERY_S = 5.0  # how often the run's wall time so far is saved (for a resume's summary)


def start_children(run_plan: RunPlan, run: RunDir, token: str) -> list[Child]:
    children = []
    for spec in run_plan.processes:
        values = {RUN_DIR_ENV: str(run.root)}
        env = {**os.environ, **spec.env, "RELAY_TOKEN": token, **values}
        if spec.role == "trainer":  # a SIGTERM ends its wait for a batch (Ctrl-C, below)
            env[CHECKPOINT_ON_TERM_ENV] = "1"
        argv = expand(spec.argv, values)
        children.append(spawn(spec.name, spec.role, argv, env, run.log(spec.name)))
    return children


def record_pids(run: RunDir, children: list[Child]) -> None:
    """Each child leads its own process group (pgid == pid): recorded for audits, tests, and
    to refuse resuming a run that is still running."""
    run.write_pids({c.name: c.proc.pid for c in children})


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
    servers = [p.name for p in run_plan.processes if p.role in ("queue", "inference", "router")]
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


def supervise(run_plan: RunPlan, run: RunDir, watch: Watch, follow: Follow) -> None:
    """Wait for the servers, then restart roles that die or hang and show progress until the
    trainer and orchestrator have finished."""
    wait_ready(run_plan, run, watch)
    finishing = {c.name for c in watch.children if c.role in FINISHING_ROLES}
    while watch.done != finishing:
        watch.check()
        follow.poll()
        time.sleep(POLL_S)


def run_local(cfg: DictConfig, run_plan: RunPlan, resume: RunDir | None = None) -> None:
    """Start every role of the plan here and supervise it to the end; with `resume`, continue
    the run in that directory (each role picks up from its own state there)."""
    if resume is None:
        run, token = prepare_run_dir(cfg, run_plan)
    else:
        run, token = resume, resume.token()
        for asked in (run.checkpoint_request, run.checkpointed):  # an earlier Ctrl-C's
            asked.unlink(missing_ok=True)
    print(plan_header(run_plan, cfg, resume), flush=True)
    if said := warm_up_line(cfg, resume):
        print(said, flush=True)
    print(f"run directory: {run.root}", flush=True)
    follow = Follow(cfg, run, echo=True, group=sweep_group())
    children = start_children(run_plan, run, token)
    watch = Watch(cfg, run, children)
    # Ctrl-C and SIGTERM stop the run, also where SIGINT came ignored (a background job).
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    previous_int = signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        record_pids(run, children)
        supervise(run_plan, run, watch, follow)
    except KeyboardInterrupt:
        checkpoint_on_interrupt(run, children, cfg.timeouts.interrupt_s)
        with ignoring_interrupts():  # the teardown is bounded: let it write the summary
            _end(cfg, run, children, watch, follow, "interrupted")
        raise SystemExit(130) from None
    except (RunFailed, DiskFull) as err:  # a role failed; the launcher's own write failed
        print(f"error: {err}", file=sys.stderr, flush=True)
        full = isinstance(err, DiskFull | RoleDiskFull)
        _end(cfg, run, children, watch, follow, "failed", str(err) if full else None)
        raise SystemExit(1) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    _end(cfg, run, children, watch, follow, "finished")


def _end(
    cfg: DictConfig,
    run: RunDir,
    children: list[Child],
    watch: Watch,
    follow: Follow,
    status: str,
    disk_full: str | None = None,
) -> None:
    """Stop every role, log what is left, and write the run's summary; a run that did not
    finish also gets the command that resumes it. A run that ended on a full disk (`disk_full`
    says how) first loses what was left half-written (its space is the summary's), records
    the reason in its summary, and the console says where the summary went; a summary the
    disk has no room for is named as missing, and the run ends all the same."""
    stop_children(children)
    if disk_full is not None and (removed := run.remove_unfinished()):
        names = ", ".join(str(path.relative_to(run.root)) for path in removed)
        print(f"removed what was left half-written: {names}", file=sys.stderr, flush=True)
    mode = follow.tracker.mode
    with contextlib.suppress(DiskFull):  # the summary below has the wall time all the same
        watch.save_wall_time()
    with contextlib.suppress(DiskFull):  # a later launch shows the rest again
        mode = follow.close(exit_code=0 if status == "finished" else 1)
    try:
        finish_run(cfg, run, watch.wall_time(), mode, status, disk_full)
    except DiskFull as full:
        print(f"error: no summary.json: {full}", file=sys.stderr, flush=True)
    else:
        if disk_full is not None:
            print(f"summary: {run.summary}", file=sys.stderr, flush=True)
    if status != "finished":
        print(resume_command(run), file=sys.stderr, flush=True)


def resume_command(run: RunDir) -> str:
    return f"to resume at {run.resume_point()}: uv run rl {override('resume', run.root)}"


def read_waiting(run: RunDir) -> int | None:
    """The batch the trainer waits for (None: it is not waiting, or has not said)."""
    try:
        return int(run.trainer_waiting.read_text())
    except (OSError, ValueError):
        return None


def checkpoint_on_interrupt(run: RunDir, children: list[Child], budget_s: float) -> None:
    """Ask the trainer to checkpoint the step under way and stop, and wait for it (up to
    `budget_s`), unless a second Ctrl-C says to stop at once."""
    trainers = [c for c in children if c.role == "trainer" and c.proc.poll() is None]
    if not trainers:
        print("interrupted: stopping every role", file=sys.stderr, flush=True)
        return
    run.control.mkdir(exist_ok=True)
    run.checkpoint_request.touch()
    waiting = read_waiting(run)
    if waiting is None:
        said = "the trainer checkpoints the step under way, then every role stops"
    else:  # no step under way: SIGTERM ends the wait (as Slurm's does), the checkpoint stays
        said = (f"the trainer waits for batch {waiting}, no step under way: it checkpoints the "
                "steps it trained and stops now, then every role stops")  # fmt: skip
        for trainer in trainers:
            signal_group(trainer, signal.SIGTERM)
    print(f"interrupted: {said} (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
    deadline = time.monotonic() + budget_s
    try:
        while time.monotonic() < deadline and any(c.proc.poll() is None for c in trainers):
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        print("stopping every role now, without that checkpoint", file=sys.stderr, flush=True)
        return
    step = run.checkpointed.read_text().strip() if run.checkpointed.exists() else None
    if step == "0":
        print("no step was trained yet, so nothing to checkpoint; stopping every role",
              file=sys.stderr, flush=True)  # fmt: skip
    elif step is not None:
        print(f"checkpointed at step {step}; stopping every role", file=sys.stderr, flush=True)
    else:
        said = "stopped" if all(c.proc.poll() is not None for c in trainers) else "did not stop"
        print(
            f"the trainer {said} without a checkpoint (waited up to {budget_s:g} s, "
            "timeouts.interrupt_s); stopping every role",
            file=sys.stderr,
            flush=True,
        )


@contextlib.contextmanager
def ignoring_interrupts() -> Iterator[None]:
    """Ctrl-C and SIGTERM do nothing inside (a third press during the bounded teardown)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous_term = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, previous_term)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
