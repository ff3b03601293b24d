"""Values derived from a run config, each decided in one place.

The planner (launcher/plan.py) and the roles both need these: the inference backend, the
longest sequence served, the learning rate, the weight-broadcast backend and the trainer's mesh
degrees. Each is one small function of the config here, so the plan a dry run prints and what a
role does cannot disagree. Torch-free: the launcher imports it on the CLI path.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rl.core.config import Backend, BroadcastBackend, RunConfig


def inference_backend(cfg: RunConfig) -> Backend:
    """`inference.backend`, or vLLM where the cluster has GPUs and the embedded engine on CPU."""
    if cfg.inference.backend is not None:
        return Backend(cfg.inference.backend)
    return Backend.vllm if cfg.cluster.gpus_per_node else Backend.embedded


def max_model_len(cfg: RunConfig) -> int:
    """The longest prompt + completion served: `model.inference.max_model_len`, or the model's
    context length."""
    return int(cfg.model.inference.max_model_len or cfg.model.context_length)


def learning_rate(cfg: RunConfig) -> float:
    """`algorithm.lr`, or the model option's `lr` when the algorithm leaves it unset."""
    lr = cfg.algorithm.lr
    return float(lr if lr is not None else cfg.model.lr)


FILE_KV_CONNECTOR = "ExampleConnector"
"""vLLM's connector that hands KV over through files, found by prompt (what its CPU build runs)."""


def kv_connector(cfg: RunConfig) -> str:
    """vLLM's KV connector between a prefill/decode replica's instances: as configured, else
    NIXL on GPUs and the file connector on CPU."""
    gpus = cfg.cluster.gpus_per_node
    return cfg.model.inference.kv_connector or ("NixlConnector" if gpus else FILE_KV_CONNECTOR)


def broadcast_backend(cfg: RunConfig) -> BroadcastBackend:
    """`inference.broadcast_backend`, or NCCL where the cluster has GPUs and gloo without."""
    if cfg.inference.broadcast_backend is not None:
        return BroadcastBackend(cfg.inference.broadcast_backend)
    return BroadcastBackend.nccl if cfg.cluster.gpus_per_node else BroadcastBackend.gloo


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
