"""Checks that a plan promises only what can run, each failing with one line that names the key
and the fix (launcher/plan.py calls them before anything starts):

- a model whose weights are not built or shipped here needs `model.path` (there is no model
  hub): refused before a run starts; the plan (and so a dry run) says so in a note;
- a cluster without GPUs runs only models whose training state and weights fit the node's host
  memory, and none served in FP8 (vLLM's CPU build has no FP8 kernels);
- an FP8 MoE whose experts, split by tensor parallelism, no longer cover whole FP8 blocks
  (MiniMax-M2's 1536-wide experts over TP8 are 192 wide, not a multiple of 128) is served with
  expert parallelism, which keeps each expert whole.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from omegaconf import DictConfig

from launcher.errors import PlanError
from rl import lora
from rl.config import Backend, ClusterKind, Placement, WeightTransport
from rl.derive import inference_backend

# Trainer state per parameter under FSDP2 mixed precision: fp32 sharded parameters (4 B),
# fp32 gradients (4 B) and two AdamW moments (8 B); and served weights' bytes by dtype.
TRAIN_BYTES_PER_PARAM = 16
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
FP8_BLOCK = 128  # the width of an FP8 weight block (128 x 128) in the shipped FP8 checkpoints
LOCAL_SOURCES = ("random", "gguf_package")  # built here, or shipped inside a Python package


def weights_missing(cfg: DictConfig) -> str:
    """Why this run has no weights to load ("" when it has): a hub model without `model.path`,
    or a `model.path` that is not a checkpoint directory."""
    model = cfg.model
    if model.path:
        path = Path(model.path)
        if not (path / "config.json").is_file():
            return f"model.path={model.path}: no HF checkpoint there (no config.json)"
        return ""
    if str(model.source) in LOCAL_SOURCES:
        return ""
    return (
        f"model.path: model={model.name} is not built here and there is no model hub; set "
        f"model.path to a local copy of {model.hf_id or model.name} (an HF checkpoint directory)"
    )


def check_weights(cfg: DictConfig) -> None:
    """Refuse to start a run without weights (the launcher calls it once the plan is made; a
    dry run shows the reason as a note instead)."""
    if reason := weights_missing(cfg):
        raise PlanError(reason)


def check_cpu_fit(cfg: DictConfig) -> None:
    """On a cluster without GPUs: the model must fit the node's memory, and not be FP8."""
    cluster, model = cfg.cluster, cfg.model
    if cluster.gpus_per_node:
        return
    quantization = model.inference.quantization
    if quantization == "fp8":
        raise PlanError(
            f"model={model.name}: it is served in FP8, which needs GPUs, and cluster="
            f"{cluster.name} has none (cluster.gpus_per_node=0); use a GPU cluster "
            f"(cluster=slurm) or a model that runs on CPU (tiny, smollm2_135m, qwen3_0_6b)"
        )
    weights = DTYPE_BYTES.get(str(quantization or model.dtype), 4)
    need_gb = model.total_params_b * (TRAIN_BYTES_PER_PARAM + weights)
    if need_gb > cluster.mem_gb_per_node:
        raise PlanError(
            f"model={model.name}: its training state and served weights take ~{need_gb:.0f} GB "
            f"and cluster={cluster.name} has no GPUs and {cluster.mem_gb_per_node} GB of memory "
            f"per node; use a GPU cluster (cluster=slurm) or a smaller model"
        )


def check_expert_split(cfg: DictConfig) -> None:
    model, inf = cfg.model, cfg.parallel.inference
    if not model.num_experts or inf.expert_parallel or model.inference.quantization != "fp8":
        return
    width = model.moe_intermediate_size
    if width % inf.tp or (width // inf.tp) % FP8_BLOCK:
        raise PlanError(
            f"parallel.inference.tp={inf.tp}: model={model.name}'s {width}-wide FP8 experts "
            f"split {inf.tp} ways are {width / inf.tp:g} wide, not a multiple of the "
            f"{FP8_BLOCK}-wide FP8 blocks; serve it with expert parallelism (parallel=ep8, or "
            f"parallel.inference.expert_parallel=true)"
        )


def check_lora(cfg: DictConfig) -> str:
    """A LoRA run's targets must be known and its rank within what the servers accept; returns
    the plan's note on what is adapted ("" without LoRA)."""
    model, inf = cfg.model, cfg.inference
    if not lora.enabled(model):
        return ""
    try:
        targets = lora.targets(model)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    rank = model.lora.rank
    if inf.max_lora_rank is not None and rank > inf.max_lora_rank:
        raise PlanError(
            f"model.lora.rank={rank}: above inference.max_lora_rank={inf.max_lora_rank}, the "
            f"largest adapter the servers accept (vLLM's --max-lora-rank); lower the rank or "
            f"raise inference.max_lora_rank"
        )
    vllm = inference_backend(cfg) == Backend.vllm
    if vllm and max(rank, inf.max_lora_rank or 0) > VLLM_LORA_RANKS[-1]:
        raise PlanError(
            f"model.lora.rank={rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}"
        )
    if vllm and inf.weight_transport == WeightTransport.broadcast:
        raise PlanError(
            "inference.weight_transport=broadcast: vLLM loads LoRA adapters from their "
            "directories (each a few MB); use inference.weight_transport=filesystem"
        )
    return (
        f"LoRA rank {rank} (scale {lora.scale(model):g}) on {', '.join(targets)}: only the "
        f"adapter trains and travels; version 0 is the base in full"
    )


def check_shared_inference(cfg: DictConfig) -> None:
    """What a sweep point sharing inference (`inference.shared`) needs: a LoRA adapter (what
    the shared service holds per point) on one machine's CPUs, loaded from disk."""
    if not cfg.inference.shared:
        return
    key = "inference.shared=true"
    if not lora.enabled(cfg.model):
        raise PlanError(
            f"{key}: the shared inference serves one base and each point's LoRA adapter; set "
            f"model.lora.rank (for example model.lora.rank=16)"
        )
    slurm = cfg.cluster.kind == ClusterKind.slurm
    if slurm and cfg.warmup.steps:
        raise PlanError(
            f"warmup.steps={cfg.warmup.steps}: on Slurm a shared sweep starts every point from "
            f"the base it is given (model.path, for example a run's weights/step_0); set "
            f"warmup.steps=0"
        )
    if not slurm and cfg.cluster.gpus_per_node:
        raise PlanError(
            f"{key} on one machine's GPUs: not built yet (each point's trainer needs GPUs of "
            f"its own beside the service's); sweep with cluster=slurm, or without it"
        )
    if cfg.inference.weight_transport != WeightTransport.filesystem:
        raise PlanError(
            f"{key}: each point's adapter reaches the shared inference from its weights/ "
            f"directory; use inference.weight_transport=filesystem"
        )
    if cfg.placement != Placement.split:
        raise PlanError(
            f"{key}: the points' trainers run beside the shared inference; use placement=split"
        )


# The ranks vLLM's --max-lora-rank accepts (vLLM's MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(cfg: DictConfig) -> int:
    """vLLM's --max-lora-rank for the run: the smallest it accepts that holds
    `inference.max_lora_rank` (or the run's rank)."""
    wanted = cfg.inference.max_lora_rank or cfg.model.lora.rank
    return next(r for r in VLLM_LORA_RANKS if r >= wanted)


SAFE = re.compile(r"^[\w@%+=:,./-]+$|^\$\{\w+\}$")


def shell_join(argv: list[str]) -> str:
    """`argv` as a command a shell runs as planned: arguments quoted where the shell would
    change them (JSON, spaces), `${VAR}` placeholders left for the shell to expand."""
    return " ".join(a if SAFE.match(a) else shlex.quote(a) for a in argv)
