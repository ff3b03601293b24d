"""How long a step takes on each side, and how to split the cluster so neither side waits.

Estimates from FLOPs and bandwidth at stated efficiencies (the constants below), for one step
of `prompts_per_step x group_size` samples whose length is `SAMPLE_FILL` of the served length
(`environment.max_context_tokens`, or the model's), of which up to `environment.max_tokens`
are generated:

- training: 6 FLOPs per active parameter and token (8 with activation checkpointing, which
  runs the forward twice) plus attention over the sample's own earlier tokens (at most
  `index_topk` under sparse attention), at `TRAIN_MFU` of the trainer GPUs' peak; with CPU
  offload, the optimiser state crosses PCIe twice per step;
- generation: prefill at `PREFILL_MFU` of peak; decode as iterations of a GPU's batch, each
  reading the GPU's weights and its sequences' KV cache at `HBM_EFFICIENCY` of its bandwidth
  or computing at `DECODE_MFU`, whichever is slower, with `MTP_ACCEPTED` of each drafted
  token accepted; prefill and decode overlap when they run on instances of their own;
- weight sync: rank 0 gathers the version from the trainer's shards over its link (in the
  model's dtype), re-quantizes it on its GPU where the base is FP8, then sends it by NCCL
  broadcast over one GPU's link at `LINK_EFFICIENCY`, in buckets (inference pauses that long),
  or writes it to the shared filesystem (after a copy to the host), read by every replica;
- a checkpoint: the trainer's float32 master weights and moments written at
  `cluster.storage_gbs`.

`balance` picks the trainer nodes and inference replicas (where the config leaves them to the
plan, 0) that make the slower side fastest in the fewest nodes. Pure arithmetic, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from launcher.plan.costs.memory import (
    DTYPE_BYTES,
    InferenceMemory,
    TrainerOptions,
    activation_bytes_per_token,
    params,
    served_bytes,
)
from rl.core.config import WeightTransport
from rl.core.derive import precision, weight_transport

TRAIN_MFU = 0.30
PREFILL_MFU = 0.40
DECODE_MFU = 0.30
HBM_EFFICIENCY = 0.70
LINK_EFFICIENCY = 0.80
PCIE_GBS = 25.0
"""Host-device bandwidth of one GPU, GB/s (PCIe 5 x16 in practice)."""
SAMPLE_FILL = 0.5
"""Samples average half the served length (prompt, tool output and completion together)."""
MTP_ACCEPTED = 0.6
"""Share of drafted tokens accepted (about 1.8 tokens per iteration at 3 draft tokens)."""
SIGNAL_MARGIN = 1.5
"""The signal comes this many times the step plus checkpoint time before the limit."""
SIGNAL_SLACK_S = 60
SLURM_MAX_SIGNAL_S = 65535
"""sbatch --signal takes at most this many seconds."""
GB = 1e9
QUANTIZE_PASSES = 4
"""HBM passes of FP8 re-quantization over the gathered bytes: each block's amax, the division
by its scale, the cast, and the result written."""


@dataclass(frozen=True)
class Workload:
    samples: int
    sample_tokens: int
    generated: int
    """Tokens generated per sample."""

    @property
    def tokens(self) -> int:
        return self.samples * self.sample_tokens


def workload(cfg: Any, served_len: int) -> Workload:
    env = cfg.environment
    sample = max(1, int(served_len * SAMPLE_FILL))
    return Workload(env.prompts_per_step * env.group_size, sample, min(env.max_tokens, sample))


def active_params(m: Any) -> float:
    """Parameters a token's matmuls touch (the input embedding is a lookup)."""
    p = params(m)
    routed = p.experts * m.experts_per_token / m.num_experts if m.num_experts else 0
    head = m.vocab_size * m.hidden_size
    return p.replicated - p.embedding + head + routed


def attention_flops_per_token(m: Any, context: float) -> float:
    """Forward FLOPs of one token attending to `context` earlier tokens, every block."""
    keys = min(context, m.index_topk) if m.index_topk else context
    width = m.head_dim + (m.v_head_dim or m.head_dim)
    return 2 * m.num_layers * m.num_attention_heads * width * keys


def train_seconds(cfg: Any, work: Workload, gpus: int, options: TrainerOptions) -> float:
    """Forward and backward over the step's tokens (the forward twice with activation
    checkpointing, the LM head's matmul again for each chunk with the chunked head), plus
    what offloading moves over PCIe: the blocks' inputs out and back, the optimiser state
    down and back up."""
    m, c = cfg.model, cfg.cluster
    per_token = 2 * active_params(m) + attention_flops_per_token(m, work.sample_tokens / 2)
    flops = per_token * (4 if options.checkpointing else 3) * work.tokens
    if options.head_chunk:
        flops += 2 * m.vocab_size * m.hidden_size * work.tokens
    seconds = flops / (gpus * c.gpu_tflops * 1e12 * TRAIN_MFU)
    if options.activation_offload:
        _, block_input = activation_bytes_per_token(m, DTYPE_BYTES[precision(cfg).compute])
        seconds += 2 * m.num_layers * block_input * work.tokens / gpus / (PCIE_GBS * GB)
    if options.offload:  # parameters, gradients and moments down and back up, every step
        state = params(m).trained * DTYPE_BYTES[precision(cfg).master] * 4 / gpus
        seconds += 2 * state / (PCIE_GBS * GB)
    return seconds


@dataclass(frozen=True)
class Generation:
    seconds: float
    prefill_s: float
    decode_s: float
    batch_per_gpu: int
    """Sequences each decode GPU runs at once (its KV cache's share, or the step's)."""


def generation(
    cfg: Any, work: Workload, mem: InferenceMemory, replica_gpus: int, replicas: int, pd: bool
) -> Generation:
    """Time to generate one step's samples on `replicas` replicas (each a prefill and a
    decode instance of `replica_gpus` GPUs when `pd`)."""
    m, c, serve = cfg.model, cfg.cluster, cfg.model.inference
    gpus = replica_gpus * replicas
    active = 2 * active_params(m)
    prefill_tokens = work.samples * (work.sample_tokens - work.generated)
    context = work.sample_tokens / 2
    prefill_flops = prefill_tokens * (active + attention_flops_per_token(m, context / 2))
    prefill_s = prefill_flops / (gpus * c.gpu_tflops * 1e12 * PREFILL_MFU)
    batch = max(1, min(mem.kv_tokens // work.sample_tokens, math.ceil(work.samples / gpus)))
    drafted = serve.num_speculative_tokens if serve.speculative_method else 0
    tokens_per_iteration = batch * (1 + MTP_ACCEPTED * drafted)
    weights = (mem.ceiling - mem.kv_cache - mem.terms.get("vLLM workspace", 0)) * 2**30
    read = weights + batch * context * mem.kv_per_token
    memory_s = read / (c.gpu_bandwidth_gbs * GB * HBM_EFFICIENCY)
    compute_s = (
        tokens_per_iteration
        * (active + attention_flops_per_token(m, context))
        / (c.gpu_tflops * 1e12 * DECODE_MFU)
    )
    per_gpu = tokens_per_iteration / max(memory_s, compute_s)
    decode_s = work.samples * work.generated / (per_gpu * gpus)
    seconds = max(prefill_s, decode_s) if pd else prefill_s + decode_s
    return Generation(seconds, prefill_s, decode_s, batch)


def sync_bytes(cfg: Any) -> float:
    """One published version: every weight trained, in the served format."""
    p = params(cfg.model)
    return served_bytes(cfg, p.trained - p.embedding) + served_bytes(cfg, p.embedding, True)


def gathered_bytes(cfg: Any) -> float:
    """One version as trainer rank 0 gathers it from the ranks' shards: in the model's dtype
    (each rank casts its float32 master shard before the gather)."""
    return params(cfg.model).trained * DTYPE_BYTES.get(str(cfg.model.dtype), 4)


@dataclass(frozen=True)
class Sync:
    """Seconds from the optimiser step to every server holding the new version."""

    gather_s: float
    """Rank 0 gathering the version block by block from the other ranks' shards."""
    quantize_s: float
    """Re-quantizing it into an FP8 base's block format, on rank 0's GPU (0 without one)."""
    transfer_s: float
    """The broadcast to the servers, or the write and the servers' reads of the files
    (with the host copy the write needs)."""

    @property
    def seconds(self) -> float:
        return self.gather_s + self.quantize_s + self.transfer_s


def sync_seconds(cfg: Any, replicas: int, trainer_gpus: int = 1) -> Sync:
    """A weight sync's stages, one after another as rank 0 runs them block by block: the
    gather over rank 0's link, the FP8 re-quantization (reading the gathered bytes and
    writing the quantized ones and their scales, a few passes over HBM), then the transfer
    (inference pauses for that)."""
    c = cfg.cluster
    gathered = gathered_bytes(cfg)
    size = sync_bytes(cfg)
    link = c.link_gbs * GB * LINK_EFFICIENCY
    gather = gathered * (1 - 1 / trainer_gpus) / link
    quantize = 0.0
    if cfg.model.inference.quantization == "fp8":
        quantize = QUANTIZE_PASSES * gathered / (c.gpu_bandwidth_gbs * GB * HBM_EFFICIENCY)
    if weight_transport(cfg) == WeightTransport.broadcast:
        return Sync(gather, quantize, size / link)
    host_copy = size / (PCIE_GBS * GB)
    return Sync(gather, quantize, host_copy + size * (1 + replicas) / (c.storage_gbs * GB))


def checkpoint_bytes(cfg: Any, optimizer: bool = True) -> float:
    """A trainer checkpoint: the float32 master weights, and AdamW's two moments."""
    p = params(cfg.model)
    return p.trained * DTYPE_BYTES[precision(cfg).master] * (3 if optimizer else 1)


def checkpoint_seconds(cfg: Any, optimizer: bool = True) -> float:
    return checkpoint_bytes(cfg, optimizer) / (cfg.cluster.storage_gbs * GB)


def signal_delay(step_s: float, checkpoint_s: float) -> int:
    """Seconds before the limit to warn the job: the step under way, then the checkpoint."""
    return int(math.ceil(SIGNAL_MARGIN * (step_s + checkpoint_s))) + SIGNAL_SLACK_S


def duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
