"""Slurm from a login node: check the plan against the cluster, submit it, look at it later.

`submit` asks the cluster what it has (partitions, their nodes' CPUs, memory and GPUs, the
user's accounts and QOS) and fails before anything is submitted when a job cannot fit. It then
submits one job per role group with submitit, each held until all are in (so a failed
submission leaves no job running and no run directory), records their ids in `jobs.json` and
returns. Every job runs `launcher.supervisor.RoleGroup`, which starts that group's roles,
watches the other jobs and cancels the run when one of them fails.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from launcher.errors import ConfigError
from launcher.plan import Job, RunPlan

# Job states after which a job will not run again (a requeued job passes through PENDING).
ENDED_BADLY = (
    "BOOT_FAIL",
    "CANCELLED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
)
JOBS_FILE = "jobs.json"
FAILURE_FILE = "failure.json"
COMPLETE_FILE = "complete"


def slurm(*args: str, check: bool = True) -> str:
    """Run a Slurm client command; its stdout, or ConfigError with what it printed."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise ConfigError(
            f"cluster=slurm: `{args[0]}` not found; submit from a Slurm login node "
            f"(nothing was started here)"
        ) from None
    if check and done.returncode:
        message = (done.stderr or done.stdout).strip().splitlines()
        raise ConfigError(f"`{' '.join(args)}` failed: {message[-1] if message else done}")
    return done.stdout


@dataclass
class Partition:
    name: str
    default: bool
    nodes: int
    max_nodes: int | None
    cpus: int
    mem_mb: int
    gpus: int


def partitions() -> dict[str, Partition]:
    """Every partition with the largest CPU, memory and GPU counts among its nodes."""
    found: dict[str, Partition] = {}
    for line in slurm("scontrol", "show", "partition", "-o").splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if "PartitionName" not in fields:
            continue
        name = fields["PartitionName"]
        max_nodes = fields.get("MaxNodes", "UNLIMITED")
        found[name] = Partition(
            name=name,
            default=fields.get("Default") == "YES",
            nodes=int(fields.get("TotalNodes", 0)),
            max_nodes=None if max_nodes == "UNLIMITED" else int(max_nodes),
            cpus=0,
            mem_mb=0,
            gpus=0,
        )
    for line in slurm("sinfo", "-h", "-N", "-o", "%R|%c|%m|%G").splitlines():
        name, cpus, mem, gres = line.strip().split("|")
        part = found.get(name)
        if part is None:
            continue
        part.cpus = max(part.cpus, int(cpus.rstrip("+")))
        part.mem_mb = max(part.mem_mb, int(mem.rstrip("+")))
        part.gpus = max(part.gpus, _gpus(gres))
    return found


def _gpus(gres: str) -> int:
    """GPUs in a node's Gres string such as `gpu:h100:8(S:0-1),shard:4` or `(null)`."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def _sacctmgr_names(*args: str) -> set[str] | None:
    """Names sacctmgr lists, or None when the cluster keeps no accounting to ask."""
    out = subprocess.run(
        ["sacctmgr", "-n", "-P", *args], capture_output=True, text=True, timeout=60
    )
    if out.returncode:
        return None
    return {line.strip() for line in out.stdout.splitlines() if line.strip()}


def preflight(cfg: DictConfig, run_plan: RunPlan) -> str:
    """Check the jobs against what the cluster reports; returns the partition to use."""
    parts = partitions()
    names = ", ".join(sorted(parts))
    if cfg.cluster.partition:
        part = parts.get(cfg.cluster.partition)
        if part is None:
            raise ConfigError(
                f"cluster.partition={cfg.cluster.partition}: the cluster has no such "
                f"partition (it has: {names})"
            )
    else:
        defaults = [p for p in parts.values() if p.default]
        if not defaults:
            raise ConfigError(
                f"cluster.partition: not set and the cluster has no default partition; "
                f"choose one of: {names}"
            )
        part = defaults[0]
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
                f"cluster.gpus_per_node={job.gpus_per_node}: job {job.name} asks for "
                f"{job.gpus_per_node} GPUs per node; partition {part.name}'s nodes have at most "
                f"{part.gpus}"
            )
        if job.cpus_per_task > part.cpus:
            raise ConfigError(
                f"cluster.cpus_per_node={job.cpus_per_task}: job {job.name} asks for "
                f"{job.cpus_per_task} CPUs per node; partition {part.name}'s nodes have at most "
                f"{part.cpus}"
            )
        if job.mem_gb * 1024 > part.mem_mb:
            raise ConfigError(
                f"cluster.mem_gb_per_node={job.mem_gb}: job {job.name} asks for {job.mem_gb} GB "
                f"per node; partition {part.name}'s nodes have at most {part.mem_mb} MB"
            )
    user = getpass.getuser()
    if cfg.cluster.account:
        accounts = _sacctmgr_names("show", "assoc", "where", f"user={user}", "format=Account")
        if accounts is not None and cfg.cluster.account not in accounts:
            raise ConfigError(
                f"cluster.account={cfg.cluster.account}: user {user} has no such account on "
                f"this cluster (has: {', '.join(sorted(accounts)) or 'none'})"
            )
    if cfg.cluster.qos:
        qos = _sacctmgr_names("show", "qos", "format=Name")
        if qos is not None and cfg.cluster.qos not in qos:
            raise ConfigError(
                f"cluster.qos={cfg.cluster.qos}: the cluster has no such QOS "
                f"(has: {', '.join(sorted(qos))})"
            )
    return part.name


def sbatch_parameters(job: Job, run_name: str, cfg: DictConfig) -> dict[str, Any]:
    """submitit's SlurmExecutor parameters for one job (one supervisor task per node)."""
    params: dict[str, Any] = {
        "job_name": f"{run_name}-{job.name}",
        "nodes": job.nodes,
        "ntasks_per_node": 1,
        "cpus_per_task": job.cpus_per_task,
        "mem": f"{job.mem_gb}GB",
        "time": job.time_min,
        "signal_delay_s": cfg.cluster.signal_delay_s,
        "stderr_to_stdout": True,
    }
    optional = {
        "partition": job.partition,
        "account": job.account,
        "qos": job.qos,
        "constraint": job.constraint,
        "gpus_per_node": job.gpus_per_node or None,
        "exclusive": True if job.exclusive else None,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    return params


def sbatch_flags(job: Job, run_name: str, cfg: DictConfig) -> str:
    """The job's sbatch options as a dry run shows them."""
    params = sbatch_parameters(job, run_name, cfg)
    params["signal"] = f"USR2@{params.pop('signal_delay_s')}"
    params.pop("stderr_to_stdout")
    params.update(job.sbatch_extra)
    flags = []
    for key, value in params.items():
        flag = "--" + key.replace("_", "-")
        flags.append(flag if value is True else f"{flag}={value}")
    return " ".join(flags)


def submit(cfg: DictConfig, run_plan: RunPlan) -> Path:
    """Submit the run's jobs and return its directory; nothing is left behind on failure."""
    from launcher.local import prepare_run_dir
    from launcher.report import sweep_group

    partition = preflight(cfg, run_plan)
    if cfg.wandb.group is None:
        with open_dict(cfg):
            cfg.wandb.group = sweep_group()
    run_dir, _ = prepare_run_dir(cfg, run_plan)
    try:
        _submit_jobs(cfg, run_plan, run_dir, partition)
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return run_dir


def resubmit(cfg: DictConfig, run_plan: RunPlan, run_dir: Path) -> None:
    """Submit the jobs of an ended run again; its roles pick up from the run directory."""
    ids = read_jobs(run_dir)
    states = job_states(list(ids.values()))
    live = [name for name, i in ids.items() if i in states and not _ended(states[i].state)]
    if live:
        raise ConfigError(
            f"resume={run_dir}: jobs {', '.join(live)} are still queued or running "
            f"(rl action=cancel run_dir={run_dir} first)"
        )
    partition = preflight(cfg, run_plan)
    history = run_dir / "ended"
    history.mkdir(exist_ok=True)
    attempt = len(list(history.glob("jobs-*.json")))
    (run_dir / JOBS_FILE).rename(history / f"jobs-{attempt}.json")
    if (run_dir / FAILURE_FILE).exists():
        (run_dir / FAILURE_FILE).rename(history / f"failure-{attempt}.json")
    for marker in ("done/trainer", "done/orchestrator", COMPLETE_FILE):
        (run_dir / marker).unlink(missing_ok=True)
    _submit_jobs(cfg, run_plan, run_dir, partition)


def _ended(state: str) -> bool:
    return state.split()[0] in (*ENDED_BADLY, "COMPLETED")


def _submit_jobs(cfg: DictConfig, run_plan: RunPlan, run_dir: Path, partition: str) -> None:
    """Submit every job held, record the ids, release them together; on any failure cancel
    what was submitted and raise ConfigError."""
    import submitit

    from launcher.supervisor import RoleGroup

    ids: dict[str, str] = {}
    try:
        for job in run_plan.jobs:
            executor = submitit.SlurmExecutor(
                folder=run_dir / "slurm" / job.name, max_num_timeout=cfg.cluster.max_requeues
            )
            extra = {"hold": True, **job.sbatch_extra}
            executor.update_parameters(
                **sbatch_parameters(job, run_plan.run_name, cfg), additional_parameters=extra
            )
            ids[job.name] = executor.submit(RoleGroup(str(run_dir), job.name)).job_id
        write_json(run_dir / JOBS_FILE, {"partition": partition, "jobs": ids})
        slurm("scontrol", "release", ",".join(ids.values()))
    except BaseException as err:
        if ids:
            slurm("scancel", *ids.values(), check=False)
        if isinstance(err, Exception):
            lines = str(err).strip().splitlines() or [type(err).__name__]
            raise ConfigError(f"submission failed, nothing left queued: {lines[-1]}") from None
        raise
    print(f"run directory: {run_dir}")
    for name, job_id in ids.items():
        print(f"submitted job {job_id}: {run_plan.run_name}-{name} (partition {partition})")
    print(f"status: rl action=status run_dir={run_dir}")


def write_json(path: Path, value: Any) -> None:
    """Write JSON atomically (several jobs read the run directory while it is written)."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=2))
    tmp.rename(path)


def read_jobs(run_dir: Path) -> dict[str, str]:
    try:
        return json.loads((run_dir / JOBS_FILE).read_text())["jobs"]
    except FileNotFoundError:
        return {}


@dataclass
class JobState:
    state: str
    nodes: str
    elapsed: str
    reason: str


def job_states(ids: list[str]) -> dict[str, JobState]:
    """Each job's current state from the accounting database (a requeued job's newest run)."""
    if not ids:
        return {}
    out = slurm(
        "sacct",
        "-n",
        "-P",
        "-X",
        "-j",
        ",".join(ids),
        "-o",
        "JobID,State,NodeList,Elapsed,Reason",
    )
    states = {}
    for line in out.splitlines():
        job_id, state, nodes, elapsed, reason = line.split("|")
        states[job_id] = JobState(state, nodes, elapsed, reason)
    return states


def ended_badly(state: str) -> bool:
    return state.split()[0] in ENDED_BADLY


def record_failure(run_dir: Path, reason: str, job: str | None = None) -> bool:
    """Record why the run ended, once (the first job to notice wins); True if this call did."""
    record = {"reason": reason, "job": job}
    try:
        fd = os.open(run_dir / FAILURE_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(record, f, indent=2)
    return True


def cancel_run(run_dir: Path, reason: str, job: str | None = None) -> None:
    """Record the reason and cancel every job of the run that is still queued or running."""
    record_failure(run_dir, reason, job)
    ids = read_jobs(run_dir)
    if ids:
        slurm("scancel", *ids.values(), check=False)


def latest_records(run_dir: Path) -> tuple[dict | None, dict | None]:
    """The newest train record and the newest eval record in metrics.jsonl."""
    from launcher.report import read_records

    records = read_records(run_dir / "metrics.jsonl")
    train = [r for r in records if "reward/mean" in r]
    evals = [r for r in records if "eval/exact_match" in r]
    newest = lambda rs: max(rs, key=lambda r: r["step"]) if rs else None  # noqa: E731
    return newest(train), newest(evals)


def format_status(run_dir: Path) -> str:
    from omegaconf import OmegaConf

    max_steps = OmegaConf.load(run_dir / "config.yaml").max_steps
    lines = [f"run {run_dir}"]
    ids = read_jobs(run_dir)
    if ids:
        states = job_states(list(ids.values()))
        lines.append(f"  {'job':<10} {'id':>7}  {'state':<22} {'elapsed':>9}  nodes")
        for name, job_id in ids.items():
            s = states.get(job_id, JobState("UNKNOWN", "", "", ""))
            state = s.state if s.reason in ("None", "") else f"{s.state} ({s.reason})"
            lines.append(f"  {name:<10} {job_id:>7}  {state:<22} {s.elapsed:>9}  {s.nodes}")
    train, evaluation = latest_records(run_dir)
    if train:
        lines.append(
            f"  latest step {train['step']}/{max_steps}: reward {train['reward/mean']:.3f}"
        )
    else:
        lines.append("  no trainer step yet")
    if evaluation:
        lines.append(
            f"  latest eval at version {evaluation['step']}: exact_match "
            f"{evaluation['eval/exact_match']:.3f}"
        )
    if (run_dir / COMPLETE_FILE).exists():
        lines.append("  complete")
    failure = run_dir / FAILURE_FILE
    if failure.exists():
        lines.append(f"  ended: {json.loads(failure.read_text())['reason']}")
    return "\n".join(lines)


def find_run(cfg: DictConfig, here: Path) -> Path:
    """The run `run_dir` names, or the newest run directory named like this run."""
    if cfg.run_dir:
        path = Path(cfg.run_dir)
        if not (path / "config.yaml").exists():
            raise ConfigError(f"run_dir={cfg.run_dir}: not a run directory (no config.yaml)")
        return path
    runs = [
        p.parent
        for root in (here.parent, here.parent.parent / f"{cfg.name}-sweep")
        for p in root.glob("**/config.yaml")
    ]
    if not runs:
        raise ConfigError(f"name={cfg.name}: no run found under {here.parent}; pass run_dir=")
    return max(runs, key=lambda p: (p / "config.yaml").stat().st_mtime)


def status(cfg: DictConfig, here: Path) -> None:
    run_dir = find_run(cfg, here)
    print(format_status(run_dir))


def cancel(cfg: DictConfig, here: Path) -> None:
    run_dir = find_run(cfg, here)
    if not read_jobs(run_dir):
        raise ConfigError(f"run_dir={run_dir}: not a Slurm run (no {JOBS_FILE})")
    cancel_run(run_dir, f"cancelled by {getpass.getuser()} (rl action=cancel)")
    print(format_status(run_dir))


def node_address(node: str) -> str:
    """The address other nodes reach `node` at (its NodeAddr; the name when unset)."""
    out = slurm("scontrol", "show", "node", "-o", node)
    match = re.search(r"\bNodeAddr=(\S+)", out)
    return match.group(1) if match else node


def hostnames(nodelist: str) -> list[str]:
    return slurm("scontrol", "show", "hostnames", nodelist).split()
