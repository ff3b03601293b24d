"""The weight transport's two ends for a run, chosen by `inference.weight_transport`
(rl/core/derive.py's `weight_transport`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rl.core.config import RunConfig, WeightTransport
from rl.core.derive import weight_transport
from rl.core.schedule import exact_schedule, kept_versions
from rl.weights.base import VersionWaiter, WeightPublisher
from rl.weights.filesystem import BroadcastRecordWaiter, FilesystemPublisher, FilesystemWaiter


def make_publisher(
    cfg: RunConfig, run_dir: Path, log: logging.Logger, checkpoint_layout: bool
) -> WeightPublisher:
    """The trainer's publisher for `inference.weight_transport`; versions of a model whose
    base checkpoint is in the FP8 block format are written in it. `checkpoint_layout`: the
    servers' engine takes broadcast weights in the checkpoint's layout
    (rl/inference/engines.py)."""
    from rl.core import fp8  # torch, only where it is used
    from rl.core.model import ensure_checkpoint

    base = ensure_checkpoint(cfg.model)
    fp8_base = base if fp8.block_size(base) is not None else None
    disk = FilesystemPublisher(run_dir, kept_versions(cfg), fp8_base)
    if weight_transport(cfg) != WeightTransport.broadcast:
        return disk
    from rl.weights.broadcast import BroadcastPublisher  # torch, only where it is used

    return BroadcastPublisher(run_dir, cfg, disk, log, checkpoint_layout)


def make_waiter(
    cfg: RunConfig, run_dir: Path, inference: Any, log: logging.Logger
) -> VersionWaiter:
    """The orchestrator's waiter for `inference.weight_transport`; `inference` loads weights
    into every server (`load_weights(path, version)`)."""
    if weight_transport(cfg) == WeightTransport.broadcast:
        return BroadcastRecordWaiter(run_dir, cfg.timeouts.weights_s)
    return FilesystemWaiter(run_dir, inference, log, cfg.timeouts.weights_s, exact_schedule(cfg))
