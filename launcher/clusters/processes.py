"""Role processes: start one in its own process group, restart it, stop a set of them.

The local launcher and each Slurm job's supervisor run roles the same way, so both use these.
Every role leads its own process group, and teardown signals those groups by id: a role's
children (torchrun's ranks, vLLM's workers) go with it, and nothing else is touched. A role
that ended on a full disk (rl/core/disk.py's EXIT_CODE) is not restarted: it ends the run with
the line it wrote saying so. Nor is one that fails twice in a row with the same exception (the
`FAILED` line rl/core/runtime.py's `run_role` writes last): restarts are for faults, and a bug
fails the same way again, so the run ends with that line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from rl.core import disk
from rl.core.auth import role_env
from rl.core.rundir import RunDir
from rl.core.runtime import FAILED, NAME_ENV, die_with_parent

STOP_GRACE_S = 5.0
POLL_S = 0.2
"""How often a launcher (local, a Slurm job's supervisor, a shared sweep) looks at its roles."""
# Roles whose clean exit means the run's work is done (the servers should never exit).
FINISHING_ROLES = ("trainer", "orchestrator")


class RunFailed(RuntimeError):
    """A role died or never became ready; the message names it."""


class RoleDiskFull(RunFailed):
    """A role ended on a full disk; the message is one line naming the file and the space."""


@dataclass
class Child:
    """One running role: its process, its log, and how to start it again."""

    name: str
    role: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    hung_for: float | None = None
    """Set when the launcher killed it for showing no sign of life this many seconds."""
    log_start: int = 0
    """Where this start's output begins in its log (a restart appends)."""
    last_error: str | None = None
    """The exception its previous start failed with (`error`), if it failed with one."""

    def restart(self) -> None:
        """Start the role again with the same command (appending to its log)."""
        self.log_file.close()
        again = spawn(self.name, self.role, self.argv, self.env, self.log_path)
        self.proc, self.log_file, self.log_start = again.proc, again.log_file, again.log_start
        self.restarts += 1
        self.hung_for = None

    def error(self) -> str | None:
        """The exception this start of the role failed with, as the last line of its traceback
        (the last `FAILED` line in its log since it started), or None."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self.log_start)
                text = log.read().decode(errors="replace")
        except OSError:
            return None
        said = [line[len(FAILED) :] for line in text.splitlines() if line.startswith(FAILED)]
        return said[-1] if said else None

    def ended(self, code: int) -> str:
        """How it ended, for messages: hung and killed, or exited with `code`."""
        if self.hung_for is not None:
            return f"hung (no sign of life for {self.hung_for:.0f} s) and was killed"
        return f"exited with code {code}"


class Liveness:
    """Tells a hung role from a live one by its heartbeats (rl/core/runtime.py's `Heartbeat`): each
    process of a role beats a counter into the run directory, and a role is hung once one of
    its processes has not beaten for `hung_s` (before its first beat, for `start_s`: imports
    and model loading come first). A stopped process (SIGSTOP), a frozen one, or a server
    whose /health no longer answers all stop beating. Times are this watcher's own monotonic
    clock, so clocks of other nodes do not matter."""

    def __init__(self, run: RunDir, hung_s: float, start_s: float) -> None:
        self.run, self.hung_s, self.start_s = run, hung_s, start_s
        self.seen: dict[Path, tuple[str, float]] = {}
        self.started: dict[str, tuple[int, float]] = {}
        self.stopped: dict[str, float] = {}

    def silence(self, child: Child) -> tuple[float, str]:
        """Seconds `child` has shown no sign of life, and which limit applies (`hung_s`, or
        `ready_s` before its first beat)."""
        now = time.monotonic()
        pid, since = self.started.get(child.name, (-1, now))
        if pid != child.proc.pid:  # (re)started: beats of earlier processes are history
            for path in self.run.heartbeats_of(child.name):
                path.unlink(missing_ok=True)
                self.seen.pop(path, None)
            self.started[child.name] = (child.proc.pid, now)
            return 0.0, "ready_s"
        silent = self.stopped_for(child, now)
        paths = self.run.heartbeats_of(child.name)
        if not paths and not silent:
            return now - since, "ready_s"
        for path in paths:
            try:
                beat = path.read_text()
            except FileNotFoundError:  # that process just ended
                continue
            last = self.seen.get(path)
            if last is None or last[0] != beat:
                self.seen[path] = (beat, now)
            else:
                silent = max(silent, now - last[1])
        return silent, "hung_s"

    def stopped_for(self, child: Child, now: float) -> float:
        """Seconds the role's main process (torchrun, for the trainer) has been stopped
        (SIGSTOP, state T): it runs none of Relay's code, so it has no heartbeat of its own."""
        if not _stopped(child.proc.pid):
            self.stopped.pop(child.name, None)
            return 0.0
        return now - self.stopped.setdefault(child.name, now)

    def kill_if_hung(self, child: Child) -> None:
        """SIGKILL the process group of a role that has been silent past its limit (it then
        counts as dead, and is restarted or fails the run like any death)."""
        silent, key = self.silence(child)
        limit = self.hung_s if key == "hung_s" else self.start_s
        if silent <= limit:
            return
        child.hung_for = silent
        print(
            f"role {child.name} hung: no sign of life for {silent:.1f} s "
            f"(timeouts.{key}={limit:g}); killing it",
            file=sys.stderr,
            flush=True,
        )
        signal_group(child, signal.SIGKILL)
        child.proc.wait()


def _stopped(pid: int) -> bool:
    """Whether `pid` is stopped by a signal (its state in /proc/<pid>/stat is T)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].startswith("T")


def expand(argv: list[str], values: dict[str, str]) -> list[str]:
    """The plan's argv with `${NAME}` placeholders filled in and `python` this interpreter."""
    out = []
    for arg in argv:
        for key, value in values.items():
            arg = arg.replace(f"${{{key}}}", value)
        out.append(sys.executable if arg == "python" else arg)
    return out


def spawn(name: str, role: str, argv: list[str], env: dict[str, str], log_path: Path) -> Child:
    """Start one role in its own process group (so teardown reaches its children), logging to
    `log_path`. SIGUSR2 is ignored: Slurm sends it to every process of a job before its time
    limit, and only the job's supervisor acts on it."""
    log_file = open(log_path, "ab")  # noqa: SIM115 - closed in stop_children
    log_start = log_file.seek(0, os.SEEK_END)
    proc = subprocess.Popen(
        argv,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**role_env(env, role), "PYTHONUNBUFFERED": "1", NAME_ENV: name},
        start_new_session=True,
        preexec_fn=_child_setup,
    )
    return Child(name, role, proc, log_path, log_file, argv, env, log_start=log_start)


def _child_setup() -> None:
    """In the child before exec: ignore SIGUSR2, and get SIGTERM if the launcher dies (killed
    outright it cannot stop its roles, which would otherwise run on as orphans)."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    die_with_parent(signal.SIGTERM)


def stop_children(children: list[Child]) -> None:
    """SIGTERM each child's process group, then SIGKILL what is left after a grace period."""
    for child in children:
        signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        signal_group(child, signal.SIGKILL)
        child.proc.wait()
        child.log_file.close()


def signal_group(child: Child, sig: signal.Signals) -> None:
    try:
        os.killpg(child.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path: Path, lines: int = 15) -> str:
    """The last lines of a log, indented for an error message."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(f"    {line}" for line in text[-lines:])


def ended_on_full_disk(child: Child) -> str:
    """Why a role that exited with rl/core/disk.py's EXIT_CODE ended, in one line: the line it
    wrote to its log naming the file and the space left, or (where the log had no room for it
    either) what is known."""
    try:
        lines = child.log_path.read_text(errors="replace").splitlines()[-50:]
    except OSError:
        lines = []
    said = [found.group(0) for line in lines if (found := disk.LINE.search(line))]
    if not said:
        run_dir = child.log_path.parent.parent  # logs/<name>.log
        free = disk.size(disk.free_bytes(run_dir))
        said = [
            f"disk full writing {run_dir} (its log had no room to name the file; {free} free "
            "on its filesystem)"
        ]
    return (
        f"role {child.name} ended on a full disk: {said[-1]}; not restarted (a restart "
        "meets the same disk): free space there, then resume"
    )


def restart_or_fail(child: Child, code: int, max_restarts: int) -> None:
    """Restart a role that died, or raise RunFailed once it has used its restarts, or at once
    when it ended on a full disk or failed with the same exception as the time before."""
    if code == disk.EXIT_CODE:
        raise RoleDiskFull(ended_on_full_disk(child))
    error = same_error_again(child)
    if child.restarts >= max_restarts:
        after = f" after {child.restarts} restart(s)" if child.restarts else ""
        raise RunFailed(
            f"role {child.name} {child.ended(code)}{after}{with_error(error)}; last lines of "
            f"{child.log_path}:\n{tail(child.log_path)}"
        )
    print(
        f"role {child.name} {child.ended(code)}{with_error(error)}: restarting it "
        f"({child.restarts + 1} of {max_restarts})",
        file=sys.stderr,
        flush=True,
    )
    with open(child.log_path, "ab") as log:
        log.write(f"--- {child.ended(code)}; restarting ---\n".encode())
    child.restart()
    child.last_error = error


def same_error_again(child: Child) -> str | None:
    """The exception a dead role failed with (None: it failed with none, e.g. killed); raises
    RunFailed when its previous start failed with the same one, since restarting a bug only
    meets it again."""
    error = child.error() if child.hung_for is None else None
    if error is not None and error == child.last_error:
        raise RunFailed(
            f"role {child.name} failed twice in a row with the same error, so it is not "
            f"restarted again: {error} (traceback in {child.log_path})"
        )
    return error


def with_error(error: str | None) -> str:
    return f" ({error})" if error else ""


def check_children(
    children: list[Child],
    done: set[str],
    max_restarts: int = 0,
    liveness: Liveness | None = None,
) -> bool:
    """Restart roles that died (a server exiting at all counts) or hung (per `liveness`),
    within `max_restarts` each; returns whether any was restarted. Raises RunFailed for a role
    out of restarts.

    Every role found dead is named: a killed server can take its clients down with it, and the
    launcher may see both at once. Roles ended by a signal are listed first (the likely cause),
    with the last lines of the first one's log. A role that ended on a full disk ends the run
    with its one line instead.
    """
    failed = []
    for child in children:
        if liveness is not None and child.name not in done and child.proc.poll() is None:
            liveness.kill_if_hung(child)
        code = child.proc.poll()
        if code is None or child.name in done:
            continue
        if code == 0 and child.role in FINISHING_ROLES:
            done.add(child.name)
            continue
        failed.append((child, code))
    if not failed:
        return False
    for child, code in failed:  # a full disk ends the run, whatever else died with it
        if code == disk.EXIT_CODE:
            raise RoleDiskFull(ended_on_full_disk(child))
    for child, _ in failed:  # a bug met again ends the run, whatever else died with it
        same_error_again(child)
    failed.sort(key=lambda item: item[1] >= 0)  # signal deaths (negative codes) first
    spent = [(c, code) for c, code in failed if c.restarts >= max_restarts]
    if spent:
        first = spent[0][0]
        names = "; ".join(
            f"role {c.name} {c.ended(code)}"
            + (f" after {c.restarts} restart(s)" if c.restarts else "")
            + with_error(c.error() if c.hung_for is None else None)
            for c, code in failed
        )
        raise RunFailed(f"{names}; last lines of {first.log_path}:\n{tail(first.log_path)}")
    for child, code in failed:
        restart_or_fail(child, code, max_restarts)
    return True
