"""The plan's estimates on a GPU cluster, as the dry run prints them: each GPU's memory term by
term, the step's balance, the weight sync and the preemption checkpoint; and the signal delay
decided from them (or refused with the numbers). launcher/memory.py and launcher/balance.py
hold the arithmetic; this module puts a planned run's numbers into it."""

from __future__ import annotations

from omegaconf import DictConfig

from launcher.balance import (
    SLURM_MAX_SIGNAL_S,
    checkpoint_bytes,
    checkpoint_seconds,
    duration,
    generation,
    signal_delay,
    sync_bytes,
    sync_seconds,
    train_seconds,
    workload,
)
from launcher.errors import refuse
from launcher.sizing import (
    Footprint,
    decide,
    disaggregated,
    replica_gpus_of,
    replica_memory,
)
from rl.core.config import ClusterKind, WeightTransport
from rl.core.derive import kept_versions, max_model_len, weight_transport

DEFAULT_SIGNAL_DELAY_S = 120
"""The signal delay where nothing is estimated (a cluster without GPUs)."""


def estimate_notes(cfg: DictConfig, size: Footprint) -> list[str]:
    """The plan's notes on memory, balance, weight sync and preemption; decides
    `cluster.signal_delay_s` where it is None."""
    cluster = cfg.cluster
    if not (cluster.gpus_per_node and cluster.gpu_memory_gb) or size.trainer_memory is None:
        if cluster.signal_delay_s is None:
            decide(cluster, "signal_delay_s", DEFAULT_SIGNAL_DELAY_S)
        return []
    served = max_model_len(cfg)
    work = workload(cfg, served)
    tm = size.trainer_memory
    trainer_gpus = size.mesh["world"]
    train_s = train_seconds(cfg, work, trainer_gpus, tm.offload, tm.checkpointing)
    mem = replica_memory(cfg, size.replica_nodes)
    replica_gpus = replica_gpus_of(cfg, size.replica_nodes)
    replicas = cfg.parallel.inference.replicas
    pd = disaggregated(cfg)
    gen = generation(cfg, work, mem, replica_gpus, replicas, pd)
    sync_s = sync_seconds(cfg, replicas * (2 if pd else 1))
    slower = max(train_s, gen.seconds)
    instances = f"{replicas} replica(s)" + (" x (prefill + decode)" if pd else "")
    notes = [
        f"trainer memory per GPU ({trainer_gpus} GPUs, {size.trainer_nodes} nodes"
        + (", activation checkpointing" if tm.checkpointing else "")
        + (", CPU offload" if tm.offload else "")
        + f"): {tm.describe()}",
        f"inference memory per GPU ({instances} of {replica_gpus} GPUs, tp "
        f"{cfg.parallel.inference.tp}"
        + (f", experts over {replica_gpus}" if cfg.parallel.inference.expert_parallel else "")
        + f"): {mem.describe()}",
        f"balance per step ({work.samples} samples of ~{work.sample_tokens:,} tokens, "
        f"{work.generated:,} generated): training ~{duration(train_s)} on {trainer_gpus} "
        f"GPUs, generation ~{duration(gen.seconds)} on {replicas * (2 if pd else 1)} x "
        f"{replica_gpus} GPUs (prefill {duration(gen.prefill_s)}, decode "
        f"{duration(gen.decode_s)} at {gen.batch_per_gpu} sequences per GPU); the trainer "
        f"waits {1 - train_s / slower:.0%} of the step, inference {1 - gen.seconds / slower:.0%}"
        " (launcher/balance.py states the efficiencies)",
        weight_sync_note(cfg, sync_s, replicas * (2 if pd else 1)),
    ]
    notes.append(preemption_note(cfg, slower + sync_s))
    return notes


def weight_sync_note(cfg: DictConfig, seconds: float, instances: int) -> str:
    size = sync_bytes(cfg) / 1e9
    if weight_transport(cfg) == WeightTransport.broadcast:
        return (
            f"weight sync: {size:,.0f} GB per version by NCCL broadcast in buckets at "
            f"{cfg.cluster.link_gbs:g} GB/s per GPU link: ~{duration(seconds)}, inference "
            f"paused as long"
        )
    kept = kept_versions(cfg) + 1
    return (
        f"weight sync: {size:,.0f} GB per version through the filesystem at "
        f"{cfg.cluster.storage_gbs:g} GB/s (written once, read by {instances} instance(s)): "
        f"~{duration(seconds)}, inference paused while it loads; {kept} versions on disk "
        f"(~{kept * size / 1000:.1f} TB)"
        + "; inference.weight_transport=broadcast sends them over the network instead"
    )


def preemption_note(cfg: DictConfig, step_s: float) -> str:
    """The checkpoint a stopped job writes and the signal delay it needs: decided where
    `cluster.signal_delay_s` is None, refused where set below it or beyond what fits."""
    cluster, trainer = cfg.cluster, cfg.trainer
    optimizer = bool(trainer.stop_checkpoint_optimizer)
    write_s = checkpoint_seconds(cfg, optimizer)
    need = signal_delay(step_s, write_s)
    what = "weights, AdamW moments" if optimizer else "weights only"
    numbers = (
        f"the step under way (~{duration(step_s)}) and a checkpoint of "
        f"{checkpoint_bytes(cfg, optimizer) / 1e12:.2f} TB ({what}) at "
        f"{cluster.storage_gbs:g} GB/s (~{duration(write_s)}) need {need} s with a margin"
    )
    if cluster.kind != ClusterKind.slurm:
        if cluster.signal_delay_s is None:
            decide(cluster, "signal_delay_s", DEFAULT_SIGNAL_DELAY_S)
        return f"preemption: {numbers}"
    limit = min(SLURM_MAX_SIGNAL_S, cluster.time_min * 60 // 2)
    fix = (
        "trainer.stop_checkpoint_optimizer=false (weights only, a third of the bytes), "
        if optimizer
        else ""
    )
    if cluster.signal_delay_s is None:
        if need > limit:
            refuse(
                "cluster.signal_delay_s",
                f"{numbers}, more than half of cluster.time_min={cluster.time_min} (or "
                f"Slurm's {SLURM_MAX_SIGNAL_S} s); use {fix}a faster cluster.storage_gbs or a "
                f"longer time_min",
            )
        decide(cluster, "signal_delay_s", need)
        return f"preemption: USR2 {need} s before the time limit: {numbers}"
    if cluster.signal_delay_s < need:
        refuse(
            f"cluster.signal_delay_s={cluster.signal_delay_s}",
            f"too short: {numbers}; leave it unset to use the estimate, or use {fix}a faster "
            f"cluster.storage_gbs",
        )
    return f"preemption: USR2 {cluster.signal_delay_s} s before the time limit: {numbers}"
