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
import json
import pwd
import shutil
from pathlib import Path

import submitit
from omegaconf import DictConfig, open_dict

from launcher.errors import ConfigError
from launcher.plan import RunPlan, sbatch_parameters
from launcher.processes import FINISHING_ROLES
from launcher.report import override, read_records, read_summary, sweep_group
from launcher.run_dir import prepare_run_dir, running_roles
from launcher.slurm_cli import (
    JobState,
    Partition,
    cancel_run,
    ended,
    failure_reason,
    job_states,
    partitions,
    read_jobs,
    sacctmgr_names,
    slurm,
    write_jobs,
)
from launcher.supervisor import JobRoles
from launcher.sweep_summary import write_sweep_summary
from launcher.tracking import ETA_WINDOW, duration
from rl.core.records import is_eval, is_train
from rl.core.rundir import CONFIG, RunDir


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
        print(f"logs: {run.logs}/ (roles), {run.root / 'slurm'}/<job>/ (each job's supervisor)")
        print(f"status: uv run rl action=status {override('run_dir', run.root)}")


def _newest(records: list[dict]) -> dict | None:
    return max(records, key=lambda r: r["step"]) if records else None


def run_state(run: RunDir) -> str:
    """running, finished, failed, interrupted (nothing of it alive and no end recorded); for a
    Slurm run also cancelled, and queued while its jobs have not started."""
    if run.complete.exists():
        return "finished"
    ids = read_jobs(run)
    if ids:
        reason = failure_reason(run)
        if reason is not None:
            return "cancelled" if reason.startswith("cancelled") else "failed"
        try:
            states = [s.state.split()[0] for s in job_states(list(ids.values())).values()]
        except ConfigError:
            return "submitted"
        return "running" if "RUNNING" in states else "queued" if states else "submitted"
    if running_roles(run):
        return "running"
    return read_summary(run).get("status", "interrupted")


def eta(train: list[dict], max_steps: int) -> str:
    """Time left at the pace of the last steps recorded (their timestamps)."""
    last = sorted(train, key=lambda r: r["step"])[-ETA_WINDOW:]
    if len(last) < 2 or last[-1]["step"] <= last[0]["step"]:
        return ""
    pace = (last[-1]["timestamp"] - last[0]["timestamp"]) / (last[-1]["step"] - last[0]["step"])
    return f", ETA {duration(pace * (max_steps - last[-1]['step']))}"


def format_status(run: RunDir) -> str:
    """The run's state, jobs, latest step and eval, how it ended, and where its logs are, for
    `action=status`."""
    state = run_state(run)
    jobs = read_jobs(run)
    lines = [f"run {run.root}: {state}", *_job_lines(jobs), *_attempt_lines(run)]
    records = read_records(run.metrics)
    train, evaluation = (
        _newest([r for r in records if is_train(r)]),
        _newest([r for r in records if is_eval(r)]),
    )
    if train:
        max_steps = run.load_config().max_steps
        pace = eta([r for r in records if is_train(r)], max_steps)
        lines.append(
            f"  latest step {train['step']}/{max_steps}: reward {train['reward/mean']:.3f}"
            f"{pace if state == 'running' else ''}"
        )
    else:
        lines.append("  no trainer step yet")
    if evaluation:
        lines.append(
            f"  latest eval at version {evaluation['step']}: exact_match "
            f"{evaluation['eval/exact_match']:.3f}"
        )
    if run.complete.exists():
        lines.append("  complete")
    reason = failure_reason(run)
    if reason is not None:
        lines.append(f"  ended: {reason}")
    if state in ("interrupted", "failed", "stopped") and not jobs:
        lines.append(f"  resume at {run.resume_point()}: uv run rl {override('resume', run.root)}")
    lines.append(f"  logs: {run.logs}/")
    if jobs:
        lines.append(f"  job logs: {run.root / 'slurm'}/<job>/<id>_0_log.out")
    return "\n".join(lines)


def _job_lines(ids: dict[str, str]) -> list[str]:
    """A table of the jobs' states (none for no jobs); when Slurm cannot say, that, and the
    rest of the status still shows."""
    if not ids:
        return []
    try:
        states = job_states(list(ids.values()))
    except ConfigError as err:
        return [f"  job states unavailable: {err}"]
    lines = [f"  {'job':<10} {'id':>7}  {'state':<30} {'elapsed':>9}  nodes"]
    for name, job_id in ids.items():
        s = states.get(job_id, JobState("UNKNOWN", "", "", ""))
        lines.append(f"  {name:<10} {job_id:>7}  {shown_state(s):<30} {s.elapsed:>9}  {s.nodes}")
    return lines


def shown_state(s: JobState) -> str:
    """The state as a person reads it: who cancelled by name, not uid, and the reason only
    while it still holds (Slurm keeps the last pending reason, JobHeldUser from the held
    submission, on jobs long since run)."""
    words = s.state.split()
    if len(words) == 3 and words[1] == "by" and words[2].isdigit():
        try:
            words[2] = pwd.getpwuid(int(words[2])).pw_name
        except KeyError:
            pass
    state = " ".join(words)
    pending = words[0] in ("PENDING", "REQUEUED", "SUSPENDED", "CONFIGURING")
    return f"{state} ({s.reason})" if pending and s.reason not in ("None", "") else state


def _attempt_lines(run: RunDir) -> list[str]:
    """The jobs of the run's earlier submissions (a resumed run's), each with its end."""
    lines = []
    for path in sorted(run.ended.glob("jobs-*.json")):
        attempt = path.stem.removeprefix("jobs-")
        ids = json.loads(path.read_text())["jobs"]
        failure = run.ended / f"failure-{attempt}.json"
        why = json.loads(failure.read_text())["reason"] if failure.exists() else "resubmitted"
        lines.append(f"  earlier submission {attempt}: {why}")
        lines += ["  " + line for line in _job_lines(ids)]
    return lines


def find_run(cfg: DictConfig, here: Path) -> RunDir:
    """The run `run_dir` names, or the newest run of any name under the outputs folder
    (`here` is the run directory Hydra chose for this command, two levels below it)."""
    if cfg.run_dir:
        run = RunDir(Path(cfg.run_dir))
        if not run.config.exists():
            raise ConfigError(f"run_dir={cfg.run_dir}: not a run directory (no {CONFIG})")
        return run
    outputs = here.parent.parent
    runs = [RunDir(p.parent) for p in outputs.glob(f"**/{CONFIG}")]
    if not runs:
        raise ConfigError(f"no run found under {outputs}; pass run_dir=")
    return max(runs, key=lambda run: run.config.stat().st_mtime)


def status(cfg: DictConfig, here: Path) -> None:
    """The run's status; for a sweep directory, its comparison table (written anew)."""
    if cfg.run_dir and not RunDir(Path(cfg.run_dir)).config.exists():
        table = write_sweep_summary(Path(cfg.run_dir))
        if table is not None:
            print(table.read_text())
            return
    print(format_status(find_run(cfg, here)))


def cancel(cfg: DictConfig, here: Path) -> None:
    run = find_run(cfg, here)
    if not read_jobs(run):
        raise ConfigError(f"run_dir={run.root}: not a Slurm run (no {run.jobs.name})")
    cancel_run(run, f"cancelled by {getpass.getuser()} (rl action=cancel)")
    print(format_status(run))
