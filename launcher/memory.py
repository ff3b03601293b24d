"""What each GPU holds: a memory model of the trainer and of an inference server, term by term.

Every number is derived from the model option's architecture fields (layers, widths, heads,
experts, vocabulary; rl/core/config.py), never from a typed-in total:

- `Params` counts the weights by kind. Routed experts are the weights expert parallelism
  shards; attention, dense and shared-expert MLPs, routers and embeddings are what data
  parallelism copies to every rank.
- `trainer_memory`: one FSDP2 rank's parameters, gradients and AdamW's two moments (all in the
  model's dtype, as rl/trainer/parallel.py keeps them; on the host with `cpu_offload`), the
  blocks FSDP gathers whole, the activations of one micro-batch (every block's saved tensors,
  or with activation checkpointing only each block's input plus one block recomputed) and the
  logits over the vocabulary.
- `inference_memory`: one vLLM GPU's weights (replicated under data parallelism, split under
  tensor parallelism, experts spread over the replica under expert parallelism; FP8 where the
  model is served so), the MTP draft, and the KV cache that is left under
  `gpu_memory_utilization`, which must hold at least one sequence of the served length.

Pure arithmetic in GiB (as `cluster.gpu_memory_gb` is); no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GIB = 2**30

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}

TRAINER_STATE_COPIES = 4
"""What the trainer keeps of each parameter, in the model's dtype: the weight, its gradient
and AdamW's two moments."""

FP8_BLOCK = 128
"""FP8 checkpoints quantise each weight in 128 x 128 blocks, with one fp32 scale per block."""

CUDA_CONTEXT_GB = 1.0
"""The CUDA context of one process, and its share of NCCL's buffers."""

ALLOCATOR_HEADROOM = 0.05
"""Share of a trainer GPU left to the caching allocator's fragmentation."""

LOGIT_BYTES = 8
"""Bytes per vocabulary entry and token beyond the logits themselves: their fp32 log-softmax
and its gradient (the loss computes token logprobs in fp32)."""

VLLM_WORKSPACE_GB = 4.0
"""What vLLM keeps beside weights and KV cache inside its share: the activations of its
profiling batch (8192 tokens), CUDA graphs and sampler buffers."""


@dataclass(frozen=True)
class Params:
    """A model's parameters by kind (counts, not bytes)."""

    embedding: int
    """Input embedding and (untied) output head."""
    attention: int
    """Every block's attention (with MLA's and the sparse indexer's projections)."""
    dense_mlp: int
    """The MLPs of dense blocks."""
    shared_experts: int
    routers: int
    experts: int
    """Routed experts: what expert parallelism shards."""
    mtp: int
    """Multi-token-prediction blocks (served as the draft, not trained)."""
    expert_block: int
    """One MoE block's routed experts."""
    moe_block: int
    """One MoE block's other weights (attention, shared expert, router)."""
    dense_block: int
    """One dense block's weights."""

    @property
    def replicated(self) -> int:
        """What data parallelism copies to every rank (everything but routed experts)."""
        return self.embedding + self.attention + self.dense_mlp + self.shared_experts + self.routers

    @property
    def trained(self) -> int:
        return self.replicated + self.experts


def attention_params(m: Any) -> int:
    """One block's attention: grouped-query, or multi-head latent (MLA) with its indexer."""
    h, heads = m.hidden_size, m.num_attention_heads
    if not m.kv_lora_rank:
        return 2 * h * heads * m.head_dim + 2 * h * m.num_kv_heads * m.head_dim
    v_dim = m.v_head_dim or m.head_dim
    query_in = m.q_lora_rank or h
    query = (h * m.q_lora_rank if m.q_lora_rank else 0) + query_in * heads * m.head_dim
    latent = h * (m.kv_lora_rank + m.qk_rope_head_dim)
    keys_values = m.kv_lora_rank * heads * (m.head_dim - m.qk_rope_head_dim + v_dim)
    out = heads * v_dim * h
    indexer = 0
    if m.index_n_heads:
        indexer = query_in * m.index_n_heads * m.index_head_dim + h * m.index_head_dim
        indexer += h * m.index_n_heads
    return query + latent + keys_values + out + indexer


def params(m: Any) -> Params:
    """The model's parameters by kind, from its architecture fields."""
    h = m.hidden_size
    moe_blocks = m.num_layers - m.first_dense_layers if m.num_experts else 0
    dense_blocks = m.num_layers - moe_blocks
    expert = 3 * h * m.moe_intermediate_size  # gate, up and down projections
    attention = attention_params(m)
    shared = m.num_shared_experts * expert
    router = m.num_experts * h
    moe_block = attention + shared + router
    mtp_block = moe_block + m.num_experts * expert + 2 * h * h if m.num_experts else 0
    return Params(
        embedding=m.vocab_size * h * (1 if m.tie_word_embeddings else 2),
        attention=m.num_layers * attention,
        dense_mlp=dense_blocks * 3 * h * m.intermediate_size,
        shared_experts=moe_blocks * shared,
        routers=moe_blocks * router,
        experts=moe_blocks * m.num_experts * expert,
        mtp=m.mtp_layers * (mtp_block or attention + 3 * h * m.intermediate_size + 2 * h * h),
        expert_block=m.num_experts * expert if moe_blocks else 0,
        moe_block=moe_block if moe_blocks else 0,
        dense_block=attention + 3 * h * m.intermediate_size if dense_blocks else 0,
    )


def activation_bytes_per_token(m: Any, dtype_bytes: int) -> tuple[float, float]:
    """Bytes one token's activations take in the largest block while it is saved for the
    backward pass (the inputs of each matmul, norm and activation function), and in a block
    under activation checkpointing (its input alone)."""
    h, heads = m.hidden_size, m.num_attention_heads
    if m.kv_lora_rank:
        v_dim = m.v_head_dim or m.head_dim
        attention = m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim
        attention += heads * (m.head_dim + m.head_dim - m.qk_rope_head_dim + v_dim + v_dim)
    else:
        attention = (2 * heads + 2 * m.num_kv_heads) * m.head_dim
    attention += 2 * h  # the norm's input and output
    if m.num_experts:
        routed = m.experts_per_token * (h + 3 * m.moe_intermediate_size)
        mlp = routed + 3 * m.num_shared_experts * m.moe_intermediate_size + 2 * h
        mlp += 4 * m.num_experts / dtype_bytes  # the router's fp32 scores
    else:
        mlp = 3 * m.intermediate_size + 2 * h
    residual = 2 * h
    return dtype_bytes * (attention + mlp + residual), dtype_bytes * h


@dataclass(frozen=True)
class TrainerMemory:
    """One trainer GPU's memory, GiB by term, and what the host holds for it."""

    gpu: float
    terms: dict[str, float]
    host_per_gpu: float
    """Offloaded state on the host, per GPU."""
    checkpointing: bool
    offload: bool

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def usable(self) -> float:
        return self.gpu * (1 - ALLOCATOR_HEADROOM)

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    def describe(self) -> str:
        parts = ", ".join(f"{name} {gb:.1f}" for name, gb in self.terms.items())
        host = f"; host {self.host_per_gpu:.1f} GiB per GPU" if self.offload else ""
        return f"{self.total:.1f} of {self.usable:.1f} GiB usable ({parts}){host}"


def trainer_memory(
    cfg: Any, mesh: dict[str, int], checkpointing: bool, offload: bool
) -> TrainerMemory:
    """One trainer rank's memory under `mesh`, with or without activation checkpointing and
    CPU offload (the plan tries them in that order)."""
    m = cfg.model
    b = DTYPE_BYTES.get(str(m.dtype), 4)
    p = params(m)
    shards = mesh["world"] // mesh["dp_replicate"]  # FSDP shards dense and expert weights alike
    state = p.trained * b / shards / GIB
    ep = mesh.get("ep", 1)
    # The largest block's weights, gathered whole (an EP rank's experts of it, with MoE)
    block = max(p.dense_block, p.moe_block + p.expert_block / ep) / GIB
    tokens = cfg.trainer.micro_batch_tokens / mesh.get("cp", 1)
    saved, block_input = activation_bytes_per_token(m, b)
    if checkpointing:
        activations = tokens * (m.num_layers * block_input + saved) / GIB
    else:
        activations = tokens * m.num_layers * saved / GIB
    resident = 0.0 if offload else 1.0
    terms = {
        "parameters": resident * state,
        "gradients": resident * state,
        "optimizer": resident * (TRAINER_STATE_COPIES - 2) * state,
        "gathered blocks": block * (2 * b + 4),  # this block and the next, its fp32 gradient
        "activations": activations,
        "logits": tokens * m.vocab_size * (b + LOGIT_BYTES) / GIB,
        "context": CUDA_CONTEXT_GB,
    }
    return TrainerMemory(
        cfg.cluster.gpu_memory_gb,
        terms,
        (1 - resident) * TRAINER_STATE_COPIES * state,
        checkpointing,
        offload,
    )


@dataclass(frozen=True)
class InferenceMemory:
    """One inference GPU's memory, GiB by term, under `gpu_memory_utilization`."""

    gpu: float
    utilization: float
    terms: dict[str, float]
    kv_per_token: float
    """KV-cache bytes per token on this GPU."""
    served_len: int
    notes: list[str] = field(default_factory=list)

    @property
    def ceiling(self) -> float:
        return self.gpu * self.utilization

    @property
    def kv_cache(self) -> float:
        return self.ceiling - sum(self.terms.values())

    @property
    def kv_tokens(self) -> int:
        return int(max(self.kv_cache, 0) * GIB / self.kv_per_token)

    @property
    def fits(self) -> bool:
        return self.kv_tokens >= self.served_len

    def describe(self) -> str:
        parts = ", ".join(f"{name} {gb:.1f}" for name, gb in self.terms.items())
        return (
            f"{self.ceiling:.1f} GiB ({self.utilization:g} x {self.gpu:g}): {parts}, KV cache "
            f"{self.kv_cache:.1f} ({self.kv_tokens:,} tokens = "
            f"{self.kv_tokens / self.served_len:.1f} sequences of {self.served_len:,})"
        )


def served_bytes(cfg: Any, count: int, embedding: bool = False) -> float:
    """Bytes of `count` served weights: FP8 linear weights carry one fp32 scale per block;
    embeddings stay in the training dtype."""
    if cfg.model.inference.quantization == "fp8" and not embedding:
        return count * (1 + 4 / FP8_BLOCK**2)
    return count * DTYPE_BYTES.get(str(cfg.model.dtype), 4)


def kv_bytes_per_token(cfg: Any, tp: int) -> float:
    """KV cache per token on one GPU: MLA's latent and rotary key (the same on every
    tensor-parallel rank) plus the indexer's FP8 keys, or grouped-query keys and values split
    over tensor parallelism."""
    m, serve = cfg.model, cfg.model.inference
    kv_b = 1 if serve.kv_cache_dtype.startswith("fp8") else DTYPE_BYTES.get(str(m.dtype), 4)
    if m.kv_lora_rank:
        per_layer = (m.kv_lora_rank + m.qk_rope_head_dim) * kv_b
        per_layer += m.index_head_dim + 4 if m.index_n_heads else 0  # fp8 keys + a scale
        return m.num_layers * per_layer
    heads = max(m.num_kv_heads // tp, 1)
    return 2 * m.num_layers * heads * m.head_dim * kv_b


def inference_memory(
    cfg: Any, replica_gpus: int, served_len: int, stages: int = 1
) -> InferenceMemory:
    """One GPU of an inference replica of `replica_gpus` GPUs (tp x dp x nodes; `stages`
    pipeline stages split the layers)."""
    m, inf = cfg.model, cfg.parallel.inference
    p = params(m)
    tp = inf.tp * stages
    expert_split = replica_gpus if inf.expert_parallel else tp
    replicated = p.replicated - p.embedding
    terms = {
        "replicated weights": served_bytes(cfg, replicated) / tp / GIB,
        "embeddings": served_bytes(cfg, p.embedding, embedding=True) / tp / GIB,
        "experts": served_bytes(cfg, p.experts) / expert_split / GIB,
    }
    if not m.num_experts:
        del terms["experts"]
    if m.inference.speculative_method == "mtp" and m.inference.num_speculative_tokens:
        mtp_experts = m.mtp_layers * p.expert_block
        draft = served_bytes(cfg, p.mtp - mtp_experts) / tp + served_bytes(cfg, mtp_experts) / (
            expert_split
        )
        terms["MTP draft"] = draft / GIB
    terms["vLLM workspace"] = VLLM_WORKSPACE_GB
    return InferenceMemory(
        cfg.cluster.gpu_memory_gb,
        m.inference.gpu_memory_utilization,
        terms,
        kv_bytes_per_token(cfg, tp),
        served_len,
    )
