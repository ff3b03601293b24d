"""How much of the cluster a run takes, and whether it fits: trainer nodes and mesh, nodes per
inference replica and for the inference job, and one local GPU's memory split between inference
and trainer. Each function refuses (PlanError, naming the key and the numbers) what cannot fit.

Pure arithmetic over the config (the GPUs found here are filled in first, by `fill_gpus`), so
the planner and its tests see the same numbers; no torch, no I/O but `nvidia-smi`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from omegaconf import DictConfig, open_dict

from launcher.clusters.base import cluster_of
from launcher.errors import PlanError, refuse
from launcher.plan.costs.memory import (
    CUDA_CONTEXT_GB,
    DTYPE_BYTES,
    GIB,
    InferenceMemory,
    TrainerMemory,
    TrainerOptions,
    inference_memory,
    trainer_memory,
)
from launcher.plan.costs.step_time import generation, sync_seconds, train_seconds, workload
from launcher.plan.gpus import SPECS, kind_of
from launcher.plan.gpus import describe as describe_gpus
from launcher.plan.gpus import detect as detect_gpus
from rl.core.config import Gpu, Placement
from rl.core.derive import (
    CHECKPOINT_COPIES,
    LayoutError,
    data_parallel,
    max_model_len,
    precision,
    trainer_dims,
)
from rl.core.schedule import kept_versions
from rl.inference.engines import engine_of

ONE_PROCESS = {"world": 1, "dp_replicate": 1, "cp": 1, "ep": 1}  # a trainer mesh of one rank

MIN_TOKENS_PER_CP_RANK = 64
"""Fewest tokens of a sequence per context-parallel rank for which splitting it pays off."""


HOST_FRACTION = 0.8
"""Share of a node's host memory offloaded trainer state may take (the rest: the processes,
pinned buffers, page cache)."""


def fill_gpus(cfg: DictConfig) -> str | None:
    """Fill in `cluster.gpus_per_node`, `gpu` and the GPU's figures where they are None: on
    cluster=local from the GPUs `nvidia-smi` finds here (launcher/plan/gpus.py), elsewhere from
    `cluster.gpu`'s (none: no GPUs). Returns what was found here, for the plan's notes (None
    when nothing was looked for)."""
    cluster = cfg.cluster
    local = not cluster_of(cfg).spans_nodes
    unknown = cluster.gpus_per_node is None or cluster.gpu_memory_gb is None
    look = local and (unknown or (cluster.gpu is None and bool(cluster.gpus_per_node)))
    found = detect_gpus() if look else []
    if cluster.gpus_per_node is None:
        decide(cluster, "gpus_per_node", len(found))
    if cluster.gpu is None and found and (kind := kind_of(found[0].name)) is not None:
        decide(cluster, "gpu", kind)
    spec = SPECS.get(Gpu(cluster.gpu)) if cluster.gpu is not None else None
    if cluster.gpu_memory_gb is None:
        memory = min((g.memory_gb for g in found), default=0.0)
        decide(cluster, "gpu_memory_gb", memory or (spec.memory_gb if spec else 0.0))
    if cluster.gpus_per_node:
        figures = spec or SPECS[FALLBACK_GPU]
        for key, value in (
            ("gpu_tflops", figures.tflops),
            ("gpu_bandwidth_gbs", figures.bandwidth_gbs),
            ("link_gbs", figures.link_gbs),
        ):
            if getattr(cluster, key) is None:
                decide(cluster, key, value)
    return describe_gpus(found) if look else None


FALLBACK_GPU = Gpu.h100
"""Whose figures time a run on GPUs the planner does not know (cluster.gpu unset)."""


def decide(node: Any, key: str, value: Any) -> None:
    """Set a value the plan decides on the config (a DictConfig, or a resumed run's typed
    config object), so that the run directory records it."""
    if isinstance(node, DictConfig):
        with open_dict(node):
            node[key] = value
    else:
        setattr(node, key, value)


def trainer_nodes(cfg: DictConfig) -> int:
    """Nodes for the trainer: as configured, or (nodes=0) the fewest whose GPUs hold a rank's
    memory, with what `trainer_options` turns on where that takes it."""
    cluster, par = cfg.cluster, cfg.parallel.trainer
    if not (cluster.gpus_per_node and cluster.gpu_memory_gb) or par.nodes:
        return max(par.nodes, 1)
    for nodes in range(1, cluster.nodes + 1):
        if fit_trainer(cfg, nodes) is not None:
            return nodes
    refuse_trainer_memory(cfg, cluster.nodes, "cluster.nodes")
    raise AssertionError("refused above")


HEAD_CHUNK = 2048
"""Tokens per chunk of the LM head where the plan turns chunking on (prime-rl's fused head
uses the same)."""

CP_DEGREES = (2, 4, 8)
"""Context-parallel degrees the plan may choose: within one node's NVLink domain."""


def trainer_options(cfg: DictConfig) -> list[tuple[TrainerOptions, int]]:
    """(options, context-parallel degree) in the order the plan tries them: as configured,
    then activation checkpointing, the LM head in chunks, context parallelism (each larger
    degree the model and the served length allow), activation offload, FSDP's CPU offload of
    the optimiser state (without, then with activation offload)."""
    trainer = cfg.trainer
    configured = TrainerOptions(
        bool(trainer.activation_checkpointing),
        int(trainer.lm_head_chunk),
        bool(trainer.activation_offload),
        bool(trainer.cpu_offload),
    )
    checkpointed = replace(configured, checkpointing=True)
    chunked = replace(checkpointed, head_chunk=configured.head_chunk or HEAD_CHUNK)
    offloaded = replace(chunked, activation_offload=True)
    state_on_host = replace(chunked, offload=True)
    both = replace(offloaded, offload=True)
    degrees = context_degrees(cfg)
    order = [(configured, degrees[0]), (checkpointed, degrees[0]), (chunked, degrees[0])]
    order += [(chunked, cp) for cp in degrees[1:]]
    order += [(offloaded, cp) for cp in degrees]
    order += [(state_on_host, cp) for cp in degrees] + [(both, cp) for cp in degrees]
    return list(dict.fromkeys(order))


def context_degrees(cfg: DictConfig) -> list[int]:
    """`parallel.trainer.cp`, then the larger degrees the plan may choose: none for a model
    whose attention context parallelism does not split (DeepSeek sparse attention's indexer),
    and none that leaves a rank fewer than MIN_TOKENS_PER_CP_RANK of the longest sample."""
    configured = int(cfg.parallel.trainer.cp)
    if cfg.model.index_n_heads:
        return [configured]
    longest = max_model_len(cfg)
    gpus = cfg.cluster.gpus_per_node or 1
    larger = [
        cp
        for cp in CP_DEGREES
        if configured < cp <= gpus and longest >= cp * MIN_TOKENS_PER_CP_RANK
    ]
    return [configured, *larger]


def fit_trainer(cfg: DictConfig, nodes: int) -> TrainerMemory | None:
    """The first of `trainer_options` under which one rank of a trainer on `nodes` nodes fits
    its GPU (and what it offloads its node's host memory), or None."""
    for options, cp in trainer_options(cfg):
        try:
            mesh = trainer_mesh(cfg, nodes, cp)
        except PlanError:
            continue
        mem = trainer_memory(cfg, mesh, options)
        if mem.fits and host_fits(cfg, mem):
            return mem
    return None


def host_fits(cfg: DictConfig, mem: TrainerMemory) -> bool:
    ranks = min(mem.mesh["world"], cfg.cluster.gpus_per_node)
    return mem.host_per_gpu * ranks <= cfg.cluster.mem_gb_per_node * HOST_FRACTION


def refuse_trainer_memory(cfg: DictConfig, nodes: int, key: str) -> None:
    """Refuse a trainer that does not fit with everything turned on, naming every term, and
    the longest sample that would fit."""
    options, mesh = _last_resort(cfg, nodes)
    mem = trainer_memory(cfg, mesh, options)
    ranks = min(mesh["world"], cfg.cluster.gpus_per_node)
    tried = ", ".join(options.describe() + ([f"cp={mesh['cp']}"] if mesh["cp"] > 1 else []))
    why_not_cp = (
        "; context parallelism does not split this model's sparse-attention indexer"
        if cfg.model.index_n_heads
        else ""
    )
    longest = longest_fitting(cfg, mesh, options)
    shorter = (
        f", a served length of at most {longest:,} tokens "
        f"(environment.max_context_tokens; this run serves {max_model_len(cfg):,})"
        if longest and longest < max_model_len(cfg)
        else ""
    )
    refuse(
        key,
        f"model={cfg.model.name} does not fit {mesh['world']} trainer GPUs of "
        f"{cfg.cluster.gpu_memory_gb:g} GiB even with {tried}{why_not_cp}: per GPU "
        f"{mem.describe()}, and {mem.host_per_gpu * ranks:.0f} GiB of host memory per node "
        f"(of {cfg.cluster.mem_gb_per_node} x {HOST_FRACTION:g}); use more trainer nodes "
        f"(parallel.trainer.nodes=0 sizes them), a smaller trainer.micro_batch_tokens{shorter}",
    )


def _last_resort(cfg: DictConfig, nodes: int) -> tuple[TrainerOptions, dict[str, int]]:
    """The last of `trainer_options` whose mesh forms on `nodes` nodes (else the configured
    mesh): what a refusal shows."""
    for options, cp in reversed(trainer_options(cfg)):
        try:
            return options, trainer_mesh(cfg, nodes, cp)
        except PlanError:
            continue
    return trainer_options(cfg)[-1][0], trainer_mesh(cfg, nodes)


def longest_fitting(cfg: DictConfig, mesh: dict[str, int], options: TrainerOptions) -> int:
    """The longest served length (tokens) under which one trainer rank fits, 0 for none."""
    fits = lambda served: trainer_memory(cfg, mesh, options, served).fits  # noqa: E731
    low, high = 0, max_model_len(cfg)
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def replica_nodes(cfg: DictConfig) -> int:
    """Nodes per inference replica: as configured, or (0) the fewest whose GPUs hold the
    weights and a KV cache of at least one sequence of the served length."""
    cluster, inf = cfg.cluster, cfg.parallel.inference
    if not (cluster.gpus_per_node and cluster.gpu_memory_gb):
        return max(inf.nodes_per_replica, 1)
    if inf.nodes_per_replica:
        mem = replica_memory(cfg, inf.nodes_per_replica)
        if not mem.fits:
            refuse(
                f"parallel.inference.nodes_per_replica={inf.nodes_per_replica}",
                f"model={cfg.model.name} on {replica_gpus_of(cfg, inf.nodes_per_replica)} "
                f"GPUs per replica leaves no KV cache for one sequence of "
                f"{mem.served_len:,} tokens: per GPU {mem.describe()}; set nodes_per_replica=0 "
                f"to size it, raise tp/dp, or shorten the served length",
            )
        return inf.nodes_per_replica
    experts = cfg.model.num_experts if inf.expert_parallel else 0
    for nodes in range(1, cluster.nodes + 1):
        if experts and experts % replica_gpus_of(cfg, nodes):
            continue  # vLLM spreads the experts evenly over the replica's GPUs
        if replica_memory(cfg, nodes).fits:
            return nodes
    refuse(
        "parallel.inference.nodes_per_replica=0",
        f"model={cfg.model.name} does not fit {cluster.nodes} nodes per replica: per GPU "
        f"{replica_memory(cfg, cluster.nodes).describe()}",
    )
    raise AssertionError("refused above")


def replica_gpus_of(cfg: DictConfig, nodes: int) -> int:
    """GPUs of one replica (or instance) spanning `nodes` nodes: every GPU of each."""
    return cfg.cluster.gpus_per_node * nodes if nodes > 1 else replica_gpus(cfg)


def replica_memory(cfg: DictConfig, nodes: int) -> InferenceMemory:
    """One GPU of a replica on `nodes` nodes. A dense replica spanning nodes is
    pipeline-parallel: its weights split over them."""
    gpus = replica_gpus_of(cfg, nodes)
    stages = nodes if nodes > 1 and not data_parallel(cfg, nodes) else 1
    return inference_memory(cfg, gpus, max_model_len(cfg), stages)


def trainer_mesh(cfg: DictConfig, trainer_nodes: int, cp: int | None = None) -> dict[str, int]:
    """Trainer degrees with dp_shard=-1 resolved (rl/core/derive.py), with context-parallel
    degree `cp` where given (the plan's choice); checks the ranks split evenly over the
    trainer's nodes. On CPU the degrees alone say how many ranks there are."""
    par, gpus = cfg.parallel.trainer, cfg.cluster.gpus_per_node
    if cp is not None and cp != par.cp:
        keys = ("tp", "dp_replicate", "dp_shard", "ep")
        par = SimpleNamespace(cp=cp, **{key: getattr(par, key) for key in keys})
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


def check_trainer_memory(cfg: DictConfig, nodes: int) -> TrainerMemory | None:
    """One rank's memory fits its GPU: what `trainer_options` lists turned on (and recorded in
    the config: the trainer's settings, and the context-parallel degree) where needed;
    refused with the numbers otherwise."""
    if not (cfg.cluster.gpus_per_node and cfg.cluster.gpu_memory_gb):
        return None
    mem = fit_trainer(cfg, nodes)
    if mem is None:
        refuse_trainer_memory(cfg, nodes, f"parallel={cfg.parallel.name}")
        raise AssertionError("refused above")
    options = mem.options
    decide(cfg.trainer, "activation_checkpointing", options.checkpointing)
    decide(cfg.trainer, "lm_head_chunk", options.head_chunk)
    decide(cfg.trainer, "activation_offload", options.activation_offload)
    decide(cfg.trainer, "cpu_offload", options.offload)
    decide(cfg.parallel.trainer, "cp", mem.mesh["cp"])
    return mem


def replica_gpus(cfg: DictConfig) -> int:
    inf, gpus = cfg.parallel.inference, cfg.cluster.gpus_per_node
    if gpus == 0:
        return 0
    return gpus if inf.dp == -1 else inf.tp * inf.dp


def per_node(cfg: DictConfig, replica_nodes: int) -> int:
    """Inference instances packed onto one Slurm node: as many as its GPUs hold when each
    needs part of a node (one GPU per instance x 8 GPUs: eight), else one."""
    gpus = cfg.cluster.gpus_per_node
    if not cluster_of(cfg).spans_nodes or not gpus or replica_nodes > 1:
        return 1
    return max(1, gpus // replica_gpus(cfg))


def inference_nodes(cfg: DictConfig, replica_nodes: int, replicas: int | None = None) -> int:
    """Nodes of the inference job: its instances (replicas x prefill/decode), packed."""
    instances = (replicas or cfg.parallel.inference.replicas) * pd_factor(cfg)
    return -(-instances // per_node(cfg, replica_nodes)) * replica_nodes


def pd_factor(cfg: DictConfig) -> int:
    """Disaggregated serving runs a prefill and a decode instance per replica."""
    return 2 if disaggregated(cfg) else 1


def disaggregated(cfg: DictConfig) -> bool:
    return bool(cfg.model.inference.pd_disaggregation)


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
    if not cluster_of(cfg).spans_nodes:
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
    if engine_of(cfg).spans_nodes:
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
        not cluster_of(cfg).spans_nodes
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
    - trainer: one process's memory as launcher/plan/costs/memory.py counts it (float32
      master weights, gradients and AdamW's moments, and autocast's copy of the weights in the
      compute dtype; activations for the largest micro-batch, with or without activation
      checkpointing; the logits, whole or a chunk) and a CUDA context. One process offloads nothing:
      `trainer.cpu_offload` is FSDP's."""
    model, env, trainer = cfg.model, cfg.environment, cfg.trainer
    serve = model.inference
    kv_bytes = 1 if serve.kv_cache_dtype.startswith("fp8") else serve_bytes_per_param(cfg)
    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * kv_bytes
    sequences = min(env.prompts_per_step * env.group_size, cfg.inference.max_batch_size)
    kv_tokens = max(max_model_len(cfg), sequences * 2 * env.max_tokens)
    checkpointing = bool(trainer.activation_checkpointing)
    options = TrainerOptions(checkpointing, int(trainer.lm_head_chunk))
    terms = trainer_memory(cfg, ONE_PROCESS, options).terms
    state = ("parameters", "gradients", "optimizer", "compute copy")
    return Split(
        gpu=cfg.cluster.gpu_memory_gb,
        weights=model.total_params_b * 1e9 * serve_bytes_per_param(cfg) / GIB,
        kv_cache=kv_tokens * per_token / GIB,
        trainer_state=sum(terms.get(term, 0.0) for term in state),
        activations=terms["activations"] + terms["attention"] + terms["logits"],
        checkpointing=checkpointing,
    )


def format_split(split: Split, cfg: DictConfig) -> str:
    how = (
        "in turns (vLLM sleeps while the trainer runs; counted as if both were resident)"
        if cfg.placement == Placement.colocated
        else "side by side"
    )
    tokens = max(int(cfg.trainer.micro_batch_tokens), max_model_len(cfg))
    chunk = int(cfg.trainer.lm_head_chunk)
    head = f", the LM head in chunks of {chunk:,}" if chunk else ""
    return (
        f"one GPU ({split.gpu:g} GB) shared by inference and trainer, {how}: "
        f"inference {split.inference:.1f} GB (--gpu-memory-utilization {split.utilization}: "
        f"weights {split.weights:.1f} + KV cache {split.kv_cache:.1f} + context "
        f"{CUDA_CONTEXT_GB:g}), trainer {split.trainer:.1f} GB (state {split.trainer_state:.1f} "
        f"+ activations {split.activations:.1f} for micro-batches of up to {tokens:,} tokens"
        f"{' with activation checkpointing' if split.checkpointing else ''}{head} + context "
        f"{CUDA_CONTEXT_GB:g}), {split.gpu - split.utilization * split.gpu - split.trainer:.1f} "
        f"GB spare"
    )


def check_shared_gpu(cfg: DictConfig) -> str | None:
    """Fail before anything starts when inference and trainer cannot share the GPU; turn on
    activation checkpointing, then the LM head in chunks, where that makes them fit, and
    return a note saying so."""
    if not cfg.cluster.gpu_memory_gb:
        refuse(
            "cluster.gpus_per_node=1",
            "inference and trainer share the one GPU, which needs its memory to split: set "
            "cluster.gpu_memory_gb (nvidia-smi reports it where it runs)",
        )
    trainer = cfg.trainer
    split = first = shared_split(cfg)
    configured = {key: trainer[key] for key in ("activation_checkpointing", "lm_head_chunk")}
    turned_on = []
    for key, value in (
        ("activation_checkpointing", True),
        ("lm_head_chunk", trainer.lm_head_chunk or HEAD_CHUNK),
    ):
        if split.fits:
            break
        if trainer[key] != value:
            decide(trainer, key, value)
            turned_on.append(f"trainer.{key}={str(value).lower()}")
            split = shared_split(cfg)
    if split.fits:
        if not turned_on:
            return None
        return (
            f"{' and '.join(turned_on)} turned on: without, the trainer needs "
            f"{first.trainer:.1f} GB of the shared GPU"
        )
    for key, value in configured.items():  # nothing half-changed
        decide(trainer, key, value)
    need = first.utilization * first.gpu + first.trainer
    refuse(
        "cluster.gpus_per_node=1",
        f"model={cfg.model.name} does not fit one {first.gpu:g} GB GPU shared by inference "
        f"({first.inference:.1f} GB: weights {first.weights:.1f}, KV cache {first.kv_cache:.1f}) "
        f"and trainer ({first.trainer:.1f} GB: state {first.trainer_state:.1f}, activations "
        f"{first.activations:.1f}), {need:.1f} GB in all, {split.trainer:.1f} GB for the "
        f"trainer with activation checkpointing and the LM head in chunks; to fit: a smaller "
        f"trainer.micro_batch_tokens, a shorter model.inference.max_model_len, or a GPU each "
        f"(one process offloads nothing: trainer.cpu_offload is FSDP's)",
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
    trainer_memory: TrainerMemory | None = None
    """One trainer GPU's memory, on a cluster with GPUs."""


def size_run(cfg: DictConfig) -> Footprint:
    """Size the run and refuse what does not fit: replicas against their weights and KV
    cache, trainer nodes and mesh against a rank's memory, both against each other's step
    time (launcher/plan/costs/step_time.py), the whole run against the cluster, and one local
    GPU shared by inference and trainer."""
    replica = replica_nodes(cfg)
    trainer = balance_layout(cfg, trainer_nodes(cfg), replica)
    mesh = trainer_mesh(cfg, trainer)
    shared = shared_gpu(cfg)  # its one GPU's split is checked on its own (check_shared_gpu)
    memory = None if shared else check_trainer_memory(cfg, trainer)
    if memory is not None:
        mesh = memory.mesh  # with the context-parallel degree it chose
    check_cluster(cfg, trainer, replica)
    check_inference_layout(cfg, replica)
    notes: list[str] = []
    if shared:
        turned_on = check_shared_gpu(cfg)
        notes += [format_split(shared_split(cfg), cfg), *([turned_on] if turned_on else [])]
    return Footprint(trainer, replica, mesh, shared, notes, memory)


NEAR_FASTEST = 1.1
"""The balance takes the fewest nodes whose step is within this factor of the fastest."""


def balance_layout(cfg: DictConfig, fewest_trainer: int, replica: int) -> int:
    """Trainer nodes (`parallel.trainer.nodes=0`) and inference replicas
    (`parallel.inference.replicas=0`, decided on the config) that the plan chooses: of the
    layouts that fit the cluster, the fewest nodes whose step (the slower side's time, then
    the weight sync) is within `NEAR_FASTEST` of the fastest. Returns the trainer's nodes."""
    par, inf, cluster = cfg.parallel.trainer, cfg.parallel.inference, cfg.cluster
    auto_trainer, auto_replicas = par.nodes == 0, inf.replicas == 0
    if not (cluster.gpus_per_node and cluster.gpu_memory_gb) or not (auto_trainer or auto_replicas):
        if auto_replicas:
            decide(inf, "replicas", 1)
        return fewest_trainer
    work = workload(cfg, max_model_len(cfg))
    mem, gpus = replica_memory(cfg, replica), replica_gpus_of(cfg, replica)
    options = []
    trainers = range(fewest_trainer, cluster.nodes + 1) if auto_trainer else [fewest_trainer]
    for nodes in trainers:
        fit = fit_trainer(cfg, nodes)
        if fit is None:
            continue
        train = train_seconds(cfg, work, nodes * cluster.gpus_per_node, fit.options)
        for replicas in range(1, cluster.nodes + 1) if auto_replicas else [inf.replicas]:
            used = nodes + inference_nodes(cfg, replica, replicas)
            if used > cluster.nodes:
                break
            gen = generation(cfg, work, mem, gpus, replicas, disaggregated(cfg)).seconds
            sync = sync_seconds(
                cfg, replicas * pd_factor(cfg), nodes * cluster.gpus_per_node
            ).seconds
            options.append((max(train, gen) + sync, used, nodes, replicas))
    if not options:  # check_cluster says why
        if auto_replicas:
            decide(inf, "replicas", 1)
        return fewest_trainer
    fastest = min(option[0] for option in options)
    near = [option for option in options if option[0] <= NEAR_FASTEST * fastest]
    _, _, nodes, replicas = min(near, key=lambda option: (option[1], option[0]))
    if auto_replicas:
        decide(inf, "replicas", replicas)
    return nodes


@dataclass(frozen=True)
class DiskNeed:
    """The most a run's checkpoints and published weights take in its run directory: an
    estimate from the model's parameters and dtype (the queue's store, logs and records are
    small beside them on any model worth checking)."""

    checkpoints: int
    """Checkpoints on disk at once: the newest `trainer.keep_checkpoints`, the one being
    written before the oldest goes, and those of `keep_checkpoint_steps`."""
    checkpoint_bytes: float
    """One checkpoint: the float32 master weights and AdamW's two moments."""
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
    model, trainer, dtypes = cfg.model, cfg.trainer, precision(cfg)
    count = model.total_params_b * 1e9
    weights = count * DTYPE_BYTES.get(model.dtype, 4)
    every, steps = trainer.checkpoint_every, cfg.max_steps
    written = steps // every - done // every if every else 0
    if steps > done and (not every or steps % every):
        written += 1  # the last step's
    named = {s for s in trainer.keep_checkpoint_steps if done < s <= steps}
    checkpoints = min(written, trainer.keep_checkpoints + 1 + len(named))
    versions = 1 + min(steps, kept_versions(cfg) + 1) if done == 0 else 1
    if model.lora.rank:  # checkpoints and versions after 0 hold the adapter: small
        return DiskNeed(checkpoints, 0.0, 1 if done == 0 else 0, weights, 0.0)
    master = CHECKPOINT_COPIES * count * DTYPE_BYTES[dtypes.master]
    reference = count * DTYPE_BYTES[dtypes.compute] if cfg.algorithm.kl_coef and not done else 0
    return DiskNeed(checkpoints, master, versions, weights, float(reference))
