"""vLLM's command line for one inference replica (or one instance of a prefill/decode replica):
its model, parallel degrees, memory, KV hand-over, LoRA and the worker extension that receives
broadcast weights; and the flags of each node of a replica spanning nodes."""

from __future__ import annotations

import json
from typing import Any

from omegaconf import DictConfig

from rl.core.config import Placement
from rl.core.derive import (
    FILE_KV_CONNECTOR,
    data_parallel,
    dp_per_node,
    kv_connector,
    max_model_len,
)
from rl.core.lora import enabled as lora_enabled
from rl.core.rundir import KV_FILES

# vLLM worker methods that receive broadcast weights (inference.weight_transport=broadcast).
VLLM_WORKER_EXTENSION = "rl.weights.sync.VllmWorkerExtension"


# KV cache a vLLM CPU server reserves (the tiny models served on CPU need far less).
CPU_KV_CACHE_BYTES = 512 * 2**20


# A prefill/decode replica: each instance's name suffix and vLLM KV role (a router fronts
# them: rl/inference/router.py).
PD_INSTANCES = {"prefill": "kv_producer", "decode": "kv_consumer"}


# vLLM's CPU attention takes KV blocks in multiples of 32; its default (128) would leave the
# short prompts of a CPU run without a whole block to hand from prefill to decode.
CPU_PD_BLOCK_SIZE = 32

# The ranks vLLM's --max-lora-rank accepts (vLLM's MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(cfg: DictConfig) -> int:
    """vLLM's --max-lora-rank for the run: the smallest it accepts that holds
    `inference.max_lora_rank` (or the run's rank)."""
    wanted = cfg.inference.max_lora_rank or cfg.model.lora.rank
    return next(r for r in VLLM_LORA_RANKS if r >= wanted)


def spanning_args(cfg: DictConfig, replica_nodes: int, rank: int) -> list[str]:
    """vLLM's flags for the process on the `rank`-th node of a replica spanning nodes: the
    head (rank 0) serves HTTP; every other node runs headless and joins the head. Data
    parallel: each node's engines are ranks of one data-parallel group, started from the
    head's RPC port. Otherwise: vLLM's multi-node executor, one torch.distributed group of
    tp x pp workers rooted at the head."""
    at = ["${RELAY_HEAD_ADDR}", "${RELAY_HEAD_PORT}"]
    if data_parallel(cfg, replica_nodes):
        args = ["--data-parallel-address", at[0], "--data-parallel-rpc-port", at[1]]
        if rank:
            start = rank * dp_per_node(cfg)
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
    cfg: DictConfig,
    replica_nodes: int,
    kv_role: str | None,
    instance: str = "inference-0",
    gpu_share: float | None = None,
) -> list[str]:
    """Arguments of vLLM's OpenAI server for one replica (or prefill/decode `instance`) of this
    model and layout; a replica spanning nodes adds `spanning_args` per node. `gpu_share`: the
    share of a GPU the planner left it beside the trainer (None: the model's
    `gpu_memory_utilization`)."""
    model, inf, cluster = cfg.model, cfg.parallel.inference, cfg.cluster
    serve = model.inference
    found = cluster.gpus_per_node or 0  # None (not yet filled in by plan()): none
    dp = dp_per_node(cfg)
    args = ["--model", model.path or model.hf_id or model.name, "--served-model-name", model.name]
    args += ["--tensor-parallel-size", str(inf.tp)]
    if data_parallel(cfg, replica_nodes):
        args += ["--data-parallel-size", str(dp * replica_nodes)]
        if replica_nodes > 1:
            args += ["--data-parallel-size-local", str(dp)]
    elif replica_nodes > 1:
        args += ["--pipeline-parallel-size", str(replica_nodes)]
    if inf.expert_parallel:
        args.append("--enable-expert-parallel")
    # On CPU vLLM computes in float32, as the embedded engine does; FP8 weights it dequantizes
    # to bf16 or fp16 only.
    dtype = model.dtype if found else "float32"
    if serve.quantization == "fp8" and dtype == "float32":
        dtype = "bfloat16"
    args += ["--dtype", dtype]
    args += ["--max-model-len", str(max_model_len(cfg))]
    if found:
        share = gpu_share or serve.gpu_memory_utilization
        args += ["--gpu-memory-utilization", str(share)]
        if cfg.placement == Placement.colocated:
            args.append("--enable-sleep-mode")  # the orchestrator sleeps it while training
    else:
        # vLLM's CPU build otherwise reserves most of a NUMA node for KV cache at start-up.
        args += ["--enforce-eager", "--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]
        # A prefill split across steps rewinds its request's generator, which a CPU generator
        # cannot do: a seeded request (every rollout's) would kill the engine. Whole prefills.
        args.append("--no-enable-chunked-prefill")
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
    # Relay's worker methods: weight loads (from disk, or broadcast) that leave no stale kernel
    args += ["--worker-extension-cls", VLLM_WORKER_EXTENSION]
    if lora_enabled(model):  # adapters loaded at runtime, each request naming its own
        args += ["--enable-lora", "--max-lora-rank", str(vllm_lora_rank(cfg))]
        args += ["--max-loras", str(cfg.inference.max_loras or 1)]
    return args
