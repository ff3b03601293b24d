"""A trainer told to stop: its checkpoint without the optimiser state
(`trainer.stop_checkpoint_optimizer=false`) is a third of the bytes and resumes with AdamW's
moments at zero; a SIGTERM while it waits for a batch stops it at once."""

from __future__ import annotations

import logging
import os
import re
import select
import signal
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import torch

from rl.core.rundir import RunDir
from rl.core.runtime import Peer
from rl.trainer.checkpoint import has_optimizer, load_checkpoint, save_checkpoint
from rl.trainer.loop import Trainer


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_checkpoint_without_optimizer_state_is_smaller_and_resumes(tmp_path: Path) -> None:
    model, optimizer = trained()
    save_checkpoint(model, optimizer, 7, tmp_path / "full")
    save_checkpoint(model, optimizer, 7, tmp_path / "light", with_optimizer=False)
    size = {name: sum(f.stat().st_size for f in (tmp_path / name).iterdir()) for name in
            ("full", "light")}  # fmt: skip
    assert has_optimizer(tmp_path / "full") and not has_optimizer(tmp_path / "light")
    assert size["light"] < size["full"] / 2
    fresh = torch.nn.Linear(64, 64)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert load_checkpoint(fresh, fresh_optimizer, tmp_path / "light") == 7
    assert torch.equal(fresh.weight, model.weight)
    for state in fresh_optimizer.state.values():  # the moments start again from zero
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()


class HoldingQueue(threading.Thread):
    """A queue whose batch never comes: it holds each GET /batch for the long poll the
    client asks (`wait`), then answers 204, and records whether the client hung up first."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.asked = threading.Event()
        self.holds: list[str] = []

    def run(self) -> None:
        with self.server:
            conn, _ = self.server.accept()
            with conn:
                request = conn.recv(65536).decode()
                wait = float(re.search(r"[?&]wait=([0-9.]+)", request).group(1))
                self.asked.set()
                ready, _, _ = select.select([conn], [], [], wait)
                if ready and not conn.recv(1):
                    self.holds.append("dropped by the client")
                    return
                self.holds.append("held to the end")
                conn.sendall(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")


def test_sigterm_while_the_trainer_waits_for_a_batch_ends_the_wait_at_once(tmp_path: Path) -> None:
    """Slurm's SIGTERM reaches every role at once: the orchestrator stops, so the batch the
    trainer waits for never comes, and a long poll of wire.LONG_POLL_S (10 s) outlasted a
    KillWait of 10 s: the trainer was killed before it wrote its checkpoint."""
    queue = HoldingQueue()
    queue.start()
    RunDir(tmp_path).write_address("queue", *queue.server.getsockname())
    trainer = Trainer.__new__(Trainer)  # fetch needs the run, its settings and a log
    trainer.run_dir, trainer.rank, trainer.terminated, trainer.waiting = (
        RunDir(tmp_path),
        0,
        False,
        False,
    )
    trainer.cfg = SimpleNamespace(
        timeouts=SimpleNamespace(batch_s=600.0), trainer=SimpleNamespace(micro_batch_tokens=64)
    )
    trainer.layout = SimpleNamespace(dp_rank=0, dp_world=1)
    trainer.log = logging.getLogger("trainer-test")
    previous = signal.signal(signal.SIGTERM, trainer._terminated)
    sender = threading.Thread(
        target=lambda: queue.asked.wait(60) and os.kill(os.getpid(), signal.SIGTERM)
    )
    try:
        sender.start()
        with httpx.Client(timeout=60) as http:
            shard = trainer.fetch(http, Peer(tmp_path, "queue", 10), step=3)
    finally:
        sender.join()
        signal.signal(signal.SIGTERM, previous)
    queue.join(60)
    assert shard is None and trainer.terminated
    assert queue.holds == ["dropped by the client"]
