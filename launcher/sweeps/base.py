"""A sweep's shared base: points that differ only in what their RL run does (the run's `seed`,
the algorithm's settings, how long it goes on) start from one warmed-up base model, built
once for the sweep, locally and on Slurm.

The base's seeds are its own (`model.seed`, `warmup.seed`), so `rl -m seed=0,1,2` compares
RL runs from one start instead of three starts. Points are grouped by a key over everything
the warm-up reads (the model, the warm-up, the environment's examples, the trainer's layout
and device, the cluster's threads and the placement that splits them); each group's base is
a run directory of its own, `<sweep>/bases/<key>/`, holding the trainer's log and
`weights/step_0`. Each point then starts from those weights (its config records `model.path`
and `warmup.steps=0`):

- locally, the first point of a group warms its base up (its trainer alone, as the point's
  run would), and the group's later points find it complete: a point is the run it would be
  alone, bit for bit;
- on Slurm, the first point of a group submits its base as one trainer job, and every point
  of the group is submitted to start after it (`--dependency=afterok:<job>`).

A sweep sharing inference (`inference.shared`) has one base of its own (launcher/
shared_sweep.py), with the same warm-up (`warm_up`).
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import os
import secrets
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from launcher.clusters.base import cluster_of
from launcher.clusters.processes import POLL_S, RunFailed, expand, spawn, stop_children, tail
from launcher.plan.planner import plan
from launcher.watch.tracking import Console, MetricsTail
from rl.core.config import Allocation, WeightTransport
from rl.core.rundir import BASES, RunDir, is_complete

# What the warm-up reads: a point that differs from another here needs a base of its own.
WARM_UP_READS = (
    "model", "warmup", "environment", "trainer", "parallel.trainer", "cluster", "placement",
)  # fmt: skip


def shares_a_base(cfg: DictConfig) -> bool:
    """Whether a sweep point starts from its group's shared base: it has a warm-up to share
    and no base of its own given (a shared-inference sweep shares its own way)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return False
    return cfg.warmup.steps > 0 and not cfg.model.path and not cfg.inference.shared


def base_key(cfg: DictConfig) -> str:
    """The group of points whose warm-ups are the same: a hash of what the warm-up reads."""
    read = {}
    for key in WARM_UP_READS:
        node = OmegaConf.select(cfg, key)
        if isinstance(node, DictConfig):
            node = OmegaConf.to_container(node, resolve=True)
        read[key] = node
    read["model"].pop("lora", None)  # the warm-up trains every weight, adapter or not
    read["adam_eps"] = cfg.algorithm.adam_eps
    blob = json.dumps(read, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def base_config(cfg: DictConfig) -> DictConfig:
    """The base's run: the point's warm-up alone (no RL step, no adapter, weights to disk)."""
    base = copy.deepcopy(cfg)
    with open_dict(base):
        base.max_steps = 0
        base.model.lora.rank = 0
        base.inference.shared = False
        base.inference.weight_transport = WeightTransport.filesystem
    return base


def start_from_base(cfg: DictConfig, sweep_dir: Path) -> bool:
    """Point `cfg` at its group's base, warming it up (locally) or submitting it (Slurm) when
    no point of the group has yet; returns whether the base is still to be built (a Slurm job
    the point's jobs wait for)."""
    run = RunDir(sweep_dir.absolute() / BASES / base_key(cfg))
    weights = run.weights_for(0)
    after = None
    cluster = cluster_of(cfg)
    if cluster.spans_nodes:  # a job of its own, that the points' jobs start after
        after = cluster.start_base(run)
    else:
        run.internal.mkdir(parents=True, exist_ok=True)
        # Points run side by side (Hydra's array-job launcher): one warms up, the rest wait.
        with open(run.warm_up_lock, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not is_complete(weights):
                warm_up(cfg, run, secrets.token_hex(16), "sweep base")
    with open_dict(cfg):
        cfg.model.path = str(weights)
        cfg.warmup.steps = 0
        if after is not None:
            cfg.cluster.sbatch_extra["dependency"] = f"afterok:{after}"
            cfg.cluster.sbatch_extra["kill_on_invalid_dep"] = "yes"  # a failed base ends them
    return after is not None


def submitted_base(cfg: DictConfig, run: RunDir) -> str | None:
    """The Slurm job building the group's base, submitted now if no point of the group has
    submitted it; None when the base is complete already."""
    from launcher.clusters.slurm.cli import read_jobs
    from launcher.clusters.slurm.submit import preflight, submit_together

    if is_complete(run.weights_for(0)):
        return None
    if run.config.exists():
        return read_jobs(run)["trainer"]
    base = base_config(cfg)
    # The point's plan (a base run has no RL step to plan), its trainer as a job of its own.
    with open_dict(cfg):
        layout = cfg.cluster.allocation
        cfg.cluster.allocation = Allocation.per_role
    try:
        base_plan = plan(cfg)
    finally:
        with open_dict(cfg):
            cfg.cluster.allocation = layout
    base_plan.processes = base_plan.role("trainer")
    base_plan.jobs = [job for job in base_plan.jobs if job.name == "trainer"]
    run.create(base, secrets.token_hex(16), base_plan.to_json())
    submit_together([(base, base_plan, run)], preflight(base, base_plan), "sweep base")
    return read_jobs(run)["trainer"]


def warm_up(point: DictConfig, run: RunDir, token: str, label: str) -> Path:
    """Run the warm-up of `point` (a sweep point's config) in `run`: its trainer alone, as in
    the point's run, publishing version 0 and stopping; returns the published weights. Progress
    lines are prefixed `label:`."""
    cfg = base_config(point)
    if not run.config.exists():
        run.create(cfg, token)
    trainer = next(p for p in plan(point).processes if p.role == "trainer")
    # The threads the point's trainer has: a base warmed up with others would differ from the
    # point's own warm-up in the last bits (a sum's order), and its run from the point's run.
    env = {**os.environ, **trainer.env, "RELAY_TOKEN": token}
    values = {"RELAY_RUN_DIR": str(run.root)}
    print(f"{label}: warm-up, once for the points that share it: {run.root}", flush=True)
    child = spawn("trainer", "trainer", expand(trainer.argv, values), env, run.log("trainer"))
    console, metrics = Console(cfg.warmup.steps), MetricsTail(run)
    try:
        while child.proc.poll() is None:
            for record in metrics.read():
                if text := console.line(record):
                    print(f"{label}: {text}", flush=True)
            time.sleep(POLL_S)
    finally:
        stop_children([child])
    if child.proc.returncode != 0 or not is_complete(run.weights_for(0)):
        raise RunFailed(
            f"the {label}'s warm-up {child.ended(child.proc.returncode)}; last lines of "
            f"{child.log_path}:\n{tail(child.log_path)}"
        )
    return run.weights_for(0)
