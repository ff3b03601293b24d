"""Settings that cannot work whatever the rest of the config says: refused before anything starts.

Hydra checks each value's type against the schema (rl/config.py); this module checks its range
(a negative count, a learning rate that is not a positive number, a port past 65535, a seed
torch cannot take). Each check is one line in a table, and the first failure is raised as a
PlanError naming the key, the value and what would be valid. Checks that relate several
groups (degrees that must divide GPUs, lengths that must fit the model) stay in
launcher/plan.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from launcher.errors import PlanError
from rl.config import Backend, ClusterKind
from rl.derive import inference_backend

MAX_SEED = 2**63 - 1  # torch.manual_seed takes a signed 64-bit integer
MAX_PORT = 65535


def _lookup(cfg: Any, key: str) -> Any:
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _positive_number(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


# (key, accepts the value, what is valid); None values are left to the schema's meaning.
RANGES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("seed", lambda v: 0 <= v <= MAX_SEED, f"must be between 0 and {MAX_SEED}"),
    ("environment.seed", lambda v: 0 <= v <= MAX_SEED, f"must be between 0 and {MAX_SEED}"),
    ("max_restarts", lambda v: v >= 0, "must be >= 0 (0 stops the run at the first death)"),
    ("model.lr", _positive_number, "must be a positive number"),
    ("model.lora.rank", lambda v: v >= 0, "must be >= 0 (0 trains every weight, no LoRA)"),
    ("model.lora.dropout", lambda v: 0 <= v < 1, "must be >= 0 and < 1"),
    ("inference.max_loras", lambda v: v >= 1, "must be >= 1"),
    ("algorithm.lr", _positive_number, "must be a positive number (default: model.lr)"),
    ("algorithm.max_off_policy_steps", lambda v: v >= 0, "must be >= 0"),
    ("algorithm.max_grad_norm", _positive_number, "must be a positive number"),
    ("algorithm.temperature", lambda v: math.isfinite(v) and v >= 0, "must be >= 0"),
    ("environment.prompts_per_step", lambda v: v >= 1, "must be >= 1"),
    ("environment.max_tokens", lambda v: v >= 1, "must be >= 1"),
    ("environment.eval_size", lambda v: v >= 1, "must be >= 1"),
    ("environment.eval_every", lambda v: v >= 0, "must be >= 0 (0: only first and last)"),
    ("warmup.steps", lambda v: v >= 0, "must be >= 0 (0 skips the warm-up)"),
    ("warmup.lr", _positive_number, "must be a positive number"),
    ("warmup.batch_size", lambda v: v >= 1, "must be >= 1"),
    ("trainer.micro_batch_tokens", lambda v: v >= 1, "must be >= 1"),
    ("trainer.checkpoint_every", lambda v: v >= 0, "must be >= 0 (0: only at the end)"),
    ("trainer.keep_weights", lambda v: v >= 1, "must be >= 1"),
    ("inference.max_batch_size", lambda v: v >= 1, "must be >= 1"),
    ("inference.port", lambda v: 0 <= v <= MAX_PORT, f"must be 0 (any free) to {MAX_PORT}"),
    ("queue.port", lambda v: 0 <= v <= MAX_PORT, f"must be 0 (any free) to {MAX_PORT}"),
    ("queue.max_request_mb", lambda v: v >= 1, "must be >= 1"),
    ("cluster.master_port", lambda v: 1 <= v <= MAX_PORT, f"must be 1 to {MAX_PORT}"),
    # Slurm reads 0 as "no limit" and starts a negative one anyway.
    ("cluster.time_min", lambda v: v >= 1, "must be >= 1 (minutes of wall time per job)"),
    ("cluster.signal_delay_s", lambda v: v >= 0, "must be >= 0"),
    *(
        (f"timeouts.{name}", _positive_number, "must be a positive number of seconds")
        for name in ("request_s", "peer_s", "batch_s", "weights_s", "collective_s", "ready_s")
    ),
    # A heartbeat comes every hung_s / 10 (at most 1 s): shorter than 1 s cannot be told apart
    # from a busy machine.
    ("timeouts.hung_s", lambda v: math.isfinite(v) and v >= 1, "must be >= 1 (seconds)"),
]


def check_ranges(cfg: Any) -> None:
    """Raise PlanError for the first setting outside its valid range."""
    for key, valid, what in RANGES:
        value = _lookup(cfg, key)
        if value is not None and not valid(value):
            raise PlanError(f"{key}={value}: {what}")
    cluster = cfg.cluster
    if cluster.kind == ClusterKind.slurm and cluster.signal_delay_s >= cluster.time_min * 60:
        raise PlanError(
            f"cluster.signal_delay_s={cluster.signal_delay_s}: the checkpoint warning must come "
            f"before the time limit, below cluster.time_min={cluster.time_min} x 60 s"
        )
    env, queue = cfg.environment, cfg.queue
    if queue.capacity < env.prompts_per_step:
        raise PlanError(
            f"queue.capacity={queue.capacity}: must hold at least one step's "
            f"environment.prompts_per_step={env.prompts_per_step} groups"
        )
    embedded = inference_backend(cfg) == Backend.embedded
    if embedded and env.group_size > cfg.inference.max_batch_size:
        raise PlanError(
            f"environment.group_size={env.group_size}: one prompt's group must fit in "
            f"inference.max_batch_size={cfg.inference.max_batch_size} sequences"
        )
