"""Slurm from a login node: check the plan against the cluster, submit it, look at it later.

`submit` asks the cluster what it has (partitions, their nodes' CPUs, memory and GPUs, the user's
accounts and QOS) and fails before anything is submitted when a job cannot fit. It then submits one
job per set of roles (control, inference, trainer) with submitit, each held until all are in (so a
failed submission leaves no job running and no run directory), records their ids in `jobs.json` and
returns. Every job runs `launcher.clusters.slurm.supervisor.JobRoles`, which starts that job's
roles, watches the other jobs and cancels the run when one of them fails. The Slurm clients
themselves are called through launcher/clusters/slurm/cli.py.
"""

from __future__ import annotations

import getpass
import shlex
import shutil
import subprocess
import sys
import time

import submitit
from omegaconf import DictConfig, open_dict

from launcher.clusters.processes import FINISHING_ROLES
from launcher.clusters.run_dir import prepare_run_dir
from launcher.clusters.slurm import cli as slurm_cli
from launcher.clusters.slurm.cli import (
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
from launcher.clusters.slurm.jobs import (
    additional_parameters,
    max_requeues,
    sbatch_parameters,
    srun_args,
)
from launcher.clusters.slurm.supervisor import JobRoles
from launcher.errors import ConfigError
from launcher.plan.planner import RunPlan
from launcher.watch.report import override, sweep_group
from launcher.watch.status import format_status
from rl.core.rundir import RunDir, sweep_point

CANCEL_CHECKPOINT_S = 60.0
"""The least `action=cancel` waits for the trainer's checkpoint (else the plan's signal delay)."""
CANCEL_POLL_S = 0.5


def preflight(cfg: DictConfig, run_plan: RunPlan) -> str:
    """Check the jobs against what the cluster reports, and that a compute node runs the
    jobs' Python; warn where Slurm's KillWait is shorter than a checkpoint. Returns the
    partition to use."""
    part = _partition(cfg, partitions())
    _check_time_limit(cfg, part)
    _check_jobs_fit(cfg, run_plan, part)
    _check_account_and_qos(cfg)
    _check_python(cfg, part.name)
    _warn_of_kill_wait(cfg)
    return part.name


def job_python(cfg: DictConfig) -> str:
    """The interpreter the jobs run: `cluster.python`, or the one running `rl`."""
    return cfg.cluster.python or shlex.quote(sys.executable)


PYTHON_CHECK_S = 30
"""How long the Python check waits for a node (srun's --immediate) before it gives up on
checking: on a full cluster it says so and submits anyway."""


def _check_python(cfg: DictConfig, partition: str) -> None:
    """Run the jobs' Python on a compute node (one task, no GPU) and import Relay there:
    a login node's virtual environment that the nodes do not see fails here, not in every
    job. Where no node is free at once, says so and goes on."""
    python = shlex.split(job_python(cfg))
    args = ["srun", "--nodes=1", "--ntasks=1", f"--partition={partition}", "--time=2"]
    args += [f"--immediate={PYTHON_CHECK_S}", "--quiet", *srun_args(cfg)]
    if cfg.cluster.account:
        args.append(f"--account={cfg.cluster.account}")
    probe = "import launcher.clusters.slurm.supervisor, rl.core.runtime"
    try:
        done = subprocess.run(
            [*args, *python, "-c", probe],
            capture_output=True,
            text=True,
            timeout=PYTHON_CHECK_S + 60,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        print(f"note: the jobs' Python was not checked on a compute node ({err})", flush=True)
        return
    if done.returncode == 0:
        return
    said = (done.stderr or done.stdout).strip().splitlines()
    last = said[-1] if said else f"exit code {done.returncode}"
    if "Unable to allocate" in done.stderr or "Immediate execution impossible" in done.stderr:
        print(f"note: the jobs' Python was not checked: no node free at once ({last})")
        return
    raise ConfigError(
        f"cluster.python={' '.join(python)}: a compute node of partition {partition} cannot "
        f"run it ({last}); set cluster.python to an interpreter with Relay installed that the "
        f"nodes see (the project's .venv on the shared filesystem, or the container's)"
    )


def _warn_of_kill_wait(cfg: DictConfig) -> None:
    """A preemption or a scancel sends SIGTERM, then SIGKILL after the site's KillWait: the
    trainer's checkpoint of the step under way must fit in it."""
    if not cfg.cluster.gpus_per_node:
        return
    from launcher.plan.costs.step_time import checkpoint_seconds

    need = checkpoint_seconds(cfg, bool(cfg.trainer.stop_checkpoint_optimizer))
    kill_wait = slurm_cli.kill_wait_s()
    if kill_wait is not None and kill_wait < need:
        print(
            f"warning: Slurm's KillWait is {kill_wait} s and the trainer's checkpoint of the "
            f"step under way needs ~{need:.0f} s: a preemption or a plain scancel (SIGTERM, "
            f"then SIGKILL) loses the steps since the last checkpoint; rl action=cancel and the "
            f"time limit's USR2 ask for the checkpoint first (a site can raise KillWait, or "
            f"the partition's GraceTime for preemption)",
            flush=True,
        )


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
    named: list[tuple[RunDir, dict[str, str], dict[str, str]]] = []
    try:
        for cfg, run_plan, run in runs:
            ids: dict[str, str] = {}
            names: dict[str, str] = {}
            point = sweep_point(run.root)  # a sweep point's number names its jobs too
            for job in run_plan.jobs:
                executor = submitit.SlurmExecutor(
                    folder=run.submitit_folder(job.name),
                    max_num_timeout=max_requeues(cfg),
                    python=job_python(cfg),
                )
                extra = {"hold": True, **additional_parameters(job)}
                parameters = sbatch_parameters(job, run_plan.run_name, cfg, point)
                executor.update_parameters(**parameters, additional_parameters=extra)
                ids[job.name] = executor.submit(JobRoles(str(run.root), job.name)).job_id
                names[job.name] = parameters["job_name"]
                submitted.append(ids[job.name])
            write_jobs(run, partition, ids)
            named.append((run, names, ids))
        slurm("scontrol", "release", ",".join(submitted))
    except BaseException as err:
        if submitted:
            slurm("scancel", *submitted, check=False)
        if isinstance(err, Exception):
            lines = str(err).strip().splitlines() or [type(err).__name__]
            raise ConfigError(f"submission failed, nothing left queued: {lines[-1]}") from None
        raise
    for run, names, ids in named:
        if label:
            jobs = ", ".join(f"job {job_id} ({name})" for name, job_id in ids.items())
            print(f"{label}: submitted {jobs}, partition {partition}: {run.root}")
            continue
        print(f"run directory: {run.root}")
        for name, job_id in ids.items():
            print(f"submitted job {job_id}: {names[name]} (partition {partition})")
        print(f"logs: {run.logs}/ (roles), {run.slurm}/<job>/ (each job's supervisor)")
        print(f"status: uv run rl action=status {override('run_dir', run.root)}")


def cancel(run: RunDir, force: bool = False) -> None:
    """Cancel the run's jobs (`action=cancel`), recording who did, and show its status. A
    running trainer is first asked to checkpoint the step under way (as Ctrl-C asks a local
    run), waited for up to the plan's estimate of a step and a checkpoint, so that a resume
    loses no step; `force` cancels at once."""
    ids = read_jobs(run)
    if not ids:
        raise ConfigError(f"run_dir={run.root}: not a Slurm run (no {run.jobs.name})")
    reason = f"cancelled by {getpass.getuser()} (rl action=cancel)"
    if not force and trainer_running(run, ids):
        step = checkpoint_first(run)
        reason += f" after a checkpoint at step {step}" if step is not None else ""
    cancel_run(run, reason)
    print(format_status(run))


def trainer_running(run: RunDir, ids: dict[str, str]) -> bool:
    """Whether the job that holds the run's trainer is running (the run unfinished)."""
    if run.complete.exists() or run.failure.exists():
        return False
    job = ids.get("trainer") or ids.get("run")
    if job is None:
        return False
    state = job_states([job]).get(job)
    return state is not None and state.state.split()[0] == "RUNNING"


def checkpoint_first(run: RunDir) -> int | None:
    """Ask the trainer to checkpoint the step under way and stop; wait for it up to the
    plan's signal delay (a step and a checkpoint, with a margin). The step it checkpointed
    at, or None when it did not within that time."""
    budget = float(max(CANCEL_CHECKPOINT_S, run.load_config().cluster.signal_delay_s or 0))
    print(
        f"asking the trainer to checkpoint the step under way, then cancelling (waiting up to "
        f"{budget:.0f} s; force=true cancels at once)",
        flush=True,
    )
    run.control.mkdir(exist_ok=True)
    run.checkpoint_request.touch()
    deadline = time.monotonic() + budget
    while time.monotonic() < deadline:
        if run.checkpointed.exists():
            step = int(run.checkpointed.read_text())
            print(f"the trainer checkpointed at step {step}", flush=True)
            return step
        if run.complete.exists() or run.failure.exists():
            break
        time.sleep(CANCEL_POLL_S)
    print(f"no checkpoint within {budget:.0f} s: cancelling anyway", flush=True)
    return None
