"""The plan's estimates on a GPU cluster, as the dry run prints them: each GPU's memory term by
term, the step's balance, the weight sync and the preemption checkpoint; and the signal delay
decided from them (or refused with the numbers). launcher/plan/costs/memory.py and
launcher/plan/costs/step_time.py hold the arithmetic; this module puts a planned run's numbers
into it."""

from __future__ import annotations

from omegaconf import DictConfig

from launcher.clusters.base import cluster_of
from launcher.errors import refuse
from launcher.plan.costs.fit import (
    Footprint,
    decide,
    disaggregated,
    replica_gpus_of,
    replica_memory,
)
from launcher.plan.costs.step_time import (
    Sync,
    checkpoint_bytes,
    checkpoint_seconds,
    duration,
    gathered_bytes,
    generation,
    signal_delay,
    sync_bytes,
    sync_seconds,
    train_seconds,
    workload,
)
from rl.core.config import WeightTransport
from rl.core.derive import max_model_len, weight_transport
from rl.core.disk import size as in_bytes
from rl.core.schedule import kept_versions

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
    train_s = train_seconds(cfg, work, trainer_gpus, tm.options)
    mem = replica_memory(cfg, size.replica_nodes)
    replica_gpus = replica_gpus_of(cfg, size.replica_nodes)
    replicas = cfg.parallel.inference.replicas
    pd = disaggregated(cfg)
    gen = generation(cfg, work, mem, replica_gpus, replicas, pd)
    sync = sync_seconds(cfg, replicas * (2 if pd else 1), trainer_gpus)
    slower = max(train_s, gen.seconds)
    instances = f"{replicas} replica(s)" + (" x (prefill + decode)" if pd else "")
    turned_on = tm.options.describe() + ([f"cp {tm.mesh['cp']}"] if tm.mesh["cp"] > 1 else [])
    notes = [
        summary_note(
            cfg,
            train_s,
            gen.seconds,
            sync.seconds,
            trainer_gpus + replicas * (2 if pd else 1) * replica_gpus,
        ),
        f"trainer memory per GPU ({trainer_gpus} GPUs, {size.trainer_nodes} "
        f"node{'s' if size.trainer_nodes > 1 else ''}"
        + "".join(f", {what}" for what in turned_on)
        + f"; micro-batches of up to {tm.tokens:,} tokens): {tm.describe()}",
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
        " (launcher/plan/costs/step_time.py states the efficiencies)",
        weight_sync_note(cfg, sync, replicas * (2 if pd else 1)),
    ]
    notes.append(preemption_note(cfg, slower + sync.seconds))
    return notes


def summary_note(cfg: DictConfig, train_s: float, gen_s: float, sync_s: float, gpus: int) -> str:
    """The plan in one line: a step's time and where it goes, the run's GPU-hours, and how
    much of a step each side waits."""
    step_s = max(train_s, gen_s) + sync_s
    run_s = step_s * cfg.max_steps
    gpu_hours = gpus * run_s / 3600
    return (
        f"summary: a step ~{duration(step_s)} (training ~{duration(train_s)}, generation "
        f"~{duration(gen_s)}, side by side, then the weight sync ~{duration(sync_s)}); "
        f"{cfg.max_steps} steps ~{duration(run_s)} on {gpus} GPUs, {gpu_hours:,.1f} GPU-hours; "
        f"the trainer waits {1 - train_s / step_s:.0%} of a step, inference "
        f"{1 - gen_s / step_s:.0%}"
    )


def weight_sync_note(cfg: DictConfig, sync: Sync, instances: int) -> str:
    size = sync_bytes(cfg) / 1e9
    gathered = gathered_bytes(cfg) / 1e9
    stages = (
        f"rank 0 gathers {gathered:,.0f} GB ({cfg.model.dtype}) block by block at "
        f"{cfg.cluster.link_gbs:g} GB/s (~{duration(sync.gather_s)})"
    )
    if sync.quantize_s:
        stages += f", re-quantizes it to FP8 on its GPU (~{duration(sync.quantize_s)})"
    if weight_transport(cfg) == WeightTransport.broadcast:
        return (
            f"weight sync ~{duration(sync.seconds)} a version: {stages}, then broadcasts "
            f"{size:,.0f} GB by NCCL in buckets at {cfg.cluster.link_gbs:g} GB/s per GPU link "
            f"(~{duration(sync.transfer_s)}, inference paused as long)"
        )
    kept = kept_versions(cfg) + 1
    return (
        f"weight sync ~{duration(sync.seconds)} a version: {stages}, then writes {size:,.0f} "
        f"GB through the filesystem at {cfg.cluster.storage_gbs:g} GB/s (read by {instances} "
        f"instance(s): ~{duration(sync.transfer_s)}, inference paused while it loads); "
        f"{kept} versions on disk (~{kept * size / 1000:.1f} TB)"
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
        f"{in_bytes(checkpoint_bytes(cfg, optimizer))} ({what}) at "
        f"{cluster.storage_gbs:g} GB/s (~{duration(write_s)}) need {need} s with a margin"
    )
    limited = cluster_of(cfg).signal_limit()
    if limited is None:  # no time limit: nothing warns the run
        if cluster.signal_delay_s is None:
            decide(cluster, "signal_delay_s", DEFAULT_SIGNAL_DELAY_S)
        return f"preemption: {numbers}"
    limit, what = limited
    fix = (
        "trainer.stop_checkpoint_optimizer=false (weights only, a third of the bytes), "
        if optimizer
        else ""
    )
    if cluster.signal_delay_s is None:
        if need > limit:
            refuse(
                "cluster.signal_delay_s",
                f"{numbers}, more than {what}; use {fix}a faster cluster.storage_gbs or a "
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
