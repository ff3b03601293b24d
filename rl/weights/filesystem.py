"""Weights through the run directory: `weights/step_N/` in HF layout, COMPLETE written last.

The trainer writes each version (and prunes old ones); the orchestrator waits for it and asks
every inference server to load it. With the broadcast transport the trainer sends weights
itself and records the version all servers confirmed in `weights/BROADCAST`; the orchestrator
then only waits for that record (`BroadcastRecordWaiter`, kept here because it reads a file and
needs none of the broadcast's torch machinery).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rl.core.model import publish_blocks, publish_weights
from rl.core.rundir import BROADCAST, RunDir, is_complete
from rl.weights import lora
from rl.weights.base import BlockSource, RefusedVersion, VersionWaiter, WeightPublisher

POLL_S = 0.01  # how often inference looks for a new version while it waits for one


class FilesystemPublisher(WeightPublisher):
    """Writes `weights/step_N/` and keeps the newest `keep` versions (and version 0): at least
    every version the orchestrator may still load (rl/core/derive.py's `kept_versions`). With
    `fp8_base`, the base checkpoint in the FP8 block format, each version is written in it."""

    def __init__(self, run_dir: Path, keep: int, fp8_base: Path | None = None) -> None:
        self.run_dir, self.keep, self.fp8_base = RunDir(run_dir), keep, fp8_base

    def wanted(self, version: int) -> bool:
        return not is_complete(self.run_dir.weights_for(version))

    def publish(
        self, version: int, model: Any, tokenizer: Any, state: dict[str, Any] | BlockSource | None
    ) -> None:
        if not self.wanted(version):
            return
        self.run_dir.weights.mkdir(parents=True, exist_ok=True)
        target = self.run_dir.weights_for(version)
        if lora.is_wrapped(model):
            lora.publish(version, model, tokenizer, state, self.run_dir)
        elif isinstance(state, BlockSource):
            publish_blocks(model, tokenizer, target, state, fp8_base=self.fp8_base)
        else:
            publish_weights(model, tokenizer, target, state_dict=state, fp8_base=self.fp8_base)
        self.run_dir.prune_versions(self.keep)


class FilesystemWaiter(VersionWaiter):
    """Waits for `weights/step_N` and loads it into every server: exactly the version asked
    for (the fixed schedule), or the newest one published."""

    def __init__(
        self, run_dir: Path, inference: Any, log: logging.Logger, timeout_s: float, exact: bool
    ) -> None:
        self.run_dir, self.inference, self.log = RunDir(run_dir), inference, log
        self.timeout_s, self.exact = timeout_s, exact
        self.refused: set[int] = set()

    def wait(self, minimum: int, held: int) -> int:
        """The version loaded for a batch that needs `minimum`. A version inference refused
        (`RefusedVersion`) is logged and skipped: generation goes on with the version held
        (older by as many steps as were refused; the queue's staleness bound still applies)
        until a later one loads."""
        started = time.monotonic()
        newest = wait_for_version(
            self.run_dir.newest_version, minimum, self.timeout_s, self.run_dir.weights, POLL_S
        )
        wanted = minimum if self.exact else newest
        if wanted == held or (wanted in self.refused and held >= 0):
            return held
        if not is_complete(self.run_dir.weights_for(wanted)):
            raise RuntimeError(
                f"orchestrator: version {wanted} is gone from {self.run_dir.weights} (the "
                f"newest is {newest}): trainer.keep_weights kept too few for the schedule"
            )
        t0 = time.monotonic()
        try:
            self.inference.load_weights(self.run_dir.weights_for(wanted), wanted)
        except RefusedVersion as err:
            if held < 0:  # nothing served yet: nothing to go on with
                raise
            self.refused.add(wanted)
            self.log.warning(
                "version %d refused by inference, skipped: generating with version %d until a "
                "later one loads (%s)", wanted, held, err,
            )  # fmt: skip
            return held
        seconds = time.monotonic() - t0
        self.load_s += seconds
        self.log.info(
            "loaded version %d into inference (waited %.2f s, load %.2f s)",
            wanted,
            t0 - started,
            seconds,
        )
        return wanted


class BroadcastRecordWaiter(VersionWaiter):
    """Waits until `weights/BROADCAST` records a new enough version (the trainer has sent it
    and every server confirmed it)."""

    def __init__(self, run_dir: Path, timeout_s: float) -> None:
        self.run_dir, self.timeout_s = RunDir(run_dir), timeout_s

    def wait(self, minimum: int, held: int) -> int:
        record = self.run_dir.weights / BROADCAST
        newest = wait_for_version(
            self.run_dir.broadcast_version, minimum, self.timeout_s, record, 0.02
        )
        return max(held, newest)


def wait_for_version(
    newest: Callable[[], int], minimum: int, timeout_s: float, where: Path, poll_s: float
) -> int:
    """Poll `newest()` until it reaches `minimum`; TimeoutError naming what was awaited, and
    where, after `timeout_s` (`timeouts.weights_s`)."""
    deadline = time.monotonic() + timeout_s
    while (version := newest()) < minimum:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"orchestrator waited {timeout_s:g} s (timeouts.weights_s) for policy version "
                f"{minimum} in {where}; the newest there is {version}: is the trainer alive?"
            )
        time.sleep(poll_s)
    return version
