"""Every refusal a run gets before anything is sized or started, each one line that names the
key and the fix (launcher/plan/planner.py calls `check_run` first):

- each setting within its range: the bounds its field carries in the schema (rl/core/config.py);
- settings that contradict each other: a checkpoint warning after the time limit, a queue
  smaller than a step, colocated placement with staleness or with broadcast weights, expert
  parallelism on a dense model, context parallelism on sequences too short to split, LoRA
  targets and ranks the servers cannot take, a shared-inference sweep point that cannot share;
- an environment that does not exist, or an agent that cannot be loaded;
- a model whose weights are not built or shipped here needs `model.path` (there is no model
  hub): refused before a run starts; the plan (and so a dry run) says so in a note;
- a cluster without GPUs runs only models whose training state and weights fit the node's host
  memory, no trainer on CUDA, and FP8 served only by vLLM (its CPU build serves FP8 block
  checkpoints; the embedded engine serves the training dtype);
- what this machine cannot do (`check_this_machine`, for a dry run too): wandb online without
  an API key; on cluster=local, GPUs that nvidia-smi does not find and a vLLM backend whose
  python cannot import vLLM (a dry run plans them as declared and says so in a note);
- an FP8 MoE whose experts, split by tensor parallelism, no longer cover whole FP8 blocks
  (MiniMax-M2's 1536-wide experts over TP8 are 192 wide, not a multiple of 128) is served with
  expert parallelism, which keeps each expert whole.

What depends on the run's size (nodes, GPUs, memory) is refused in launcher/plan/costs/fit.py. A run
directory on a filesystem with less free space than the run's checkpoints and weights need
is warned of (`disk_warning`), not refused: the estimate is rough, and space may be freed.
"""

from __future__ import annotations

import netrc
import os
import urllib.parse
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.clusters.base import cluster_of
from launcher.errors import PlanError, refuse
from launcher.plan.costs.fit import MIN_TOKENS_PER_CP_RANK, disk_need
from launcher.plan.costs.memory import DTYPE_BYTES, TRAINER_STATE_COPIES, params
from rl.core import config, lora
from rl.core.config import (
    BroadcastBackend,
    InvalidConfig,
    Placement,
    WeightTransport,
)
from rl.core.derive import max_model_len, precision, weight_transport
from rl.core.disk import free_bytes, size
from rl.envs import locate as locate_environment
from rl.inference.engines import engine_of

FP8_BLOCK = 128  # the width of an FP8 weight block (128 x 128) in the shipped FP8 checkpoints
LOCAL_SOURCES = ("random", "gguf_package")  # built here, or shipped inside a Python package


TURN_SAMPLE = 16
"""Held-out openings a multi-turn environment's length is checked on (`check_turns`)."""


def check_run(cfg: DictConfig) -> list[str]:
    """Refuse what cannot work whatever the cluster holds; returns the plan's notes (what a
    LoRA run adapts, weights still missing). `cluster.gpus_per_node` must be filled in."""
    check_relations(cfg)
    check_environment(cfg)
    check_turns(cfg)
    check_model_fit(cfg)
    check_cpu_fit(cfg)
    check_expert_split(cfg)
    adapter = check_lora(cfg)
    check_shared_inference(cfg)
    check_weight_transport(cfg)
    notes = [adapter] if adapter else []
    if not cluster_of(cfg).sees_files:  # the pods read model.path on their cluster
        return notes
    if missing := weights_missing(cfg):
        notes.append(f"{missing} (the run itself is refused until then)")
    return notes


def check_bounds(cfg: Any) -> None:
    """PlanError for the first setting outside the bounds its schema field carries."""
    try:
        config.check_bounds(cfg)
    except InvalidConfig as err:
        raise PlanError(str(err)) from None


def check_relations(cfg: DictConfig) -> None:
    """Settings each valid alone that cannot go together: the schema's rules
    (rl/core/config.py's `check_relations`, which the roles check too), then those that
    depend on the cluster or the engine."""
    try:
        config.check_relations(cfg)
    except InvalidConfig as err:
        raise PlanError(str(err)) from None
    cluster, env = cfg.cluster, cfg.environment
    delay = cluster.signal_delay_s
    limit = cluster_of(cfg).time_limit_s()
    if limit is not None and delay is not None and delay >= limit:
        raise PlanError(
            f"cluster.signal_delay_s={cluster.signal_delay_s}: the checkpoint warning must come "
            f"before the time limit, below cluster.time_min={cluster.time_min} x 60 s"
        )
    if engine_of(cfg).bounded_batch and env.group_size > cfg.inference.max_batch_size:
        raise PlanError(
            f"environment.group_size={env.group_size}: one prompt's group must fit in "
            f"inference.max_batch_size={cfg.inference.max_batch_size} sequences"
        )
    colocated = cfg.placement == Placement.colocated
    if colocated and cluster.gpus_per_node and weight_transport(cfg) != WeightTransport.filesystem:
        refuse(
            f"inference.weight_transport={weight_transport(cfg)}",
            "placement=colocated on GPU loads each version from weights/ after waking "
            "inference; use inference.weight_transport=filesystem",
        )


def check_environment(cfg: DictConfig) -> None:
    """The environment is built in or an installed package's; an agent must load now."""
    try:
        locate_environment(cfg.environment.name)
        if cfg.environment.name == "agent":  # the agent is the user's code: load it now
            from rl.orchestrator.agents import check_config

            check_config(cfg.environment)
        if cfg.environment.name in ("dataset", "mix"):  # its file, functions or members load
            from rl.envs import make_environment

            make_environment(cfg.environment)
        if cfg.eval.environments:  # each option there and single-turn
            from rl.envs.mix import eval_environments

            eval_environments(list(cfg.eval.environments), cfg.environment)
        if cfg.environment.name == "verifiers":  # installed, or the run fails once started
            from rl.envs.verifiers_env import check_installed, parse_args

            args = OmegaConf.to_container(cfg.environment.args, resolve=True)
            check_installed(parse_args(args).id)  # type: ignore[arg-type]
    except ValueError as err:
        raise PlanError(str(err)) from None


def absolute_paths(cfg: DictConfig) -> None:
    """environment=dataset's file and reward files as absolute paths, so that every role
    (started elsewhere, on Slurm on another node) reads the ones the command named."""
    if cfg.environment.name != "dataset":
        return
    args = cfg.environment.args
    if args.get("path"):
        args.path = str(Path(args.path).expanduser().absolute())
    rewards = []
    for spec in args.get("rewards") or []:
        where, _, name = str(spec).rpartition(":")
        rewards.append(f"{Path(where).absolute()}:{name}" if where.endswith(".py") else spec)
    args.rewards = rewards


def check_turns(cfg: DictConfig) -> None:
    """A multi-turn environment (`environment.args.max_turns` > 1) whose served length cannot
    hold its opening, a model turn, its reply and a second model turn ends every episode
    after the first turn, and learns nothing of the later ones: refused, naming the length
    two turns need. Measured with the model's tokenizer on the longest of the environment's
    first held-out openings, where that tokenizer is at hand (a model built here or at
    model.path): the orchestrator's own opening and reply tokens."""
    args, model = cfg.environment.args, cfg.model
    if not (args and int(args.get("max_turns") or 0) > 1):
        return
    if not model.path and str(model.source) != "random":
        return
    from rl.core.derive import max_model_len
    from rl.core.model import ensure_checkpoint, load_tokenizer
    from rl.envs import Environment, make_environment
    from rl.orchestrator.episodes import opening

    env = make_environment(cfg.environment)
    if type(env).respond is Environment.respond:  # an environment that plays itself
        return
    tokenizer = load_tokenizer(ensure_checkpoint(model))
    env.use_tokenizer(tokenizer)
    examples = env.eval_examples()[:TURN_SAMPLE]
    turn = cfg.environment.max_tokens
    need = max(
        len(opening(env, tokenizer, e))
        + turn
        + len(tokenizer(env.respond(e, [""]) or "", add_special_tokens=False)["input_ids"])
        + turn
        for e in examples
    )
    served = max_model_len(cfg)  # type: ignore[arg-type]
    if need > served:
        refuse(
            f"environment={cfg.environment.name}",
            f"{env.max_turns} turns an episode, but the served length {served} cannot hold "
            f"two: its opening, a turn of environment.max_tokens={turn}, its reply and a "
            f"second turn need {need} tokens, so every episode would end after one; raise "
            f"model.inference.max_model_len to at least {need}",
        )


def check_model_fit(cfg: DictConfig) -> None:
    model, par, env = cfg.model, cfg.parallel, cfg.environment
    if not model.num_experts:
        for key, value in (
            ("parallel.trainer.ep", par.trainer.ep > 1),
            ("parallel.inference.expert_parallel", par.inference.expert_parallel),
        ):
            if value:
                refuse(
                    f"{key}={par.trainer.ep if 'ep' in key else 'true'}",
                    f"expert parallelism needs an MoE model; model={model.name} is dense "
                    f"(choose parallel=single, fsdp, hsdp, cp2, tp or dp)",
                )
    elif model.num_experts % par.trainer.ep:
        refuse(
            f"parallel.trainer.ep={par.trainer.ep}",
            f"must divide model={model.name}'s {model.num_experts} experts",
        )
    if par.trainer.cp > 1 and model.index_n_heads:
        refuse(
            f"parallel.trainer.cp={par.trainer.cp}",
            f"model={model.name}'s DeepSeek sparse attention picks each query's keys with an "
            f"indexer over every earlier key, which context parallelism does not split (each "
            f"rank would see its own keys only); use cp=1",
        )
    if par.trainer.cp > 1 and env.max_tokens < par.trainer.cp * MIN_TOKENS_PER_CP_RANK:
        refuse(
            f"parallel.trainer.cp={par.trainer.cp}",
            f"environment.max_tokens={env.max_tokens} is too short to split: context "
            f"parallelism needs >= {MIN_TOKENS_PER_CP_RANK} tokens per rank "
            f"(max_tokens >= {par.trainer.cp * MIN_TOKENS_PER_CP_RANK}) or cp=1",
        )
    max_len = max_model_len(cfg)
    if env.max_tokens >= max_len:
        refuse(
            f"environment.max_tokens={env.max_tokens}",
            f"must be below model={model.name}'s served length {max_len}",
        )


def check_cpu_fit(cfg: DictConfig) -> None:
    """On a cluster without GPUs: the model must fit the node's memory, and FP8 is vLLM's."""
    cluster, model = cfg.cluster, cfg.model
    if cluster.gpus_per_node:
        return
    if cfg.trainer.device == "cuda":
        raise PlanError(
            f"trainer.device=cuda: cluster={cluster.name} has no GPUs (cluster.gpus_per_node=0"
            + ("" if cluster_of(cfg).spans_nodes else ", and nvidia-smi finds none here")
            + "); use trainer.device=auto (the GPUs where there are, else the CPU) or cpu"
        )
    quantization = model.inference.quantization
    weights = DTYPE_BYTES.get(str(quantization or model.dtype), 4)
    state = TRAINER_STATE_COPIES * DTYPE_BYTES[precision(cfg).master]
    need_gb = params(model).trained / 1e9 * (state + weights)
    if need_gb > cluster.mem_gb_per_node:
        raise PlanError(
            f"model={model.name}: its training state and served weights take ~{need_gb:.0f} GB "
            f"and cluster={cluster.name} has no GPUs and {cluster.mem_gb_per_node} GB of memory "
            f"per node; use a GPU cluster (cluster=slurm) or a smaller model"
        )
    if quantization and quantization not in engine_of(cfg).quantizations:
        raise PlanError(
            f"model={model.name}: it is served in FP8, which the embedded engine (the backend "
            f"on CPU) does not serve; use inference.backend=vllm (its CPU build serves FP8 "
            f"block checkpoints), a GPU cluster (cluster=slurm), or a model that runs on CPU "
            f"(tiny, smollm2_135m, qwen3_0_6b)"
        )


def check_this_machine(cfg: DictConfig) -> list[str]:
    """What a cluster=local run needs of this machine (run where it is planned, so checked
    here, dry run included): the GPUs it declares, and vLLM where it serves with vLLM. A dry
    run plans what this machine lacks as declared: returns the notes that say so."""
    from launcher.plan.gpus import describe, detect

    check_wandb_login(cfg)
    if cluster_of(cfg).spans_nodes:
        return []
    notes = []
    declared = cfg.cluster.gpus_per_node or 0
    if declared and declared > len(found := detect()):
        lacking = (
            f"cluster.gpus_per_node={declared}: cluster=local runs on this machine, and "
            f"{describe(found).split(':')[0]}"
        )
        if not cfg.dry_run:
            raise PlanError(
                f"{lacking}; leave it unset to use what is found, or plan a cluster's run "
                f"with cluster=slurm"
            )
        notes.append(f"{lacking}: planned as declared (the run itself is refused here)")
    if lacking := engine_of(cfg).machine_problem():
        missing, remedy = lacking
        if not cfg.dry_run:
            raise PlanError(f"{missing}; {remedy}")
        notes.append(f"{missing}: the run itself is refused here")
    return notes


def check_wandb_login(cfg: DictConfig) -> None:
    """wandb online needs an API key (WANDB_API_KEY, or a `wandb login` in ~/.netrc): without
    one, wandb.init fails after the run directory is made."""
    from launcher.watch.tracking import wandb_mode

    if wandb_mode(cfg) != "online" or os.environ.get("WANDB_API_KEY"):
        return
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    try:
        if netrc.netrc().authenticators(host.hostname or ""):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise PlanError(
        "wandb.mode=online: no wandb API key here (WANDB_API_KEY, or `wandb login`); set one, "
        "or use wandb.mode=offline (the run's wandb/ folder, to `wandb sync` later)"
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
    engine = engine_of(cfg)
    if engine.lora_ranks and max(rank, inf.max_lora_rank or 0) > engine.lora_ranks[-1]:
        raise PlanError(
            f"model.lora.rank={rank}: {engine.label} serves adapters up to rank "
            f"{engine.lora_ranks[-1]}"
        )
    if engine.adapters_from_directories and weight_transport(cfg) == WeightTransport.broadcast:
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
    spans = cluster_of(cfg).spans_nodes
    if spans and cfg.warmup.steps:
        raise PlanError(
            f"warmup.steps={cfg.warmup.steps}: on Slurm a shared sweep starts every point from "
            f"the base it is given (model.path, for example a run's weights/step_0); set "
            f"warmup.steps=0"
        )
    if not spans and cfg.cluster.gpus_per_node:
        raise PlanError(
            f"{key} on one machine's GPUs: not built yet (each point's trainer needs GPUs of "
            f"its own beside the service's); sweep with cluster=slurm, or without it"
        )
    if weight_transport(cfg) != WeightTransport.filesystem:
        raise PlanError(
            f"{key}: each point's adapter reaches the shared inference from its weights/ "
            f"directory; use inference.weight_transport=filesystem"
        )
    if cfg.placement != Placement.split:
        raise PlanError(
            f"{key}: the points' trainers run beside the shared inference; use placement=split"
        )


def check_weight_transport(cfg: DictConfig) -> None:
    inf = cfg.inference
    if weight_transport(cfg) != WeightTransport.broadcast:
        return
    if inf.broadcast_backend == BroadcastBackend.nccl and not cfg.cluster.gpus_per_node:
        refuse(
            "inference.broadcast_backend=nccl",
            f"NCCL needs GPUs and cluster={cfg.cluster.name} has none "
            f"(use gloo, or leave it unset to choose by the cluster)",
        )


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


def disk_warning(cfg: DictConfig, run_dir: Path, done: int = 0) -> str | None:
    """A one-line warning when the filesystem of `run_dir` has less free space than the run's
    checkpoints and published weights will take from step `done` on (launcher/plan/costs/fit.py's
    estimate, stated in the line); None when it has room or cannot be read."""
    need, free = disk_need(cfg, done), free_bytes(run_dir)
    if free is None or free >= need.total:
        return None
    model, trainer = cfg.model, cfg.trainer
    parts = [
        f"{need.checkpoints} checkpoint(s) at once of ~{size(need.checkpoint_bytes)} (master "
        f"weights and AdamW's two moments in {precision(cfg).master}; "
        f"trainer.keep_checkpoints={trainer.keep_checkpoints}, checkpoint_every="
        f"{trainer.checkpoint_every}, max_steps={cfg.max_steps})",
        f"{need.versions} published version(s) of ~{size(need.version_bytes)} at once "
        f"(trainer.keep_weights={trainer.keep_weights})",
    ]
    if need.reference_bytes:
        parts.append(f"the KL reference's ~{size(need.reference_bytes)}")
    if model.lora.rank:
        parts.append("LoRA adapters not counted")
    return (
        f"warning: {run_dir} has {size(free)} free, and this run's checkpoints and published "
        f"weights need ~{size(need.total)}: {', '.join(parts)}, for model={model.name} "
        f"({model.total_params_b:g}B parameters); a full disk ends the run"
    )
