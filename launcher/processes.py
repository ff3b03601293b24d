"""Role processes: start one in its own process group, restart it, stop a set of them.

The local launcher and each Slurm job's supervisor run roles the same way, so both use these.
Every role leads its own process group, and teardown signals those groups by id: a role's
children (torchrun's ranks, vLLM's workers) go with it, and nothing else is touched.
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

from rl.runtime import die_with_parent

STOP_GRACE_S = 5.0
# Roles whose clean exit means the run's work is done (the servers should never exit).
FINISHING_ROLES = ("trainer", "orchestrator")


class RunFailed(RuntimeError):
    """A role died or never became ready; the message names it."""


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

    def restart(self) -> None:
        """Start the role again with the same command (appending to its log)."""
        self.log_file.close()
        again = spawn(self.name, self.role, self.argv, self.env, self.log_path)
        self.proc, self.log_file = again.proc, again.log_file
        self.restarts += 1


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
    proc = subprocess.Popen(
        argv,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**env, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
        preexec_fn=_child_setup,
    )
    return Child(name, role, proc, log_path, log_file, argv, env)


def _child_setup() -> None:
    """In the child before exec: ignore SIGUSR2, and get SIGTERM if the launcher dies (killed
    outright it cannot stop its roles, which would otherwise run on as orphans)."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    die_with_parent(signal.SIGTERM)


def stop_children(children: list[Child]) -> None:
    """SIGTERM each child's process group, then SIGKILL what is left after a grace period."""
    for child in children:
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _signal_group(child, signal.SIGKILL)
        child.proc.wait()
        child.log_file.close()


def _signal_group(child: Child, sig: signal.Signals) -> None:
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


def restart_or_fail(child: Child, code: int, max_restarts: int) -> None:
    """Restart a role that died, or raise RunFailed once it has used its restarts."""
    if child.restarts >= max_restarts:
        after = f" after {child.restarts} restart(s)" if child.restarts else ""
        raise RunFailed(
            f"role {child.name} exited with code {code}{after}; last lines of "
            f"{child.log_path}:\n{tail(child.log_path)}"
        )
    print(
        f"role {child.name} exited with code {code}: restarting it "
        f"({child.restarts + 1} of {max_restarts})",
        file=sys.stderr,
        flush=True,
    )
    with open(child.log_path, "ab") as log:
        log.write(f"--- exited with code {code}; restarting ---\n".encode())
    child.restart()


def check_children(children: list[Child], done: set[str], max_restarts: int = 0) -> bool:
    """Restart roles that died (a server exiting at all counts), within `max_restarts` each;
    returns whether any was restarted. Raises RunFailed for a role out of restarts.

    Every role found dead is named: a killed server can take its clients down with it, and the
    launcher may see both at once. Roles ended by a signal are listed first (the likely cause),
    with the last lines of the first one's log.
    """
    failed = []
    for child in children:
        code = child.proc.poll()
        if code is None or child.name in done:
            continue
        if code == 0 and child.role in FINISHING_ROLES:
            done.add(child.name)
            continue
        failed.append((child, code))
    if not failed:
        return False
    failed.sort(key=lambda item: item[1] >= 0)  # signal deaths (negative codes) first
    spent = [(c, code) for c, code in failed if c.restarts >= max_restarts]
    if spent:
        first = spent[0][0]
        names = "; ".join(
            f"role {c.name} exited with code {code}"
            + (f" after {c.restarts} restart(s)" if c.restarts else "")
            for c, code in failed
        )
        raise RunFailed(f"{names}; last lines of {first.log_path}:\n{tail(first.log_path)}")
    for child, code in failed:
        restart_or_fail(child, code, max_restarts)
    return True
