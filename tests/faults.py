"""Fault injection for tests: kill -9 a chosen role of a running run at a chosen step."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path


def trained_steps(run_dir: Path) -> list[int]:
    """The steps the trainer has recorded, in file order."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return []
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r["step"] for r in records if "reward/mean" in r]


class KillAtStep(threading.Thread):
    """Once the trainer has recorded `step`, SIGKILL the process group of `role` (a process
    name from the run's pids.json: queue, orchestrator, inference-0, trainer). Gives up after
    `timeout` seconds; `killed_pid` says whether and what it killed."""

    def __init__(self, run_dir: Path, role: str, step: int, timeout: float = 600.0) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.role, self.step, self.timeout = run_dir, role, step, timeout
        self.killed_pid: int | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout
        while not self.stopped.is_set() and time.monotonic() < deadline:
            steps = trained_steps(self.run_dir)
            if steps and max(steps) >= self.step:
                pid = json.loads((self.run_dir / "pids.json").read_text())[self.role]
                os.killpg(pid, signal.SIGKILL)
                self.killed_pid = pid
                return
            time.sleep(0.05)


class KillInTurn(threading.Thread):
    """Kill -9 each role of `kills` ((role, step) pairs) at its step as KillAtStep does, one
    after another: the next only once the launcher has restarted the one before (a new pid in
    pids.json). `killed` maps each role killed to the pid it had."""

    def __init__(self, run_dir: Path, kills: list[tuple[str, int]], timeout: float = 600.0):
        super().__init__(daemon=True)
        self.run_dir, self.kills, self.timeout = run_dir, kills, timeout
        self.killed: dict[str, int] = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        for role, step in self.kills:
            killer = KillAtStep(self.run_dir, role, step, self.timeout)
            killer.stopped = self.stopped
            killer.run()
            if killer.killed_pid is None:
                return
            self.killed[role] = killer.killed_pid
            deadline = time.monotonic() + self.timeout
            while not self.stopped.is_set() and time.monotonic() < deadline:
                if json.loads((self.run_dir / "pids.json").read_text())[role] != killer.killed_pid:
                    break
                time.sleep(0.05)
