"""What each GPU holds: a memory model of the trainer and of an inference server, term by term.

Every number is derived from the model option's architecture fields (layers, widths, heads,
experts, vocabulary; rl/core/config.py), never from a typed-in total:

- `Params` counts the weights by kind. Routed experts are the weights expert parallelism
  shards; attention, dense and shared-expert MLPs, routers and embeddings are what data
  parallelism copies to every rank.
- `trainer_memory`: one FSDP2 rank's parameters, gradients and AdamW's two moments (float32
  master copies, as rl/trainer/parallel.py keeps them; on the host with `cpu_offload`), the
  blocks FSDP gathers whole in the compute dtype, the activations of the largest micro-batch
  (one sample of the served length where that is longer than the budget: every block's saved
  tensors, or with activation checkpointing only each block's input plus one block
  recomputed, those inputs on the host with activation offload), attention's quadratic terms,
  the gathered keys and values of context parallelism, the logits over the vocabulary (or one
  chunk of them), expert parallelism's all-to-all buffers and NCCL's communicators, against
  the GPU's memory less a stated reserve.
- `inference_memory`: one vLLM GPU's weights (replicated under data parallelism, split under
  tensor parallelism, experts spread over the replica under expert parallelism; FP8 where the
  model is served so), the MTP draft, and the KV cache that is left under
  `gpu_memory_utilization`, which must hold at least one sequence of the served length.

Pure arithmetic in GiB (as `cluster.gpu_memory_gb` is); no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rl.core.derive import max_model_len, precision

GIB = 2**30

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}

TRAINER_STATE_COPIES = 4
"""What the trainer keeps of each parameter, in the master dtype (float32): the weight, its
gradient and AdamW's two moments."""

FP8_BLOCK = 128
"""FP8 checkpoints quantise each weight in 128 x 128 blocks, with one fp32 scale per block."""

CUDA_CONTEXT_GB = 1.0
"""The CUDA context of one process, with cuBLAS's workspaces."""

NCCL_COMM_GB = 1.0
"""GPU memory of one NCCL communicator at NCCL's default sizes: per channel and peer, a
receive buffer for each protocol (Simple 4 MiB, LL128 4.7 MiB, LL 0.5 MiB), for the ring's
peer and the tree's up to three, over 32 channels (what NCCL opens on NVLink and 400 Gb/s
fabrics): 32 x 4 x 9.2 MiB, about 1.1 GiB; stated, not measured here (no GPU)."""

LOGIT_BYTES = 8
"""Bytes per vocabulary entry and token beyond the logits themselves: their fp32 log-softmax
and its gradient (the loss computes token logprobs in fp32)."""

CHUNK_LOGIT_BYTES = 12
"""Bytes per vocabulary entry and token of a chunk of the LM head beyond its logits: their
fp32 copy, the softmax, and (in the backward pass) the gradient of the logits."""

DSA_INDEXER_BYTES = 8
"""Bytes per indexer head and (query, key) pair of transformers' DeepSeek sparse-attention
indexer: the fp32 scores and their ReLU, alive together."""

DSA_MASK_BYTES = 6
"""Bytes per (query, key) pair beside the indexer's heads: the fp32 weighted score, the
top-k mask and the mask combined with the causal one (booleans)."""

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
class TrainerOptions:
    """What the plan may turn on to fit a trainer rank, in the order it tries them (besides
    the context-parallel degree, which is the mesh's)."""

    checkpointing: bool = False
    """Activation checkpointing: each block keeps only its input; one block is recomputed."""
    head_chunk: int = 0
    """Tokens per chunk of the LM head (0: the whole micro-batch's logits at once)."""
    activation_offload: bool = False
    """With checkpointing: the blocks' inputs in host memory."""
    offload: bool = False
    """FSDP's CPU offload: parameters, gradients and AdamW's moments in host memory."""

    def describe(self) -> list[str]:
        return [
            what
            for what, on in (
                ("activation checkpointing", self.checkpointing),
                (f"LM head in chunks of {self.head_chunk:,} tokens", self.head_chunk),
                ("activation offload", self.activation_offload),
                ("CPU offload", self.offload),
            )
            if on
        ]


@dataclass(frozen=True)
class TrainerMemory:
    """One trainer GPU's memory, GiB by term, and what the host holds for it."""

    gpu: float
    reserve: float
    """Share of the GPU left free (`cluster.gpu_memory_reserve`)."""
    terms: dict[str, float]
    host_per_gpu: float
    """Offloaded state and activations on the host, per GPU."""
    options: TrainerOptions
    mesh: dict[str, int]
    tokens: int
    """Tokens of the largest micro-batch: the budget, or one sample of the served length."""

    @property
    def checkpointing(self) -> bool:
        return self.options.checkpointing

    @property
    def offload(self) -> bool:
        return self.options.offload

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def usable(self) -> float:
        return self.gpu * (1 - self.reserve)

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    def describe(self) -> str:
        parts = ", ".join(f"{name} {gb:.1f}" for name, gb in self.terms.items())
        host = f"; host {self.host_per_gpu:.1f} GiB per GPU" if self.host_per_gpu else ""
        return (
            f"{self.total:.1f} of {self.usable:.1f} GiB usable ({self.gpu:g} GiB less "
            f"{self.reserve:.0%} reserve; {parts}){host}"
        )


def trainer_memory(
    cfg: Any,
    mesh: dict[str, int],
    options: TrainerOptions = TrainerOptions(),
    served: int | None = None,
) -> TrainerMemory:
    """One trainer rank's memory under `mesh` (its `cp` included) with `options`, term by term:

    - parameters, gradients and AdamW's two moments: the rank's FSDP shard, in the master
      dtype (float32: 16 bytes an element);
    - FSDP's gathered blocks in the compute dtype (this block and the next), the block's
      unsharded gradient and its cast to the reduce dtype; one process under autocast holds a
      compute-dtype copy of every weight instead;
    - activations of the largest micro-batch (`micro_batch_tokens`, or one sample of the
      served length alone, split over `cp`);
    - attention's quadratic terms: the mask of packed rows (a boolean and SDPA's additive
      copy), and for DeepSeek sparse attention transformers' dense indexer (each query's fp32
      score against every key, for every indexer head);
    - under CP, the keys and values of the whole row each block gathers;
    - the logits (or one chunk of them, and the head's input);
    - expert parallelism's all-to-all buffers; one buffer set per NCCL communicator; the CUDA
      context.

    `served`: the longest sample (default: the run's served length)."""
    m, trainer, prec = cfg.model, cfg.trainer, precision(cfg)
    b_master, b = DTYPE_BYTES[prec.master], DTYPE_BYTES[prec.compute]
    p = params(m)
    world, cp, ep = mesh["world"], mesh.get("cp", 1), mesh.get("ep", 1)
    shards = world // mesh["dp_replicate"]  # FSDP shards dense and expert weights alike
    state = p.trained / shards / GIB
    served = served or max_model_len(cfg)
    tokens = max(int(trainer.micro_batch_tokens), served)
    local = tokens / cp
    saved, block_input = activation_bytes_per_token(m, b)
    host = 0.0
    if not options.checkpointing:
        activations = local * m.num_layers * saved
    elif options.activation_offload:  # two block inputs in flight, the recomputed block
        activations = local * (2 * block_input + saved)
        host += local * m.num_layers * block_input / GIB
    else:
        activations = local * (m.num_layers * block_input + saved)
    resident = 0.0 if options.offload else 1.0
    terms = {
        "parameters": resident * state * b_master,
        "gradients": resident * state * b_master,
        "optimizer": resident * 2 * state * b_master,
    }
    if world > 1:
        # The largest block's weights, gathered whole (an EP rank's experts of it, with MoE)
        block = max(p.dense_block, p.moe_block + p.expert_block / ep) / GIB
        terms["gathered blocks"] = block * (3 * b + DTYPE_BYTES[prec.reduce])
    elif prec.mixed:
        terms["compute copy"] = p.trained * b / GIB
    terms["activations"] = activations / GIB
    terms["attention"] = attention_bytes(m, cfg, tokens, served, cp, b) / GIB
    if cp > 1:
        kept = 2 if options.checkpointing else m.num_layers  # blocks holding gathered K/V
        terms["gathered K/V (CP)"] = kept * tokens * kv_elements(m) * b / GIB
    terms["logits"] = logits_bytes(m, local, options.head_chunk, b) / GIB
    if ep > 1:  # one MoE block's rows in flight: sent, and back before the weighted sum
        terms["expert all-to-all"] = 3 * local * m.experts_per_token * m.hidden_size * b / GIB
    terms["NCCL communicators"] = communicators(mesh) * NCCL_COMM_GB
    terms["context"] = CUDA_CONTEXT_GB
    host += (1 - resident) * 4 * state * b_master
    return TrainerMemory(
        cfg.cluster.gpu_memory_gb,
        float(cfg.cluster.gpu_memory_reserve),
        terms,
        host,
        options,
        mesh,
        tokens,
    )


def kv_elements(m: Any) -> int:
    """Elements of one token's keys and values in one block as attention reads them: grouped
    heads, or MLA's keys and values expanded per head (as transformers computes them)."""
    if m.kv_lora_rank:
        return m.num_attention_heads * (m.head_dim + (m.v_head_dim or m.head_dim))
    return 2 * m.num_kv_heads * m.head_dim


def attention_bytes(m: Any, cfg: Any, tokens: int, served: int, cp: int, b: int) -> float:
    """The larger of attention's quadratic terms in one block, per rank: a packed micro-batch
    (rows no wider than the served length, `micro_batch_tokens` in all) under its mask, or the
    longest sample alone. A row of one sample attends causally without a mask (rl/trainer/
    packing.py), but DeepSeek sparse attention always takes one, and its indexer (as
    transformers implements it) scores every query against every key for each of its heads in
    fp32: `DSA_INDEXER_BYTES` per indexer head and (query, key) pair."""
    budget = int(cfg.trainer.micro_batch_tokens)
    packed_width = min(budget, served)
    mask = 1 + b  # the boolean mask and SDPA's additive copy of it
    if m.index_n_heads:
        pair = m.index_n_heads * DSA_INDEXER_BYTES + DSA_MASK_BYTES + mask
        widest = max(budget * packed_width, served * served)
        return widest * pair / cp
    return budget * packed_width * mask / cp


def logits_bytes(m: Any, tokens: float, head_chunk: int, b: int) -> float:
    """The LM head's logits for `tokens` (with their fp32 log-softmax and its gradient), or
    one chunk's (recomputed in the backward pass) plus the head's saved input."""
    if not head_chunk:
        return tokens * m.vocab_size * (b + LOGIT_BYTES)
    chunk = min(head_chunk, tokens)
    return chunk * m.vocab_size * (b + CHUNK_LOGIT_BYTES) + tokens * m.hidden_size * b


def communicators(mesh: dict[str, int]) -> int:
    """NCCL communicators a trainer rank holds: the world's, FSDP's, and one per further mesh
    dimension it uses (experts' FSDP group and EP's, CP's, HSDP's replicas); rank 0 also
    holds the weight-broadcast group's (one process: that one alone)."""
    if mesh["world"] == 1:
        return 1
    count = 2
    count += 2 if mesh.get("ep", 1) > 1 else 0
    count += 1 if mesh.get("cp", 1) > 1 else 0
    count += 1 if mesh["dp_replicate"] > 1 else 0
    return count + 1


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
