"""How a run's processes are laid out on a scheduler's nodes, as jobs: Slurm's and
Kubernetes' alike.

By default (`cluster.allocation=one`) a run is one job. Its nodes are split by role: first the
inference replicas' nodes (the queue and the orchestrator run beside the first replica), then
the trainer's. `per_role` keeps a control job (queue and orchestrator, no GPUs), an inference
job and a trainer job; a sweep sharing one inference service is always laid out so.

A job on whole GPU nodes asks for all of each node (`mem_gb` 0); one that uses part of a
node's GPUs, for that share of the node's CPUs and memory. The scheduler's own options (Slurm's
partition, account, QOS) are read here too, so that a job says everything a Slurm job needs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from launcher.clusters.base import Job, Process
from launcher.plan.costs.fit import Footprint, inference_nodes, pd_factor, per_node, replica_gpus
from rl.core.config import Allocation

CONTROL_CPUS = 8
CONTROL_MEM_GB = 32
"""A per_role control job's share of a node (queue and orchestrator)."""


def one_allocation(cfg: Any) -> bool:
    """Whether the run is one Slurm job (`cluster.allocation=one`, no shared inference)."""
    return cfg.cluster.allocation == Allocation.one and not cfg.inference.shared


def node_jobs(cfg: Any, size: Footprint) -> list[Job]:
    """The run's jobs with the plan's resources: one, or per role."""
    gpus = cfg.cluster.gpus_per_node
    serving = inference_nodes(cfg, size.replica_nodes)
    instances = cfg.parallel.inference.replicas * pd_factor(cfg)
    # GPUs per inference node: only those its instances use (the rest stay free for others)
    if size.replica_nodes > 1:
        used = gpus
    else:
        used = min(instances, per_node(cfg, size.replica_nodes)) * replica_gpus(cfg)
    ranks = size.mesh["world"] // size.trainer_nodes if gpus else 0
    if one_allocation(cfg):
        return [node_job(cfg, "run", serving + size.trainer_nodes, max(used, ranks))]
    return [
        control_job(cfg),
        node_job(cfg, "inference", serving, used),
        node_job(cfg, "trainer", size.trainer_nodes, ranks),
    ]


def node_job(cfg: Any, name: str, nodes: int, gpus: int) -> Job:
    """A job of GPU (or CPU) nodes: whole nodes, exclusive and with all their memory, where it
    uses every GPU of each; otherwise the share of a node's CPUs and memory its GPUs are."""
    c = cfg.cluster
    whole = not c.gpus_per_node or gpus >= c.gpus_per_node
    share = 1.0 if whole else gpus / c.gpus_per_node
    gpu_nodes = bool(c.gpus_per_node) and whole
    return Job(
        name=name,
        nodes=nodes,
        gpus_per_node=gpus,
        cpus_per_task=max(1, int(c.cpus_per_node * share)),
        mem_gb=0 if gpu_nodes else max(1, int(c.mem_gb_per_node * share)),
        time_min=c.time_min,
        partition=c.partition,
        account=c.account,
        qos=c.qos,
        constraint=c.constraint,
        sbatch_extra=dict(c.sbatch_extra),
        exclusive=gpu_nodes or bool(c.exclusive),
    )


def control_job(cfg: Any) -> Job:
    """A per_role run's control job: the queue and the orchestrator, no GPUs, with the
    `cluster.cpu_*` options only (not the GPU jobs' constraint, QOS or extra options)."""
    c = cfg.cluster
    return Job(
        name="control",
        nodes=1,
        gpus_per_node=0,
        cpus_per_task=min(CONTROL_CPUS, c.cpus_per_node),
        mem_gb=min(CONTROL_MEM_GB, c.mem_gb_per_node),
        time_min=c.time_min,
        partition=c.cpu_partition or c.partition,
        account=c.cpu_account or c.account,
        qos=c.cpu_qos,
        constraint=None,
    )


def node_layout(
    cfg: Any, size: Footprint, processes: list[Process]
) -> tuple[list[Process], list[Job]]:
    """The plan's processes placed on the run's jobs, and those jobs."""
    jobs = node_jobs(cfg, size)
    if one_allocation(cfg):  # the trainer on the nodes after the inference nodes; the
        serving = inference_nodes(cfg, size.replica_nodes)  # control beside the first replica
        processes = [in_one_job(proc, serving) for proc in processes]
    return processes, jobs


def in_one_job(proc: Process, serving: int) -> Process:
    """A process of a run that is one Slurm job: the trainer on the nodes after the
    `serving` inference nodes; the queue and orchestrator beside the first replica."""
    node = proc.node + serving if proc.role == "trainer" else proc.node
    return replace(proc, job="run", node=node)
