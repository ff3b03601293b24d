"""Slurm from a login node: check the plan against the cluster, submit it, look at it later.

`submit` asks the cluster what it has (partitions, their nodes' CPUs, memory and GPUs, the
user's accounts and QOS) and fails before anything is submitted when a job cannot fit. It then
submits one job per set of roles (control, inference, trainer) with submitit, each held until
all are in (so a failed submission leaves no job running and no run directory), records their
ids in `jobs.json` and returns. Every job runs `launcher.supervisor.JobRoles`, which starts
that job's roles, watches the other jobs and cancels the run when one of them fails. The Slurm
clients themselves are called through launcher/slurm_cli.py.
"""

from __future__ import annotations

import getpass
import shutil
from pathlib import Path

import submitit
from omegaconf import DictConfig, open_dict

from launcher.errors import ConfigError
from launcher.plan import RunPlan, sbatch_parameters
from launcher.processes import FINISHING_ROLES
from launcher.report import override, sweep_group
from launcher.run_dir import prepare_run_dir
from launcher.slurm_cli import (
    Partition,
    cancel_run,
    ended,
    job_states,
    partitions,
    read_jobs,
    sacctmgr_names,
    slurm,
    write_jobs,
)
from launcher.status import find_run, format_status
from launcher.supervisor import JobRoles
from rl.core.rundir import RunDir


def preflight(cfg: DictConfig, run_plan: RunPlan) -> str:
    """Check the jobs against what the cluster reports; returns the partition to use."""
    part = _partition(cfg, partitions())
    _check_time_limit(cfg, part)
    _check_jobs_fit(cfg, run_plan, part)
    _check_account_and_qos(cfg)
    return part.name


def _partition(cfg: DictConfig, parts: dict[str, Partition]) -> Partition:
    """The partition `cluster.partition` names, or the cluster's default one."""
    names = ", ".join(sorted(parts))
    if cfg.cluster.partition:
        part = parts.get(cfg.cluster.partition)
        if part is None:
            raise ConfigError(
                f"cluster.partition={cfg.cluster.partition}: the cluster has no such "
                f"partition (it has: {names})"
            )
        return part
    defaults = [p for p in parts.values() if p.default]
    if not defaults:
        raise ConfigError(
            f"cluster.partition: not set and the cluster has no default partition; "
            f"choose one of: {names}"
        )
    return defaults[0]


def _check_time_limit(cfg: DictConfig, part: Partition) -> None:
    """`cluster.time_min` within the partition's MaxTime (Slurm would leave the jobs pending
    forever, or shorten them, depending on the site's settings)."""
    limit = part.max_time_min
    if limit is not None and cfg.cluster.time_min > limit:
        raise ConfigError(
            f"cluster.time_min={cfg.cluster.time_min}: partition {part.name} allows at most "
            f"{limit:g} minutes per job (its MaxTime)"
        )


def _check_jobs_fit(cfg: DictConfig, run_plan: RunPlan, part: Partition) -> None:
    """Every job fits the partition's nodes, and all of them fit it at once. Errors name the
    setting's own value; a job may ask for less (the control job is capped)."""
    cluster = cfg.cluster
    needed = sum(job.nodes for job in run_plan.jobs)
    if needed > part.nodes:
        each = ", ".join(f"{job.name} {job.nodes}" for job in run_plan.jobs)
        raise ConfigError(
            f"cluster.nodes: the run's jobs need {needed} nodes at once ({each}) but "
            f"partition {part.name} has {part.nodes}"
        )
    for job in run_plan.jobs:
        if part.max_nodes is not None and job.nodes > part.max_nodes:
            raise ConfigError(
                f"cluster.nodes: job {job.name} needs {job.nodes} nodes; partition "
                f"{part.name} allows {part.max_nodes} per job"
            )
        if job.gpus_per_node > part.gpus:
            raise ConfigError(
                f"cluster.gpus_per_node={cluster.gpus_per_node}: job {job.name} asks for "
                f"{job.gpus_per_node} GPUs per node; partition {part.name}'s nodes have at most "
                f"{part.gpus}"
            )
        if job.cpus_per_task > part.cpus:
            raise ConfigError(
                f"cluster.cpus_per_node={cluster.cpus_per_node}: job {job.name} asks for "
                f"{job.cpus_per_task} CPUs per node; partition {part.name}'s nodes have at most "
                f"{part.cpus}"
            )
        if job.mem_gb * 1024 > part.mem_mb:
            raise ConfigError(
                f"cluster.mem_gb_per_node={cluster.mem_gb_per_node}: job {job.name} asks for "
                f"{job.mem_gb} GB "
                f"per node; partition {part.name}'s nodes have at most {part.mem_mb} MB"
            )


def _check_account_and_qos(cfg: DictConfig) -> None:
    """`cluster.account` and `cluster.qos` exist for this user (where accounting answers)."""
    user = getpass.getuser()
    if cfg.cluster.account:
        accounts = sacctmgr_names("show", "assoc", "where", f"user={user}", "format=Account")
        if accounts is not None and cfg.cluster.account not in accounts:
            raise ConfigError(
                f"cluster.account={cfg.cluster.account}: user {user} has no such account on "
                f"this cluster (has: {', '.join(sorted(accounts)) or 'none'})"
            )
    if cfg.cluster.qos:
        qos = sacctmgr_names("show", "qos", "format=Name")
        if qos is not None and cfg.cluster.qos not in qos:
            raise ConfigError(
                f"cluster.qos={cfg.cluster.qos}: the cluster has no such QOS "
                f"(has: {', '.join(sorted(qos))})"
            )


def submit(cfg: DictConfig, run_plan: RunPlan) -> RunDir:
    """Submit the run's jobs and return its directory; nothing is left behind on failure."""
    partition = preflight(cfg, run_plan)
    if cfg.wandb.group is None:
        with open_dict(cfg):
            cfg.wandb.group = sweep_group()
    run, _ = prepare_run_dir(cfg, run_plan)
    try:
        _submit_jobs(cfg, run_plan, run, partition)
    except BaseException:
        shutil.rmtree(run.root, ignore_errors=True)
        raise
    return run


def check_ended(run: RunDir) -> None:
    """ConfigError unless every job of the run has ended (before a resume changes anything)."""
    ids = read_jobs(run)
    states = job_states(list(ids.values()))
    live = [name for name, i in ids.items() if i in states and not ended(states[i].state)]
    if live:
        raise ConfigError(
            f"resume={run.root}: jobs {', '.join(live)} are still queued or running "
            f"(rl action=cancel {override('run_dir', run.root)} first)"
        )


def resubmit(cfg: DictConfig, run_plan: RunPlan, run: RunDir) -> None:
    """Submit the jobs of an ended run again; its roles pick up from the run directory."""
    check_ended(run)
    partition = preflight(cfg, run_plan)
    run.end_submission()
    for marker in (*(run.done(role) for role in FINISHING_ROLES), run.complete):
        marker.unlink(missing_ok=True)
    _submit_jobs(cfg, run_plan, run, partition)


def _submit_jobs(cfg: DictConfig, run_plan: RunPlan, run: RunDir, partition: str) -> None:
    submit_together([(cfg, run_plan, run)], partition)


def submit_together(
    runs: list[tuple[DictConfig, RunPlan, RunDir]], partition: str, label: str = ""
) -> None:
    """Submit every job of `runs` held, record each run's ids, release them all together; on
    any failure cancel what was submitted and raise ConfigError. Each run is announced with
    its directory, jobs, logs and status command; with `label` (a sweep's base) by one line."""
    submitted: list[str] = []
    named: list[tuple[RunDir, str, dict[str, str]]] = []
    try:
        for cfg, run_plan, run in runs:
            ids: dict[str, str] = {}
            point = run.root.name.split("-", 1)[0]  # a sweep point's number names its jobs too
            run_name = f"{run_plan.run_name}-{point}" if point.isdigit() else run_plan.run_name
            for job in run_plan.jobs:
                executor = submitit.SlurmExecutor(
                    folder=run.submitit_folder(job.name), max_num_timeout=cfg.cluster.max_requeues
                )
                extra = {"hold": True, **job.sbatch_extra}
                executor.update_parameters(
                    **sbatch_parameters(job, run_name, cfg), additional_parameters=extra
                )
                ids[job.name] = executor.submit(JobRoles(str(run.root), job.name)).job_id
                submitted.append(ids[job.name])
            write_jobs(run, partition, ids)
            named.append((run, run_name, ids))
        slurm("scontrol", "release", ",".join(submitted))
    except BaseException as err:
        if submitted:
            slurm("scancel", *submitted, check=False)
        if isinstance(err, Exception):
            lines = str(err).strip().splitlines() or [type(err).__name__]
            raise ConfigError(f"submission failed, nothing left queued: {lines[-1]}") from None
        raise
    for run, run_name, ids in named:
        if label:
            jobs = ", ".join(f"job {job_id} ({name})" for name, job_id in ids.items())
            print(f"{label}: submitted {jobs}, partition {partition}: {run.root}")
            continue
        print(f"run directory: {run.root}")
        for name, job_id in ids.items():
            print(f"submitted job {job_id}: {run_name}-{name} (partition {partition})")
        print(f"logs: {run.logs}/ (roles), {run.slurm}/<job>/ (each job's supervisor)")
        print(f"status: uv run rl action=status {override('run_dir', run.root)}")


def cancel(run_dir: str | None, outputs: Path) -> None:
    """Cancel the run's jobs (`action=cancel`), recording who did, and show its status."""
    run = find_run(run_dir, outputs)
    if not read_jobs(run):
        raise ConfigError(f"run_dir={run.root}: not a Slurm run (no {run.jobs.name})")
    cancel_run(run, f"cancelled by {getpass.getuser()} (rl action=cancel)")
    print(format_status(run))
