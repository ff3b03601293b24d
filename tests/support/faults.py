"""Fault injection for tests: kill -9 (or stop) a chosen role of a running run at a chosen
step."""

from __future__ import annotations

import json
import os
import shutil
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


class Tamper(threading.Thread):
    """What a holder of the run directory and the push key could do to a live run, each once
    it can: plant a complete `weights/step_777000` (a copy of version 0, checksums and all);
    rewrite in place (the same file: truncated, then refilled) the weights of every
    `every`-th version the trainer publishes, as soon as it is recorded; and once the trainer
    has recorded `push_at` steps, push a group numbered three batches past the queue's next
    and one from a version 10**6 past the newest. `pushes` holds the status of each push,
    `rewritten` the versions rewritten."""

    def __init__(self, run_dir: Path, every: int, push_at: int, timeout: float = 600.0) -> None:
        super().__init__(daemon=True)
        self.layout = RunDir(run_dir)
        self.every, self.push_at, self.timeout = every, push_at, timeout
        self.rewritten: list[int] = []
        self.pushes: dict[str, tuple[int, str]] = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout
        seen: set[int] = set()
        next_look = 0.0  # when to look at the trained steps next
        while not self.stopped.is_set() and time.monotonic() < deadline:
            published = self.layout.published_versions()
            if 0 in published and not self.layout.weights_for(777000).exists():
                shutil.copytree(self.layout.weights_for(0), self.layout.weights_for(777000))
            for version in sorted(set(published) - seen):
                seen.add(version)
                if version and version % self.every == 0:
                    self._rewrite(version)
            if not self.pushes and time.monotonic() > next_look:
                next_look = time.monotonic() + 0.5
                steps = trained_steps(self.layout.root)
                if steps and max(steps) >= self.push_at:
                    self._push(max(published))
            time.sleep(0.002)

    def _rewrite(self, version: int) -> None:
        path = self.layout.weights_for(version) / "model.safetensors"
        try:
            with open(path, "r+b") as f:
                size = f.seek(0, os.SEEK_END)
                f.truncate(0)
                f.write(b"\0" * size)
        except FileNotFoundError:  # pruned already
            return
        self.rewritten.append(version)

    def _push(self, newest: int) -> None:
        import httpx

        from rl.core import wire
        from rl.core.runtime import run_auth

        url = self.layout.read_address("queue")
        with httpx.Client(base_url=url, auth=run_auth(self.layout.root), timeout=30) as http:
            next_batch = http.get("/stats").json()["next_batch"]
            for name, version, batch in [
                ("batch ahead", 0, next_batch + 3),
                ("version ahead", newest + 10**6, None),
            ]:
                sample = {"prompt_ids": [1, 2], "completion_ids": [3, 4], "logprobs": [-1.0] * 2,
                          "reward": 0.5, "advantage": 0.1, "min_version": version,
                          "max_version": version}  # fmt: skip
                body = wire.encode([{"samples": [sample] * 2, "min_version": version,
                                     "max_version": version}])  # fmt: skip
                params = {} if batch is None else {"batch": batch}
                response = http.post("/push", params=params, content=body,
                                     headers={"Content-Type": wire.CONTENT_TYPE})  # fmt: skip
                self.pushes[name] = (response.status_code, response.text)
