"""Fault injection for tests: kill -9 (or stop) a chosen role of a running run at a chosen
step."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from rl.core.rundir import RunDir


def trained_steps(run_dir: Path) -> list[int]:
    """The steps the trainer has recorded, in file order."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return []
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r["step"] for r in records if "reward/mean" in r]


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it, parents first (read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended while we looked
            continue
        ppid = int(text[text.rfind(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, at = [pid], 0
    while at < len(tree):
        tree += children.get(tree[at], [])
        at += 1
    return tree


def signal_role(pid: int, sig: signal.Signals) -> None:
    """Send `sig` to a role's whole process tree: its process group, and every process below
    it that may have left the group (a child that starts a session of its own)."""
    tree = process_tree(pid)
    os.killpg(pid, sig)
    for each in tree:
        try:
            os.kill(each, sig)
        except ProcessLookupError:
            pass


class KillAtStep(threading.Thread):
    """Once the trainer has recorded `step`, send `sig` (SIGKILL; SIGSTOP hangs it) to the
    process tree of `role` (a process name from the run's pids.json: queue, orchestrator,
    inference-0, trainer). Gives up after `timeout` seconds; `killed_pid` says whether and what
    it signalled."""

    def __init__(
        self,
        run_dir: Path,
        role: str,
        step: int,
        timeout: float = 600.0,
        sig: signal.Signals = signal.SIGKILL,
    ) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.role, self.step, self.timeout = run_dir, role, step, timeout
        self.sig = sig
        self.killed_pid: int | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout
        while not self.stopped.is_set() and time.monotonic() < deadline:
            steps = trained_steps(self.run_dir)
            if steps and max(steps) >= self.step:
                pid = RunDir(self.run_dir).read_pids()[self.role]
                signal_role(pid, self.sig)
                self.killed_pid = pid
                return
            time.sleep(0.05)


class KillInTurn(threading.Thread):
    """Signal each role of `kills` ((role, step, signal) triples) at its step as KillAtStep
    does, one after another: the next only once the launcher has restarted the one before (a
    new pid in pids.json). `killed` lists each (role, signal, pid) done."""

    def __init__(
        self,
        run_dir: Path,
        kills: list[tuple[str, int, signal.Signals]],
        timeout: float = 600.0,
    ) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.kills, self.timeout = run_dir, kills, timeout
        self.killed: list[tuple[str, signal.Signals, int]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        for role, step, sig in self.kills:
            killer = KillAtStep(self.run_dir, role, step, self.timeout, sig)
            killer.stopped = self.stopped
            killer.run()
            if killer.killed_pid is None:
                return
            self.killed.append((role, sig, killer.killed_pid))
            deadline = time.monotonic() + self.timeout
            while not self.stopped.is_set() and time.monotonic() < deadline:
                if RunDir(self.run_dir).read_pids()[role] != killer.killed_pid:
                    break
                time.sleep(0.05)
