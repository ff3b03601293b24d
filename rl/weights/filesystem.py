"""Weights through the run directory: `weights/step_N/` in HF layout, COMPLETE written last.

The trainer writes each version (and prunes old ones); the orchestrator waits for it and asks
every inference server to load it. With the broadcast transport the trainer sends weights
itself and records the version all servers confirmed in `weights/BROADCAST`; the orchestrator
then only waits for that record (`BroadcastRecordWaiter`, kept here because it reads a file and
needs none of the broadcast's torch machinery).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rl.core.model import publish_blocks, publish_weights
from rl.core.rundir import BROADCAST, RunDir
from rl.weights import lora
from rl.weights.base import BlockSource, RefusedVersion, VersionWaiter, WeightPublisher

log = logging.getLogger(__name__)
POLL_S = 0.01  # how often inference looks for a new version while it waits for one


class FilesystemPublisher(WeightPublisher):
    """Writes `weights/step_N/` and keeps the newest `keep` versions (and version 0): at least
    every version the orchestrator may still load (rl/core/schedule.py's `kept_versions`). With
    `fp8_base`, the base checkpoint in the FP8 block format, each version is written in it."""

    def __init__(self, run_dir: Path, keep: int, fp8_base: Path | None = None) -> None:
        self.run_dir, self.keep, self.fp8_base = RunDir(run_dir), keep, fp8_base
        self.strays: set[Path] = set()  # warned of once each
        self.run_dir.start_record()

    def wanted(self, version: int) -> bool:
        return version not in self.run_dir.published_versions()

    def publish(
        self, version: int, model: Any, tokenizer: Any, state: dict[str, Any] | BlockSource | None
    ) -> None:
        if not self.wanted(version):
            return
        self.run_dir.weights.mkdir(parents=True, exist_ok=True)
        target = self.run_dir.weights_for(version)
        # Not recorded: a trainer stopped between writing and recording it, or not this run's.
        shutil.rmtree(target, ignore_errors=True)
        if lora.is_wrapped(model):
            lora.publish(version, model, tokenizer, state, self.run_dir)
        elif isinstance(state, BlockSource):
            publish_blocks(model, tokenizer, target, state, fp8_base=self.fp8_base)
        else:
            publish_weights(model, tokenizer, target, state_dict=state, fp8_base=self.fp8_base)
        self.run_dir.record_published(version)
        for stray in set(self.run_dir.prune_versions(self.keep)) - self.strays:
            self.strays.add(stray)
            log.warning(
                "%s was not published by this run's trainer: ignored (never loaded, never "
                "pruned); remove it", stray,
            )  # fmt: skip


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
        until a later one loads; with none held (a restarted orchestrator), the newest older
        version that loads."""
        started = time.monotonic()
        newest = wait_for_version(
            self.run_dir.newest_version, minimum, self.timeout_s, self.run_dir.weights, POLL_S
        )
        wanted = minimum if self.exact else newest
        if wanted == held or (wanted in self.refused and held >= 0):
            return held
        if wanted not in self.run_dir.published_versions():
            raise RuntimeError(
                f"orchestrator: version {wanted} is gone from {self.run_dir.weights} (the "
                f"newest is {newest}): trainer.keep_weights kept too few for the schedule"
            )
        try:
            return self._load(wanted, started)
        except RefusedVersion as err:
            self.refused.add(wanted)
            if held >= 0:
                going_on = f"generating with version {held} until a later one loads"
            else:  # nothing held (a restarted orchestrator): the newest older one that loads
                held = self._older(wanted, started)
                going_on = f"loaded version {held} instead, until a later one loads"
            self.log.warning(
                "version %d refused by inference, skipped: %s (%s)", wanted, going_on, err
            )
            return held

    def _load(self, version: int, started: float) -> int:
        t0 = time.monotonic()
        self.inference.load_weights(self.run_dir.weights_for(version), version)
        seconds = time.monotonic() - t0
        self.load_s += seconds
        self.log.info(
            "loaded version %d into inference (waited %.2f s, load %.2f s)",
            version,
            t0 - started,
            seconds,
        )
        return version

    def _older(self, version: int, started: float) -> int:
        """The newest published version below `version` that inference loads."""
        for older in reversed(self.run_dir.published_versions()):
            if older < version and older not in self.refused:
                try:
                    return self._load(older, started)
                except RefusedVersion:
                    self.refused.add(older)
        raise RuntimeError(
            f"orchestrator: inference refused every published version up to {version} "
            f"({sorted(self.refused)[-5:]}): nothing to generate with"
        )


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
