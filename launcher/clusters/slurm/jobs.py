"""A Slurm run's jobs: what each asks of Slurm, and what its script does before its step.

The jobs and the nodes of each role come from launcher/clusters/layout.py. With one job
(`cluster.allocation=one`) every role starts once all the nodes are granted, or none does, and
a requeue moves them together; per_role jobs' supervisors wait for each other
(`timeouts.co_start_s`).

What each job asks:
- `--requeue` always: a site's JobRequeue default may be off, and a preempted or timed-out run
  resumes from its checkpoint;
- a job on whole GPU nodes: `--exclusive --mem=0` (all of each node); one that uses part of a
  node's GPUs: that share of the node's CPUs and memory, not all of them;
- a per_role control job: `cluster.cpu_partition`, `cpu_account`, `cpu_qos` only;
- no wckey unless `cluster.wckey` is set.

Before its step each job runs the site's `cluster.setup` lines and exports `cluster.env`; its
srun gets `cluster.srun_args` and, with pyxis, `--container-image`/`--container-mounts`. Each
node's supervisor adds per node what only the node knows
(launcher/clusters/slurm/supervisor.py: its address as vLLM's NIXL side channel host, the NCCL
and gloo interface).
"""

from __future__ import annotations

import shlex
from typing import Any

from omegaconf import DictConfig

from launcher.clusters.base import Job, node_env

UNLIMITED_REQUEUES = 10**6
"""submitit's bound on requeues after a time limit where `cluster.max_requeues` sets none."""


def job_name(run_name: str, job: Job, point: int | None) -> str:
    """A job's name: the run's, a sweep point's number, and the job's role in per_role."""
    parts = [run_name, *([str(point)] if point is not None else [])]
    if job.name != "run":
        parts.append(job.name)
    return "-".join(parts)


def setup_lines(cfg: DictConfig) -> list[str]:
    """What each job's script runs before its step: the site's lines, then its variables."""
    c = cfg.cluster
    exports = [f"export {key}={shlex.quote(str(value))}" for key, value in c.env.items()]
    return [*c.setup, *exports]


def srun_args(cfg: DictConfig) -> list[str]:
    """The further arguments of each job's srun: the site's, and pyxis's container."""
    c = cfg.cluster
    args = list(c.srun_args)
    if c.container_image:
        args.append(f"--container-image={c.container_image}")
    if c.container_mounts:
        args.append(f"--container-mounts={','.join(c.container_mounts)}")
    return args


def node_env_line(cfg: DictConfig) -> str:
    return " ".join(f"{key}={value}" for key, value in node_env(cfg).items())


def sbatch_parameters(
    job: Job, run_name: str, cfg: DictConfig, point: int | None = None
) -> dict[str, Any]:
    """submitit's SlurmExecutor parameters for one job (one supervisor task per node)."""
    params: dict[str, Any] = {
        "job_name": job_name(run_name, job, point),
        "nodes": job.nodes,
        "ntasks_per_node": 1,
        "cpus_per_task": job.cpus_per_task,
        "mem": f"{job.mem_gb}GB" if job.mem_gb else "0",
        "time": job.time_min,
        "signal_delay_s": cfg.cluster.signal_delay_s,
        "stderr_to_stdout": True,
        "wckey": cfg.cluster.wckey,  # submitit writes its own unless given None
    }
    optional = {
        "partition": job.partition,
        "account": job.account,
        "qos": job.qos,
        "constraint": job.constraint,
        "gpus_per_node": job.gpus_per_node or None,
        "exclusive": True if job.exclusive else None,
        "setup": setup_lines(cfg) or None,
        "srun_args": srun_args(cfg) or None,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    return params


def additional_parameters(job: Job) -> dict[str, Any]:
    """sbatch options submitit has no parameter for: `--requeue`, and the site's extra."""
    return {"requeue": True, **job.sbatch_extra}


def sbatch_flags(job: Job, run_name: str, cfg: DictConfig) -> str:
    """The job's sbatch options as a dry run shows them."""
    params = sbatch_parameters(job, run_name, cfg)
    params["signal"] = f"USR2@{params.pop('signal_delay_s')}"
    for key in ("stderr_to_stdout", "setup", "srun_args"):
        params.pop(key, None)
    if params.get("wckey") is None:
        params.pop("wckey", None)
    params.update(additional_parameters(job))
    flags = []
    for key, value in params.items():
        flag = "--" + key.replace("_", "-")
        flags.append(flag if value is True else f"{flag}={value}")
    return " ".join(flags)


def max_requeues(cfg: DictConfig) -> int:
    """submitit's `max_num_timeout`: `cluster.max_requeues`, or no limit."""
    limit = cfg.cluster.max_requeues
    return UNLIMITED_REQUEUES if limit is None else int(limit)
