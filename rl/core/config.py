"""Typed schema of a Relay run: the one source of defaults for every config group.

Each YAML option under conf/ selects and overrides values of these dataclasses; Hydra validates
it against them when the run is composed, so an unknown key or a wrong type fails before
anything starts. This module imports no torch: `rl --help` and planning must stay fast.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, is_dataclass
from enum import StrEnum
from typing import Any

from omegaconf import II, MISSING, OmegaConf

from rl.core.kinds import STEP_FIELDS
from rl.core.seeds import MAX_SEED

"""torch.manual_seed takes a signed 64-bit integer."""
MAX_PORT = 65535


@dataclass(frozen=True)
class Bounds:
    """The valid range of a numeric setting, kept on its field (`bounded`) and checked before
    anything starts (launcher/plan/checks.py). None on either side: unbounded there; `also`: values
    valid outside the range (-1 for "fill"); `text` replaces the generated description and
    `note` says what a boundary value means."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    also: tuple[Any, ...] = ()
    text: str = ""
    note: str = ""

    def admits(self, value: Any) -> bool:
        if value in self.also:
            return True
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )

    def describe(self) -> str:
        """What is valid, as the refusal says it: `must be >= 1 (0 skips the warm-up)`."""
        text = self.text or self._generated()
        return f"{text} ({self.note})" if self.note else text

    def _generated(self) -> str:
        if self.gt == 0 and self.le is None and self.lt is None:
            return "must be a positive number"
        if self.ge is not None and self.le is not None:
            return f"must be between {self.ge} and {self.le}"
        parts = [f"{op} {value}" for op, value in (
            (">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt)
        ) if value is not None]  # fmt: skip
        return "must be " + " and ".join(parts)


def bounded(default: Any, **bounds: Any) -> Any:
    """A dataclass field with `default` and the `Bounds` its values must keep to."""
    return field(default=default, metadata={"bounds": Bounds(**bounds)})


SECONDS = "must be a positive number of seconds"


GROUPS = ("model", "parallel", "algorithm", "environment", "cluster")
DEFAULT_MICRO_BATCH_TOKENS = 8192
"""`trainer.micro_batch_tokens` unless set (and the queue's when a rank names none)."""


class WeightSource(StrEnum):
    random = "random"
    gguf_package = "gguf_package"
    hf = "hf"


class TokenizerKind(StrEnum):
    hf = "hf"
    char = "char"


class Loss(StrEnum):
    default = "default"
    aipo = "aipo"
    grpo = "grpo"
    gspo = "gspo"
    cispo = "cispo"


class LrSchedule(StrEnum):
    """How the learning rate moves over a run's steps, after `algorithm.lr_warmup_steps`."""

    constant = "constant"
    linear = "linear"
    """Down in a straight line, to zero at max_steps."""
    cosine = "cosine"
    """Down along half a cosine, to zero at max_steps."""


class Schedule(StrEnum):
    """Which policy version generates each batch."""

    fixed = "fixed"
    """Batch N by exactly version max(0, N - async_level): the run is a function of its config."""
    newest = "newest"
    """Batch N by the newest version published, at least N - async_level: what generated it
    depends on how fast the trainer was."""


class Normalization(StrEnum):
    token = "token"
    sequence = "sequence"
    constant = "constant"


class Advantage(StrEnum):
    group_mean = "group_mean"
    zscore = "zscore"
    rloo = "rloo"


class KubeClient(StrEnum):
    """What applies a Kubernetes run's objects."""

    python = "python"
    """The official `kubernetes` Python client (the kubeconfig `kubectl` uses)."""
    kubectl = "kubectl"
    """`kubectl apply`, `get` and `delete` on the command line."""


class Allocation(StrEnum):
    """How a Slurm run's roles are submitted."""

    one = "one"
    """One job: every role starts when all its nodes are granted, and requeues with the rest."""
    per_role = "per_role"
    """A control, an inference and a trainer job, which wait for each other to start."""


class Placement(StrEnum):
    """How inference and trainer share a machine's devices."""

    split = "split"
    """Side by side: a GPU each (or, on one GPU, its memory split: shared), half the cores
    each on CPU; asynchronous."""
    colocated = "colocated"
    """Taking turns, each with the whole device while it runs: on-policy."""


class Action(StrEnum):
    run = "run"
    manifests = "manifests"
    status = "status"
    cancel = "cancel"
    export = "export"
    eval = "eval"


class TrainerDevice(StrEnum):
    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


class Gpu(StrEnum):
    """A GPU the planner knows the figures of (launcher/plan/gpus.py: memory, bf16 TFLOP/s, HBM and
    network bandwidth)."""

    h100 = "h100"
    h200 = "h200"
    b200 = "b200"
    a100 = "a100"
    a100_40gb = "a100_40gb"
    l40s = "l40s"
    rtx4090 = "rtx4090"


class TrainDtype(StrEnum):
    """A floating-point dtype the trainer keeps or computes in."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class WeightTransport(StrEnum):
    filesystem = "filesystem"
    broadcast = "broadcast"


class BroadcastBackend(StrEnum):
    gloo = "gloo"
    nccl = "nccl"


@dataclass
class ModelInferenceConfig:
    """How inference servers should serve this model (vLLM settings a user would set)."""

    quantization: str | None = None
    """Weight quantisation for serving, e.g. `fp8`; None serves the training dtype."""
    kv_cache_dtype: str = "auto"
    """KV-cache dtype, e.g. `fp8`; `auto` follows the model dtype."""
    max_model_len: int | None = None
    """Longest prompt + completion served; None uses the model's context length."""
    gpu_memory_utilization: float = 0.9
    """Fraction of each GPU's memory vLLM may claim."""
    pd_disaggregation: bool = False
    """Serve each replica as a prefill and a decode instance that hand over the KV cache, with
    Relay's router in front (rl/inference/router.py; large MoE models). Needs
    inference.backend=vllm."""
    kv_connector: str | None = None
    """vLLM's KV connector between prefill and decode: None is NixlConnector on GPUs and
    ExampleConnector (KV through files under the run directory) on CPU."""
    speculative_method: str | None = None
    """Speculative decoding method, e.g. `mtp` for models that ship MTP layers."""
    num_speculative_tokens: int = 0
    """Tokens proposed per speculative step (0 disables speculation)."""
    tool_call_parser: str | None = None
    """vLLM tool-call parser matching the model's chat template."""
    reasoning_parser: str | None = None
    """vLLM reasoning parser that splits thinking from the answer."""
    trust_remote_code: bool = False
    """Whether the server must run code shipped with the checkpoint."""


@dataclass
class LoraConfig:
    """LoRA: train a low-rank adapter on some of the model's Linear modules instead of every
    weight (rl/core/lora.py). Only the adapter and its optimiser state train, are checkpointed and
    travel to inference; the supervised warm-up, when the run has one, still trains the whole
    model, which becomes the base (version 0) the adapter is trained on."""

    rank: int = bounded(0, ge=0, note="0 trains every weight, no LoRA")
    """Rank of each adapted module's update (B @ A); 0 trains every weight (no LoRA)."""
    alpha: float | None = None
    """Scale numerator: the update is (alpha / rank) * B @ A; None: twice the rank."""
    dropout: float = bounded(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training."""
    target_modules: list[str] = field(default_factory=list)
    """Names of the Linear modules to adapt (e.g. `[q_proj, v_proj]`); empty: the model
    family's attention projections (rl/core/lora.py's TARGETS). Routed experts cannot be adapted."""


@dataclass
class ModelConfig:
    """A model: its architecture facts (for planning) and where its weights come from."""

    name: str = MISSING
    """Short name used in run names and logs."""
    hf_id: str | None = None
    """Hugging Face repository id of the published checkpoint (None for locally built models)."""
    path: str | None = None
    """Local checkpoint directory in HF layout; overrides `hf_id` (clusters without a hub)."""
    source: WeightSource = WeightSource.hf
    """Where weights come from: `random` (built here from this config), `gguf_package`, `hf`."""
    gguf_package: str | None = None
    """Installed Python package (import name) that ships the GGUF file (`source: gguf_package`)."""
    gguf_file: str | None = None
    """GGUF file inside `gguf_package`, converted once to an HF checkpoint in the cache."""
    architecture: str = MISSING
    """transformers architecture class, e.g. `Qwen3ForCausalLM`."""
    model_type: str = MISSING
    """transformers `model_type` of the config, e.g. `qwen3`, `qwen3_moe`, `glm_moe_dsa`."""
    num_layers: int = MISSING
    """Decoder blocks."""
    hidden_size: int = MISSING
    """Residual stream width."""
    intermediate_size: int = MISSING
    """Dense MLP width (for MoE models: the dense layers' width)."""
    num_attention_heads: int = MISSING
    """Query heads."""
    num_kv_heads: int = MISSING
    """Key/value heads (grouped-query attention)."""
    head_dim: int = MISSING
    """Width of one attention head."""
    vocab_size: int = MISSING
    """Tokenizer vocabulary size (rows of the embedding)."""
    context_length: int = MISSING
    """Longest sequence the model is trained for (max_position_embeddings)."""
    tie_word_embeddings: bool = False
    """Whether the output projection shares the input embedding."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    experts_per_token: int = 0
    """Routed experts active per token."""
    num_shared_experts: int = 0
    """Always-active shared experts per MoE layer."""
    moe_intermediate_size: int = 0
    """Width of one expert's MLP."""
    first_dense_layers: int = 0
    """Leading decoder blocks that use a dense MLP instead of MoE."""
    q_lora_rank: int = 0
    """Multi-head latent attention (MLA): rank of the query's low-rank projection; 0: queries
    projected straight from the residual stream."""
    kv_lora_rank: int = 0
    """MLA: width of the compressed key/value latent (what the KV cache holds per layer and
    token, beside the rotary key); 0: grouped-query attention (`num_kv_heads` x `head_dim`)."""
    qk_rope_head_dim: int = 0
    """MLA: rotary part of each query/key head (`head_dim` is the whole query/key head)."""
    v_head_dim: int = 0
    """MLA: width of each value head; 0: `head_dim`."""
    index_n_heads: int = 0
    """DeepSeek sparse attention: heads of the lightning indexer (0: no indexer)."""
    index_head_dim: int = 0
    """DeepSeek sparse attention: width of an indexer head (its keys are cached too)."""
    index_topk: int = 0
    """DeepSeek sparse attention: keys each query attends to (0: every earlier key)."""
    mtp_layers: int = 0
    """Multi-token-prediction blocks the checkpoint ships beside the decoder (served as the
    speculative draft, `inference.speculative_method: mtp`; not trained)."""
    warmup_steps: int = bounded(0, ge=0, note="0: none")
    """Supervised warm-up steps this model needs before RL (`warmup.steps` by default): a
    tiny model built here learns the task's format first; a pretrained model needs none."""
    hf_config: dict[str, Any] = field(default_factory=dict)
    """Further transformers config attributes for a model built here (`source: random`), such
    as GLM-5's attention ranks for a tiny instance."""
    total_params_b: float = MISSING
    """Total parameters, in billions, as published (the plan derives its own count from the
    fields above, launcher/plan/costs/memory.py, and a test holds the two together)."""
    active_params_b: float = MISSING
    """Parameters active per token, in billions, as published."""
    seed: int = bounded(0, ge=0, le=MAX_SEED)
    """Seed of the weights of a model built here (`source: random`); the run's `seed` varies
    the RL run only, so runs that differ in it start from the same model."""
    dtype: str = "bfloat16"
    """Training and checkpoint dtype."""
    lr: float = bounded(1e-6, gt=0)
    """Learning rate this model trains well with: the default of `algorithm.lr`, which is
    the one the trainer uses."""
    tokenizer: TokenizerKind = TokenizerKind.hf
    """Tokenizer kind: `hf` (shipped with the checkpoint) or `char` (built locally)."""
    inference: ModelInferenceConfig = field(default_factory=ModelInferenceConfig)
    """Serving settings for this model."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapter training (`model.lora.rank=16`); rank 0 trains the whole model."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


@dataclass
class TrainerParallelConfig:
    """Trainer DeviceMesh degrees (torchtitan's ParallelDims)."""

    nodes: int = 1
    """Nodes the trainer spans; 0 lets the planner size it from the model's memory."""
    dp_replicate: int = bounded(1, ge=1)
    """Replicated data-parallel groups (HSDP's outer dimension)."""
    dp_shard: int = bounded(-1, ge=1, also=(-1,), note="or -1 to fill")
    """FSDP shard degree; -1 takes every rank the other degrees leave."""
    ep: int = bounded(1, ge=1)
    """Expert-parallel degree; borrows ranks from dp_shard, must divide it and the expert count."""
    cp: int = bounded(1, ge=1)
    """Context-parallel degree: the sequence is split across this many ranks."""
    tp: int = 1
    """Must be 1: the trainer has no tensor parallelism, and the planner refuses other values
    (the inference servers' degree is `parallel.inference.tp`)."""


@dataclass
class InferenceParallelConfig:
    """Inference replicas and each replica's vLLM parallel degrees."""

    replicas: int = bounded(1, ge=1, also=(0,), note="or 0: sized by the plan")
    """Independent inference servers the orchestrator spreads requests over; 0: as many as
    the plan's balance of generation against training asks for (launcher/plan/costs/fit.py)."""
    nodes_per_replica: int = 1
    """Nodes one replica spans; 0 lets the planner size it from the model's weights."""
    tp: int = bounded(1, ge=1)
    """Tensor-parallel size inside a node."""
    dp: int = bounded(1, ge=1, also=(-1,), note="or -1: every GPU left")
    """Data-parallel ranks inside one replica (attention DP for MoE); -1: every GPU left."""
    expert_parallel: bool = False
    """Shard experts across the replica's GPUs instead of tensor-slicing them."""


@dataclass
class ParallelConfig:
    """How trainer and inference are laid out over devices."""

    name: str = MISSING
    """Option name."""
    trainer: TrainerParallelConfig = field(default_factory=TrainerParallelConfig)
    """Trainer degrees."""
    inference: InferenceParallelConfig = field(default_factory=InferenceParallelConfig)
    """Inference degrees."""


@dataclass
class AlgorithmConfig:
    """The RL objective: loss, advantage estimator, optimiser and off-policy budget."""

    name: str = MISSING
    """Option name."""
    loss: Loss = Loss.default
    """Loss in the registry (rl/trainer/losses.py): default, aipo, grpo, gspo, cispo."""
    normalization: Normalization = Normalization.token
    """How token losses become one number: per token over the batch, per sequence, or
    Dr.GRPO's constant (sequences x environment.max_tokens)."""
    advantage: Advantage = Advantage.group_mean
    """Advantage estimator: `group_mean` (Dr.GRPO-style, no std), `zscore`, `rloo`."""
    lr: float | None = bounded(
        II("relay_lr:${model.lr},${model.lora.rank}"), gt=0, note="default: model.lr (x10, LoRA)"
    )
    """The learning rate, the one the trainer uses: by default the model option's `lr` (the
    rate that model trains well with), ten times it with LoRA (`model.lora.rank` > 0: an
    adapter trains well at about ten times full fine-tuning's rate; on the tiny model 3e-3
    scored 0.515 against 0.435 at 1e-3); `rl --cfg job --resolve` shows the value."""
    lr_schedule: LrSchedule = LrSchedule.constant
    """The learning rate over the run's steps after the warm-up steps: `constant`, `linear`
    or `cosine` (both down to zero at max_steps; a run extended past its max_steps takes the
    new max_steps from where it resumes). On the main job a cosine with 15 rising steps ended
    below the constant rate in 4 seeds of 5 (benchmarks/RESULTS.md)."""
    lr_warmup_steps: int = bounded(0, ge=0)
    """Steps over which the learning rate rises in a straight line to `lr` (step k of n at
    lr * k / n) before `lr_schedule` takes over; 0: none. Not the supervised warm-up
    (`warmup.steps`)."""
    updates_per_batch: int = bounded(1, ge=1, le=64)
    """Optimiser steps per batch: each of the trainer's packed micro-batches is cut into this
    many runs of samples, mini-batch j takes the j-th of each, and each mini-batch is one
    step, its loss normalised over its own samples. The importance ratio of
    every step is against the policy that generated the batch, so the loss's clipping or
    masking bounds how far the later steps move; one version is published per batch. On the
    main job 2 were level with 1 at equal samples over 5 seeds, and cost 12% more time."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    adam_eps: float = bounded(1e-8, gt=0)
    """AdamW's epsilon, for the warm-up too. Adam steps every weight by about the learning rate
    whatever its gradient's size when that size is far above epsilon, so a gradient that is
    zero up to rounding moves a weight by +-lr; a larger epsilon makes each step a smooth
    function of the gradient (tests comparing layouts' weights use 1e-3)."""
    max_grad_norm: float = bounded(1.0, gt=0)
    """Gradient clipping norm."""
    prob_diff_pos: float = 0.2
    """Default loss: mask tokens with positive advantage once trainer prob exceeds inference
    prob by more than this."""
    prob_diff_neg: float = 0.2
    """Default loss: mask tokens with negative advantage once trainer prob is below inference
    prob by more than this."""
    log_ratio_coef: float = 0.001
    """Default loss: weight of the squared log-ratio term against the inference policy."""
    aipo_delta: float = 4.0
    """AIPO: the importance ratio is truncated at this value."""
    clip_low: float = 0.2
    """GRPO/PPO: the ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.28
    """GRPO/PPO: the ratio is clipped above at 1 + clip_high (DAPO's clip-higher)."""
    kl_coef: float = 0.0
    """GRPO/PPO: weight of the k3 KL to the reference model (the post-warm-up weights)."""
    seq_clip_low: float = 3e-4
    """GSPO: the sequence ratio is clipped below at 1 - seq_clip_low."""
    seq_clip_high: float = 4e-4
    """GSPO: the sequence ratio is clipped above at 1 + seq_clip_high."""
    is_max: float = 4.0
    """CISPO: the stop-gradient importance weight is clipped above at this value."""
    length_penalty: float = 0.0
    """Subtracted from a reward per completion token, as a fraction of environment.max_tokens."""
    filter_zero_advantage: bool = True
    """Drop groups whose advantages are all zero (they carry no signal) and sample new prompts."""
    carry_surplus: bool = False
    """Groups with signal drawn beyond a batch open the next one rather than being dropped:
    async_level + 1 versions behind it (within `max_off_policy_steps`). Not with async_level
    0, which stays on-policy. Off by default: on the main job it cut generation by 6% and
    scored 0.024 lower at equal samples over 16 seeds (benchmarks/RESULTS.md)."""
    async_level: int = bounded(1, ge=0)
    """Batch N is generated by policy version N - async_level (at least; see `schedule`) while
    the trainer trains the batches before it (0: on-policy)."""
    schedule: Schedule = Schedule.fixed
    """`fixed`: batch N by exactly version max(0, N - async_level), so that the same config
    and seed give the same run whatever the timing; `newest`: by the newest version the
    trainer has published by then (never older than N - async_level)."""
    max_off_policy_steps: int = bounded(8, ge=0)
    """Drop samples whose oldest generating version is further behind than this."""
    temperature: float = bounded(1.0, ge=0)
    """Sampling temperature for training rollouts."""


@dataclass
class EnvironmentConfig:
    """A task: prompts, rollout and reward."""

    name: str = MISSING
    """Environment id in the registry."""
    max_tokens: int = bounded(32, ge=1)
    """Most completion tokens sampled per turn."""
    max_context_tokens: int | None = bounded(None, ge=1)
    """Longest prompt plus completions of one sample this task produces: the length served
    (below the model's own) and the plan's KV-cache and time estimates; None: the model's
    served length."""
    group_size: int = bounded(8, ge=2, text="needs >= 2 for a baseline")
    """Completions per prompt (the group the advantage baseline is taken over)."""
    prompts_per_step: int = bounded(16, ge=1)
    """Prompts per trainer step (batch = prompts_per_step x group_size)."""
    eval_size: int = bounded(128, ge=1)
    """Held-out prompts scored at each eval."""
    eval_every: int = bounded(10, ge=0, note="0: only first and last")
    """Trainer steps between evals (plus one before RL and one at the end)."""
    seed: int = bounded(0, ge=0, le=MAX_SEED)
    """Seed of the train/eval split and prompt sampling."""
    args: dict[str, Any] = field(default_factory=dict)
    """Environment-specific settings (see the environment's module docstring)."""


@dataclass
class ClusterConfig:
    """Where the run executes: this machine, a Slurm cluster through submitit, or a
    Kubernetes cluster."""

    name: str = MISSING
    """Option name."""
    kind: str = "local"
    """Where the run's processes start (launcher/clusters/): `local` (child processes here),
    `slurm` (jobs submitted with submitit) or `kubernetes` (Indexed Jobs or a JobSet)."""
    nodes: int = 1
    """Nodes available to one run (local: 1)."""
    gpus_per_node: int | None = None
    """GPUs on each node (0: CPU-only); None: on cluster=local, the GPUs `nvidia-smi` finds
    here (0 without one), on Slurm 0."""
    gpu: Gpu | None = None
    """Which GPU the nodes have (h100, h200, b200, a100, a100_40gb, l40s, rtx4090): its memory,
    bf16 TFLOP/s, HBM and network bandwidth fill the four settings below where they are
    unset (launcher/plan/gpus.py); None: on cluster=local, the one `nvidia-smi` names."""
    gpu_memory_gb: float | None = None
    """Memory of one GPU in GiB, for the planner's fit checks (0 skips them); None: the
    `gpu`'s (as `nvidia-smi` reports it: 79.6 for an H100 80GB), what `nvidia-smi` reports
    on cluster=local, else 0."""
    gpu_memory_reserve: float = bounded(0.05, ge=0, lt=1)
    """Share of each trainer GPU's memory the plan leaves free: the caching allocator's
    fragmentation, and what the memory model does not see."""
    cpus_per_node: int = 2
    """CPU cores per node."""
    mem_gb_per_node: int = 24
    """Host memory per node."""
    partition: str | None = None
    """Slurm partition; None uses the cluster's default partition."""
    account: str | None = None
    """Slurm account."""
    qos: str | None = None
    """Slurm QOS."""
    constraint: str | None = None
    """Slurm node feature constraint."""
    time_min: int = bounded(1440, ge=1, note="minutes of wall time per job")
    """Slurm wall-time limit per job, in minutes."""
    sbatch_extra: dict[str, Any] = field(default_factory=dict)
    """Further sbatch options passed through unchanged (not to a per_role control job)."""
    allocation: Allocation = Allocation.one
    """Slurm: `one` submits every role in one job whose nodes the supervisors split by role
    (the inference replicas, the queue and orchestrator beside the first, then the trainer):
    they start when all the nodes are granted, or not at all, and requeue together;
    `per_role` submits a control, an inference and a trainer job, whose supervisors wait up
    to `timeouts.co_start_s` for each other. A sweep sharing inference is always per_role."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables every role sees (`NCCL_IB_HCA`, `UCX_NET_DEVICES`, ...): on Slurm exported in
    every job before its step, on Kubernetes in every pod's environment."""
    setup: list[str] = field(default_factory=list)
    """Slurm: shell lines each job runs before its step (`module load cuda/12.4`,
    `ulimit -l unlimited`)."""
    srun_args: list[str] = field(default_factory=list)
    """Slurm: further arguments of each job's srun (`--mpi=pmix`, `--cpu-bind=none`)."""
    container_image: str | None = None
    """Slurm with pyxis: the container image every step runs in (srun's
    `--container-image`)."""
    container_mounts: list[str] = field(default_factory=list)
    """Slurm with pyxis: `source:target` mounts of that container (srun's
    `--container-mounts`); the run directory's filesystem must be among them."""
    network_interface: str | None = None
    """The network interface NCCL's and gloo's sockets use on every node
    (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME); None: their own choice."""
    python: str | None = None
    """Slurm: the Python interpreter the jobs run, as the compute nodes see it; None: the one
    running `rl` (the project's environment), which a one-task step on a compute node must be
    able to run before anything is submitted."""
    wckey: str | None = None
    """Slurm: the jobs' wckey (none unless set)."""
    cpu_account: str | None = None
    """Slurm: the account of a per_role control job (no GPUs); None: `account`."""
    cpu_qos: str | None = None
    """Slurm: the QOS of a per_role control job; None: none."""
    master_port: int | None = bounded(None, ge=1, le=MAX_PORT, text=f"must be 1 to {MAX_PORT}")
    """torch.distributed rendezvous port on the first trainer node; None: 29500 locally and on
    Kubernetes (each pod has a network of its own), on Slurm a port the first trainer node
    finds free, so runs sharing a node do not collide."""
    omp_threads: int | None = None
    """Threads per role process on CPU-only nodes; None: every CPU of the node on Slurm (each
    role group has nodes of its own), half of them locally (trainer and inference share)."""
    exclusive: bool = False
    """Slurm: ask for whole nodes (`--exclusive`) for jobs that use part of a node's GPUs too
    (jobs on whole GPU nodes always do)."""
    signal_delay_s: int | None = bounded(None, ge=0)
    """Slurm: seconds before the time limit at which a job is told to checkpoint and requeue;
    None: the plan's estimate of a step and a checkpoint, with a margin
    (launcher/plan/costs/step_time.py)."""
    cpu_partition: str | None = None
    """Slurm partition of the control job (queue and orchestrator, no GPUs); None: `partition`."""
    gpu_tflops: float | None = bounded(None, gt=0)
    """Dense bf16 peak of one GPU, TFLOP/s, for the plan's time estimates; None: the `gpu`'s
    (989 for an H100 SXM)."""
    gpu_bandwidth_gbs: float | None = bounded(None, gt=0)
    """Memory bandwidth of one GPU, GB/s, for the plan's decode estimate; None: the `gpu`'s
    (3350 for an H100 SXM)."""
    link_gbs: float | None = bounded(None, gt=0)
    """Network bandwidth per GPU between nodes, GB/s, for the weight-sync estimates; None: the
    `gpu`'s usual fabric (50: one 400 Gb/s NIC per H100)."""
    storage_gbs: float = bounded(20.0, gt=0)
    """Shared filesystem bandwidth, all nodes together, GB/s: checkpoints and published
    weights (the plan's estimates and the signal delay)."""
    max_requeues: int | None = bounded(None, ge=0)
    """Slurm: how often a job that reached its time limit is requeued (preemptions always
    are); None: no limit, as each requeue resumes from the checkpoint it wrote."""
    image: str | None = None
    """Kubernetes: the container image every pod runs, with Relay installed and on PATH
    (launcher/clusters/kubernetes/Dockerfile builds one)."""
    volume_claim: str | None = None
    """Kubernetes: the ReadWriteMany PersistentVolumeClaim holding the run directories,
    mounted at `mount_path` in every pod."""
    mount_path: str = "/relay"
    """Kubernetes: where each pod mounts `volume_claim`; a run's directory is a folder of it."""
    namespace: str = "default"
    """Kubernetes: the namespace the run's objects are created in."""
    queue: str | None = None
    """Kubernetes: the Kueue LocalQueue admitting the run (its `kueue.x-k8s.io/queue-name`
    label; the objects are created suspended, and Kueue starts them whole or not at all)."""
    jobset: bool = False
    """Kubernetes: the run's Jobs as one JobSet (jobset.x-k8s.io), admitted and restarted as
    one, instead of an Indexed Job and a headless Service per job."""
    rdma_resource: str | None = None
    """Kubernetes: the extended resource of a node's RDMA or SR-IOV devices each pod asks for
    (`rdma/rdma_shared_device_a`, `nvidia.com/hostdev`); it also gets IPC_LOCK."""
    rdma_per_node: int = bounded(1, ge=1)
    """Kubernetes: how many of `rdma_resource` each pod asks for."""
    networks: list[str] = field(default_factory=list)
    """Kubernetes: Multus network attachments each pod joins (its
    `k8s.v1.cni.cncf.io/networks` annotation)."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Kubernetes: labels a node must have to run the run's pods."""
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    """Kubernetes: the pods' tolerations, as the API writes them (`{key: nvidia.com/gpu,
    operator: Exists, effect: NoSchedule}`)."""
    priority_class: str | None = None
    """Kubernetes: the pods' PriorityClass (who preempts whom)."""
    secrets: dict[str, str] = field(default_factory=dict)
    """Kubernetes: variables each pod reads from a Secret, as `NAME: <secret>/<key>`
    (`WANDB_API_KEY: wandb/api-key`), so that no key is written in the objects."""
    client: KubeClient = KubeClient.python
    """Kubernetes: what applies, lists and deletes the run's objects: the `kubernetes` Python
    client or `kubectl`."""


@dataclass
class InferenceConfig:
    """The inference role."""

    backend: str | None = None
    """The inference engine (rl/inference/engines.py): `embedded` (transformers, CPU or one
    GPU) or `vllm`; None: vllm where the cluster has GPUs, embedded on CPU."""
    max_batch_size: int = bounded(512, ge=1)
    """Most sequences the embedded engine decodes together."""
    api_rows_per_key: int = bounded(512, ge=1)
    """Most rows (prompts x n) one API key may have queued or decoding on a server at once: a
    request past it is answered 429 with Retry-After, one larger than it alone 400. The run's
    own rollouts (the orchestrator's key) are not counted (rl/inference/openai_api.py)."""
    api_share: float = bounded(0.15, gt=0, le=1)
    """Most share of the embedded engine's time API clients' requests take while the run
    generates: after each of their steps the engine rests, running only the run's rollouts,
    (1 - share) / share times as long (rl/inference/engine.py); 1: no rest. On CPU the
    trainer and the orchestrator need the cores API clients would take. vLLM schedules itself."""
    vllm_python: str | None = None
    """Python interpreter with vLLM installed (vLLM pins its own torch, so it often lives in
    a separate environment); None uses the interpreter running Relay."""
    port: int = bounded(0, ge=0, le=MAX_PORT, text=f"must be 0 (any free) to {MAX_PORT}")
    """Port to listen on; 0 picks a free one and records it in the run directory."""
    weight_transport: WeightTransport | None = None
    """How new weights reach inference: `filesystem` (the trainer writes `weights/step_N`, the
    orchestrator has every server load it) or `broadcast` (trainer rank 0 sends them to every
    inference worker over a process group of their own, no disk; `weights/step_N` is then
    written only for version 0, checkpointed versions and the last one). None: broadcast
    where a Slurm run's trainer and inference have GPUs of their own (no LoRA, no shared
    inference), the filesystem otherwise (rl/core/derive.py)."""
    broadcast_backend: BroadcastBackend | None = None
    """Process-group backend of `broadcast`: `nccl` (GPUs on both ends) or `gloo`; None: nccl
    where the cluster has GPUs and the trainer sees CUDA, gloo otherwise."""
    max_lora_rank: int | None = None
    """Largest adapter rank the servers accept (vLLM's `--max-lora-rank`); None: the run's
    `model.lora.rank`. A run whose rank is above it is refused at plan time."""
    max_loras: int | None = bounded(None, ge=1)
    """Adapters a server holds at once (vLLM's `--max-loras`); None: 1, or in a sweep with
    `shared` inference one per sweep point. A shared sweep with more points is refused."""
    shared: bool = False
    """In a multirun of LoRA runs (`rl -m ...`): one inference service for the whole sweep,
    holding each point's adapter under the point's name, with every point's queue,
    orchestrator and trainer running side by side (docs/lora.md)."""
    broadcast_timeout_s: float = bounded(300.0, gt=0, text=SECONDS)
    """Seconds a broadcast waits for an inference server (to join the group, to take the
    weights, to report the new version) before the trainer fails naming it."""


@dataclass
class QueueConfig:
    """The rollout queue between orchestrator and trainer."""

    capacity: int = 1024
    """Most groups waiting to be trained; a full queue answers 429 and producers wait."""
    max_request_mb: int = bounded(64, ge=1)
    """Largest request body accepted."""
    batches_ahead: int = bounded(1, ge=1)
    """How far past the next batch a push may number its batch: the orchestrator pushes its
    batches in order, so one; a push further ahead is refused (422), never stored to make
    the real batch a duplicate. Producers pushing concurrently need one each."""
    port: int = bounded(0, ge=0, le=MAX_PORT, text=f"must be 0 (any free) to {MAX_PORT}")
    """Port to listen on; 0 picks a free one and records it in the run directory."""


@dataclass
class WarmupConfig:
    """Supervised warm-up (SFT) run by the trainer before RL."""

    steps: int = bounded(II("model.warmup_steps"), ge=0, note="0 skips the warm-up")
    """SFT optimiser steps (0 skips the warm-up); by default the model option's
    `warmup_steps`."""
    lr: float = bounded(1e-3, gt=0)
    """SFT learning rate."""
    batch_size: int = bounded(64, ge=1)
    """Examples per SFT step."""
    chat_share: float = bounded(0.0, ge=0, le=1, note="0: raw prompts only")
    """Share of each SFT step's examples given as a chat (the prompt as the user's message, the
    answer as the assistant's turn, in the model's chat template), so that a model that knows
    no chat format (the tiny one) also answers on the OpenAI chat route; the rest are raw
    prompts, as RL sends them. Off by default: it costs the reverse-text job most of its final
    held-out exact match (docs/agents.md)."""
    seed: int = bounded(0, ge=0, le=MAX_SEED)
    """Seed of the warm-up's draws of examples (and any dropout in it); the run's `seed` varies
    the RL run only, so runs that differ in it warm up the same base."""


@dataclass
class TrainerConfig:
    """The trainer role."""

    micro_batch_tokens: int = bounded(DEFAULT_MICRO_BATCH_TOKENS, ge=1)
    """Most tokens (prompt + completion) per forward/backward pass; the queue packs samples into
    micro-batches under this budget and gradients are accumulated across them."""
    checkpoint_every: int = bounded(50, ge=0, note="0: only at the end")
    """Steps between checkpoints (0: only at the end). A trainer that starts and finds a
    checkpoint in the run directory resumes from the newest one; a preempted Slurm job also
    checkpoints at the step it was stopped at."""
    keep_weights: int = bounded(3, ge=1)
    """Published weight versions kept on disk (older ones are deleted)."""
    keep_checkpoints: int = bounded(2, ge=1)
    """Trainer checkpoints kept on disk: the newest this many, and those of
    `keep_checkpoint_steps`; an older one is deleted once a newer one is complete."""
    keep_checkpoint_steps: list[int] = field(default_factory=list)
    """Steps whose checkpoints are kept whatever `keep_checkpoints` says, to branch from or
    export later (`rl action=export step=N`)."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in the backward pass (less memory, ~1/3 more
    compute)."""
    lm_head_chunk: int = bounded(0, ge=0, note="0: the whole micro-batch's logits at once")
    """Tokens per chunk of the LM head: the loss's log-probabilities computed a chunk at a
    time, each chunk's logits recomputed in the backward pass, so that no pass holds a whole
    sequence's logits (rl/trainer/head.py; the plan turns it on for long samples)."""
    activation_offload: bool = False
    """With activation checkpointing: keep each decoder block's input, all that is saved of it
    for the backward pass, in host memory, copied back when the block is recomputed (the plan
    turns it on when a long sample's block inputs do not fit the GPU)."""
    cpu_offload: bool = False
    """FSDP: keep sharded parameters, gradients and optimiser state in host memory (the plan
    turns it on when the GPUs cannot hold them)."""
    stop_checkpoint_optimizer: bool = True
    """Whether the checkpoint taken when Slurm stops the job (preemption, time limit) holds
    AdamW's moments; false: weights and step only, a third of the bytes, and the resumed
    run restarts the moments from zero."""
    packing: bool = True
    """Pack a micro-batch's samples into rows as long as its longest sample, with attention
    kept inside each sample (rl/trainer/packing.py); False pads one sample per row."""
    share_prompts: bool = True
    """With packing (and no CP): samples of a micro-batch with the same prompt (a group) share
    one copy of it in their row, so it is computed once instead of once per sample."""
    device: TrainerDevice = TrainerDevice.auto
    """Where each rank computes: `auto` (its GPU when the cluster has GPUs and torch sees them,
    else the CPU), `cuda` or `cpu` (gloo collectives)."""
    master_dtype: TrainDtype = TrainDtype.float32
    """Dtype of the weights the optimizer updates, their gradients and AdamW's moments (the
    master copy, a LoRA run's base included). float32: an update of lr 1e-6 on a weight of
    1e-2 is below half a bfloat16 rounding step, so a bfloat16 master copy would drop it."""
    compute_dtype: TrainDtype | None = None
    """Dtype forward and backward run in (FSDP2 gathers the weights in it; one process runs
    under autocast); None: `model.dtype`. Published versions are in `model.dtype` whatever
    this is."""
    reduce_dtype: TrainDtype = TrainDtype.float32
    """Dtype gradients are summed across ranks in."""


@dataclass
class TimeoutsConfig:
    """Deadlines: no wait in Relay is unbounded. When one passes, the waiting role fails with an
    error naming what it waited for, and the launcher restarts it (within `max_restarts`)."""

    request_s: float = bounded(600.0, gt=0, text=SECONDS)
    """One HTTP request from a role to another (a batch of completions included)."""
    peer_s: float = bounded(900.0, gt=0, text=SECONDS)
    """A role waits this long for a peer's server to answer again (restarted, or starting)."""
    batch_s: float = bounded(3600.0, gt=0, text=SECONDS)
    """The trainer waits this long for a step's batch from the queue."""
    weights_s: float = bounded(3600.0, gt=0, text=SECONDS)
    """The orchestrator waits this long for the trainer to publish a weights version."""
    collective_s: float = bounded(1800.0, gt=0, text=SECONDS)
    """torch.distributed rendezvous and collectives between trainer ranks."""
    ready_s: float = bounded(900.0, gt=0, text=SECONDS)
    """The launcher waits this long for every server to listen after starting it."""
    interrupt_s: float = bounded(300.0, gt=0, text=SECONDS)
    """After Ctrl-C, the local launcher waits this long for the trainer to checkpoint the step
    under way before it stops every role (a second Ctrl-C stops them at once)."""
    co_start_s: float = bounded(600.0, gt=0, text=SECONDS)
    """Slurm with `cluster.allocation=per_role`: how long the run's jobs wait for each other
    to start; past it the run is cancelled, naming the job that did not start and why."""
    hung_s: float = bounded(120.0, ge=1, note="seconds")
    """A role that shows no sign of life this long is hung: its process group is killed and the
    role restarted. Each role beats from a thread (a server only while its own /health
    answers); a stopped or frozen process stops beating."""


@dataclass
class EvalConfig:
    """How each held-out evaluation samples (`environment.eval_size` prompts every
    `environment.eval_every` versions)."""

    samples: int = bounded(1, ge=1, le=64)
    """Completions per held-out prompt. Above 1 (with a temperature above 0) the eval also
    records pass@k, the share of prompts with at least one exact answer among the k
    (`eval/pass_at_k`); `eval/exact_match` is then mean@k, the share of exact answers."""
    temperature: float = bounded(0.0, ge=0)
    """Sampling temperature of the eval; 0: greedy, one answer per prompt."""
    environments: list[Any] = field(default_factory=list)
    """More held-out sets, evaluated at every eval beside the run's own: a list of
    `{option: <environment option>, args: {...}, eval_size: N}` (single-turn options of
    conf/environment/, built with the run's seed; eval_size defaults to the option's), each
    logged as `eval/<option>/exact_match` and `eval/<option>/reward/mean`."""


@dataclass
class ConsoleConfig:
    """What the console prints while a run goes on (metrics.jsonl and wandb keep everything)."""

    fields: list[str] = field(default_factory=lambda: list(STEP_FIELDS))
    """A step line's fields, of reward, loss, signal (share of the first round's groups with
    signal), clipped (share of tokens the loss clipped or masked), throughput, times (gen,
    train, sync), staleness and eta; e.g. `console.fields=[reward,eta]` for a short line. The
    warnings that a run is not learning are printed whatever it holds."""


SWEEP_METRICS = (
    "eval/exact_match/last",
    "eval/reward/last",
    "reward/last",
    "throughput/tokens_per_s/mean",
)
"""What a sweep's verdict may rank groups by: keys of each point's summary.json, higher better."""


@dataclass
class SweepConfig:
    """How a sweep's points are compared in its sweep_summary.md."""

    metric: str = SWEEP_METRICS[0]
    """The summary.json key the verdict ranks groups of seeds by, with Welch's t-test over
    the seeds: eval/exact_match/last (the held-out eval of the last version, the default),
    eval/reward/last, reward/last (the training reward of the last 10 steps), or
    throughput/tokens_per_s/mean."""


@dataclass
class WandbConfig:
    """Weights & Biases logging."""

    project: str = "relay"
    """wandb project."""
    mode: str | None = None
    """`online`, `offline` or `disabled`; None: online with an API key, else offline."""
    group: str | None = None
    """Run group (a sweep sets it)."""
    flush_s: float = 2.0
    """Seconds between writes of the wandb run's file in the run directory: what a watcher
    sees live, and the most a crash can lose."""


@dataclass
class RunConfig:
    """A whole run: five groups plus the run-level keys."""

    model: ModelConfig = MISSING
    """Group `model`: architecture facts and weight source."""
    parallel: ParallelConfig = MISSING
    """Group `parallel`: trainer mesh degrees and inference layout."""
    algorithm: AlgorithmConfig = MISSING
    """Group `algorithm`: loss, advantages, optimiser, staleness budget."""
    environment: EnvironmentConfig = MISSING
    """Group `environment`: the task."""
    cluster: ClusterConfig = MISSING
    """Group `cluster`: this machine or Slurm."""
    name: str = "${relay_env_id:${environment}}-${model.name}"
    """Run name (the run directory and wandb run are named after it)."""
    seed: int = bounded(0, ge=0, le=MAX_SEED)
    """Seed of the RL run: the prompts each batch draws, every sample, a LoRA adapter's start.
    The base model and its warm-up have seeds of their own (`model.seed`, `warmup.seed`)."""
    placement: Placement = Placement.split
    """`split`: inference and trainer side by side, asynchronously (one GPU is shared, its
    memory split); `colocated` (group `placement`): they take turns, each with the whole device
    (every core on CPU; on GPU vLLM sleeps while the trainer runs), on-policy by
    construction."""
    max_steps: int = bounded(20, ge=0, note="0: no RL step, version 0 is evaluated")
    """RL trainer steps; 0: none, the run evaluates version 0 (the model after its warm-up)
    and ends (how `action=eval` evaluates a checkpoint)."""
    dry_run: bool = False
    """Print the plan and exit without starting or submitting anything."""
    action: Action = Action.run
    """`run` starts (locally) or submits (Slurm) the run; `status` shows the jobs and latest
    step of a run; `cancel` cancels a Slurm run's jobs and records why; `export` writes the
    run's newest published version (or `step`'s version or checkpoint) as full HF weights (a
    LoRA adapter merged into its base)."""
    run_dir: str | None = None
    """For action=status/cancel/export/eval: the run directory; None: the newest run."""
    force: bool = False
    """For action=cancel: cancel at once, without first asking the trainer to checkpoint the
    step under way."""
    step: int | None = bounded(None, ge=0)
    """For action=export/eval: the step to export or evaluate, a published version or a kept
    checkpoint (its float32 master weights written in the model's dtype); None: the newest
    published version."""
    resume: str | None = None
    """Continue the interrupted run in this directory, with the config it was started with."""
    max_restarts: int = bounded(3, ge=0, note="0 stops the run at the first death")
    """Times each role is restarted after it dies (the queue from its store, the orchestrator
    from the queue, the trainer from its checkpoint, inference with the newest weights) before
    the run stops with an error naming it; 0 stops the run at the first death."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """Inference role settings."""
    queue: QueueConfig = field(default_factory=QueueConfig)
    """Rollout queue settings."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """Supervised warm-up before RL."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Trainer role settings."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Experiment tracking."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """How held-out evaluations sample."""
    console: ConsoleConfig = field(default_factory=ConsoleConfig)
    """What the console shows of each step."""
    sweep: SweepConfig = field(default_factory=SweepConfig)
    """How a sweep's points are compared."""
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    """Deadlines of every wait."""


def environment_id(environment: Any) -> str:
    """What a run is named after: the environment's own id where it has one (a verifiers
    environment's `args.id`), else the environment's name."""
    args = environment.get("args") or {}
    found = args.get("id") if hasattr(args, "get") else None
    return str(found) if found else str(environment.name)


def dirname(text: str) -> str:
    """`text` fit to be one directory's name (a sweep point's overrides)."""
    safe = "".join(c if c.isalnum() or c in "=,.-_+" else "_" for c in text)
    return safe[:200] or "defaults"


LORA_LR_SCALE = 10.0
"""The default learning rate with LoRA, as a multiple of the model's (`algorithm.lr`)."""


def default_lr(lr: float, lora_rank: int) -> float:
    """`algorithm.lr` where it is not given: the model's, LORA_LR_SCALE times it with LoRA."""
    scaled = float(lr) * (LORA_LR_SCALE if int(lora_rank) > 0 else 1.0)
    return float(f"{scaled:.12g}")  # 3e-3, not 0.0029999999999999996


# The schema's own defaults use these (`name`), so they are registered wherever it is loaded.
OmegaConf.register_new_resolver("relay_env_id", environment_id, replace=True)
OmegaConf.register_new_resolver("relay_dirname", dirname, replace=True)
OmegaConf.register_new_resolver("relay_lr", default_lr, replace=True)


def register() -> None:
    """Register the schema in Hydra's ConfigStore under the name conf/config.yaml extends."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="relay_schema", node=RunConfig)


# Each role's entry point (`python -m <module> --run-dir ...`).
ROLE_MODULES = {
    "queue": "rl.queue",
    "inference": "rl.inference",
    "router": "rl.inference.router",  # a prefill/decode replica's front (pd_disaggregation)
    "orchestrator": "rl.orchestrator",
    "trainer": "rl.trainer",
}
TORCHRUN_MODULE = "rl.trainer.torchrun"
"""torchrun as the trainer role runs it: its ranks in the role's process group."""


class InvalidConfig(ValueError):
    """A setting the schema's rules refuse, phrased `key=value: why` for the user."""


def check_config(cfg: Any) -> None:
    """The rules every run config obeys, whoever loads it: each setting within the bounds its
    field carries, and no two settings that cannot go together. The launcher refuses a run
    that breaks one before anything starts (launcher/plan/checks.py); each role checks again
    as it loads the run's config (rl/core/runtime.py's `load_run_config`), so a config.yaml
    edited by hand fails at once, naming the setting."""
    check_bounds(cfg)
    check_relations(cfg)


def check_bounds(cfg: Any) -> None:
    """InvalidConfig for the first setting outside the bounds its schema field carries."""
    for key, bounds in bounded_settings():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if value is not None and not bounds.admits(value):
            raise InvalidConfig(f"{key}={value}: {bounds.describe()}")


def check_relations(cfg: Any) -> None:
    """InvalidConfig for the first pair of settings, each valid alone, that cannot go
    together."""
    env, algo = cfg.environment, cfg.algorithm

    def refuse(key: str, why: str) -> None:
        raise InvalidConfig(f"{key}: {why}")

    if cfg.trainer.activation_offload and not cfg.trainer.activation_checkpointing:
        raise InvalidConfig(
            "trainer.activation_offload=true keeps the inputs of checkpointed blocks on the "
            "host; set trainer.activation_checkpointing=true too"
        )
    if cfg.queue.capacity < env.prompts_per_step:
        refuse(
            f"queue.capacity={cfg.queue.capacity}",
            f"must hold at least one step's environment.prompts_per_step={env.prompts_per_step} "
            "groups",
        )
    if cfg.placement == Placement.colocated and algo.async_level:
        refuse(
            f"algorithm.async_level={algo.async_level}",
            "placement=colocated takes turns: each batch is generated by the policy the "
            "trainer just published, so it is on-policy (async_level=0); for asynchronous "
            "training leave placement=split",
        )
    if algo.max_off_policy_steps < algo.async_level:
        refuse(
            f"algorithm.async_level={algo.async_level}",
            f"must be >= 0 and <= algorithm.max_off_policy_steps={algo.max_off_policy_steps}",
        )
    if algo.temperature == 0:
        refuse(
            "algorithm.temperature=0",
            f"greedy sampling gives the {env.group_size} samples of a group one answer, so "
            f"every group ties and has no advantage against its baseline "
            f"(algorithm.advantage={algo.advantage}): nothing is learned; use a temperature "
            "above 0 (default 1.0; evaluation is greedy anyway)",
        )
    if cfg.eval.samples > 1 and cfg.eval.temperature == 0:
        refuse(
            f"eval.samples={cfg.eval.samples}",
            "greedy evaluation (eval.temperature=0) gives one answer however many samples; "
            "set eval.temperature above 0 (1.0 samples as training does)",
        )
    if unknown := [f for f in cfg.console.fields if f not in STEP_FIELDS]:
        refuse(f"console.fields={list(cfg.console.fields)}",
               f"{', '.join(unknown)} unknown; valid: {', '.join(STEP_FIELDS)}")  # fmt: skip
    if cfg.sweep.metric not in SWEEP_METRICS:
        refuse(f"sweep.metric={cfg.sweep.metric}", f"valid: {', '.join(SWEEP_METRICS)}")
    if cfg.max_steps and algo.lr_warmup_steps >= cfg.max_steps:
        refuse(
            f"algorithm.lr_warmup_steps={algo.lr_warmup_steps}",
            f"the learning rate would never reach algorithm.lr within max_steps={cfg.max_steps}; "
            "use fewer warm-up steps",
        )


def bounded_settings(schema: type = RunConfig, prefix: str = "") -> Iterator[tuple[str, Bounds]]:
    """Every setting of the schema that carries `Bounds`, by its dotted key."""
    for f in fields(schema):
        if "bounds" in f.metadata:
            yield f"{prefix}{f.name}", f.metadata["bounds"]
        nested = _schema_class(f)
        if nested is not None:
            yield from bounded_settings(nested, f"{prefix}{f.name}.")


def _schema_class(f: Any) -> type | None:
    """The dataclass a field holds, if it holds one (a group or a nested section)."""
    hint = f.type if isinstance(f.type, type) else globals().get(str(f.type))
    return hint if hint is not None and is_dataclass(hint) else None
