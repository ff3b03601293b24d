"""Run planning: one pure function from a composed config to every process of the run.

`plan` first refuses what cannot work (launcher/plan/checks.py), then sizes the run and refuses what
does not fit (launcher/plan/costs/fit.py), then builds each process (queue, orchestrator, inference
replicas and their routers, the trainer's torchrun) with its argv and environment, and each
Slurm job's resources; vLLM's arguments come from rl/inference/vllm/args.py. So a bad combination
fails before anything starts and the plan a dry run prints is exactly what the launcher
executes. The values the roles derive too (backend, served length, learning rate, mesh
degrees) come from rl/core/derive.py, so the plan and the roles cannot disagree. No torch, no
I/O but `nvidia-smi`.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from omegaconf import DictConfig

from launcher.clusters.base import Job, Process, cluster_of
from launcher.errors import PlanError
from launcher.plan.checks import check_bounds, check_run
from launcher.plan.costs.figures import estimate_notes
from launcher.plan.costs.fit import (
    Footprint,
    decide,
    disaggregated,
    fill_gpus,
    per_node,
    replica_gpus,
    shared_gpu,
    shared_split,
    size_run,
)
from rl.core.config import ROLE_MODULES, TORCHRUN_MODULE, Placement
from rl.core.derive import (
    broadcast_backend,
    inexact,
    learning_rate,
    max_model_len,
    weight_transport,
)
from rl.core.rundir import RunDir
from rl.core.runtime import inference_name, on_node
from rl.inference.engines import engine_of
from rl.inference.vllm.args import PD_INSTANCES

RUN_ARGS = ["--run-dir", "${RELAY_RUN_DIR}"]
"""Every role's arguments: its run directory, which each process's environment names."""

# Both roles of a shared placement see the one GPU as their device 0.
SHARED_DEVICE = {"CUDA_VISIBLE_DEVICES": "0"}


# glibc's malloc returns every large block to the kernel when it is freed and maps it afresh on
# the next allocation: each forward and backward then pays page faults on all its activations
# (about 10% of a CPU trainer step, measured). Keep freed memory in the heap instead.
CPU_ALLOCATOR = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
}


@dataclass
class RunPlan:
    """Every process of a run, where it runs, and the values derived for it."""

    run_name: str
    cluster: str
    backend: str
    processes: list[Process]
    jobs: list[Job]
    trainer_world_size: int
    mesh: dict[str, int]
    lr: float
    max_model_len: int
    broadcast_backend: str
    batch_size: int
    notes: list[str]
    inexact: list[str] = field(default_factory=list)
    """What makes the run depend on more than its config, seed and layout (rl/core/derive.py)."""
    config: Any = field(default=None, repr=False, compare=False)
    """The config as planned: the one given, with every value the plan decided filled in (the
    GPUs found, the weight transport, the trainer's options, the signal delay); what the run
    directory records and the roles load."""

    def to_json(self) -> str:
        plan = {k: v for k, v in asdict(self).items() if k != "config"}
        return json.dumps(plan, indent=2)

    def role(self, role: str) -> list[Process]:
        return [p for p in self.processes if p.role == role]


def plan(cfg: DictConfig, service: bool = False) -> RunPlan:
    """Turn a composed run config into a RunPlan, or raise PlanError naming the bad key.

    A point of a sweep that shares inference (`inference.shared`) plans its queue,
    orchestrator and trainer; `service=True` plans that sweep's inference service alone.

    The config given is left as it is: the plan decides on a copy, returned as its `config`."""
    cfg = copy.deepcopy(cfg)
    check_bounds(cfg)
    cluster = cluster_of(cfg)
    found = fill_gpus(cfg)
    try:
        engine = engine_of(cfg)
    except ValueError as err:
        raise PlanError(str(err)) from None
    transport = weight_transport(cfg, cluster.spans_nodes)  # recorded for the roles
    decide(cfg.inference, "weight_transport", transport)
    notes = [note for note in (found, *check_run(cfg)) if note]
    size = size_run(cfg)
    estimates = estimate_notes(cfg, size)
    devices = LocalDevices(cfg, size.shared_gpu)
    processes = [
        *control_processes(),
        *inference_processes(cfg, size, devices),
        trainer_process(cfg, size, devices),
    ]
    processes, jobs = cluster.place(size, processes)
    if cfg.inference.shared:  # the sweep's inference service, or a point's own roles
        processes, jobs, shared_notes = sweep_share(processes, jobs, service)
        notes += shared_notes
    notes += size.notes + cluster.notes() + estimates
    env = cfg.environment
    return RunPlan(
        run_name=cfg.name,
        cluster=cfg.cluster.name,
        backend=engine.name,
        processes=processes,
        jobs=jobs,
        trainer_world_size=size.mesh["world"],
        mesh=size.mesh,
        lr=learning_rate(cfg),
        max_model_len=max_model_len(cfg),
        broadcast_backend=broadcast_backend(cfg).value,
        batch_size=env.prompts_per_step * env.group_size,
        notes=notes,
        inexact=inexact(cfg) + engine.inexact(),
        config=cfg,
    )


def control_processes() -> list[Process]:
    """The queue and the orchestrator (a Slurm run's control job)."""
    return [
        Process(
            "queue", "queue", ["python", "-m", ROLE_MODULES["queue"], *RUN_ARGS], job="control"
        ),
        Process(
            "orchestrator",
            "orchestrator",
            ["python", "-m", ROLE_MODULES["orchestrator"], *RUN_ARGS],
            job="control",
        ),
    ]


def cpu_env(cfg: DictConfig) -> dict[str, str]:
    """A CPU role's threads and allocator. On a CPU node trainer and inference run side by
    side: split the cores between them instead of letting both oversubscribe every core;
    colocated, they take turns, each with every core. On Slurm each job has nodes of its own."""
    whole = cluster_of(cfg).spans_nodes or cfg.placement == Placement.colocated
    cpus = cfg.cluster.cpus_per_node
    threads = cfg.cluster.omp_threads or (cpus if whole else cpus // 2)
    return {"OMP_NUM_THREADS": str(max(1, threads)), **CPU_ALLOCATOR}


def inference_processes(cfg: DictConfig, size: Footprint, devices: LocalDevices) -> list[Process]:
    """Every inference replica: one server each, or a prefill and a decode instance with a
    router in front; a replica spanning nodes is a head and a headless process per other
    node. Instances needing part of a node are packed onto Slurm nodes, each bound to its own
    GPUs of that node."""
    spans, gpus = cluster_of(cfg).spans_nodes, cfg.cluster.gpus_per_node
    nodes = size.replica_nodes
    # A replica spanning nodes takes every GPU of each.
    each = gpus if spans and nodes > 1 else replica_gpus(cfg)
    packed = per_node(cfg, nodes)
    instances = list(PD_INSTANCES) if disaggregated(cfg) else [None]
    placed = [(i, part) for i in range(cfg.parallel.inference.replicas) for part in instances]
    processes = []
    for k, (i, part) in enumerate(placed):
        name = inference_name(i, part)
        env = devices.take(each) if gpus else cpu_env(cfg)
        if spans and gpus:  # numbered within the node (a spanning replica's: all of them)
            low = (k % packed) * each
            env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(low, low + each)))}
        first = (k // packed) * nodes if spans else 0
        processes += replica_processes(cfg, i, part, name, nodes, first, each, env)
    if disaggregated(cfg):  # each replica's router, beside its prefill head
        for i in range(cfg.parallel.inference.replicas):
            prefill = next(p for p in processes if p.name == inference_name(i, "prefill"))
            argv = ["python", "-m", ROLE_MODULES["router"], *RUN_ARGS, "--replica", str(i)]
            processes.append(
                Process("router", inference_name(i), argv, job="inference", node=prefill.node)
            )
    return processes


def replica_processes(
    cfg: DictConfig,
    replica: int,
    part: str | None,
    name: str,
    nodes: int,
    first: int,
    gpus: int,
    env: dict[str, str],
) -> list[Process]:
    """One inference instance: its head, then one headless process per further node."""
    argv = ["python", "-m", ROLE_MODULES["inference"], *RUN_ARGS, "--replica", str(replica)]
    if part:
        argv += ["--instance", part]
    if nodes > 1:
        argv += ["--nodes", str(nodes)]
    share = shared_split(cfg).utilization if shared_gpu(cfg) else None  # beside the trainer
    engine = engine_of(cfg)
    served = engine.server_args(nodes, PD_INSTANCES.get(part or ""), name, share)
    processes = []
    for rank in range(nodes):
        node_argv = [*argv, "--node", str(rank)] if rank else list(argv)
        if served:
            node_argv += ["--", *served]
            if nodes > 1:
                node_argv += engine.node_args(nodes, rank)
        processes.append(
            Process(
                "inference",
                on_node(name, rank),
                node_argv,
                env=dict(env),
                job="inference",
                gpus_per_node=gpus,
                node=first + rank,
                head=first if nodes > 1 else None,
            )
        )
    return processes


def trainer_process(cfg: DictConfig, size: Footprint, devices: LocalDevices) -> Process:
    """torchrun on every trainer node, each running its share of the mesh's ranks (Relay's
    torchrun, rl/trainer/torchrun.py: the ranks stay in the role's process group)."""
    spans, gpus = cluster_of(cfg).spans_nodes, cfg.cluster.gpus_per_node
    ranks = size.mesh["world"] // size.trainer_nodes
    torchrun = ["python", "-m", TORCHRUN_MODULE, "--nproc-per-node", str(ranks)]
    if size.trainer_nodes > 1 or spans:
        port = cfg.cluster.master_port
        torchrun += [
            "--nnodes", str(size.trainer_nodes), "--node-rank", "${RELAY_NODE_RANK}",
            "--master-addr", "${RELAY_MASTER_ADDR}",
            "--master-port", "${RELAY_MASTER_PORT}" if port is None else str(port),
        ]  # fmt: skip
    else:
        torchrun.append("--standalone")
    trainer_devices = devices.take(ranks)
    if spans:  # every node of the trainer's job: its first `ranks` GPUs
        trainer_devices = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(ranks)))}
    return Process(
        "trainer",
        "trainer",
        [*torchrun, "-m", ROLE_MODULES["trainer"], *RUN_ARGS],
        env={"OMP_NUM_THREADS": "1", **trainer_devices} if gpus else cpu_env(cfg),
        job="trainer",
        nodes=size.trainer_nodes,
        gpus_per_node=ranks if gpus else 0,
    )


def sweep_share(
    processes: list[Process], jobs: list[Job], service: bool
) -> tuple[list[Process], list[Job], list[str]]:
    """A point of a sweep sharing inference keeps its queue, orchestrator and trainer (and on
    Slurm their jobs); the sweep's service keeps the inference processes and job."""
    kept = ("inference", "router") if service else ("queue", "orchestrator", "trainer")
    processes = [p for p in processes if p.role in kept]
    jobs = [j for j in jobs if (j.name == "inference") == service]
    notes = (
        []
        if service
        else [
            "inference: the sweep's shared service (inference/ beside the points), serving this "
            "point's adapter under the point's name"
        ]
    )
    return processes, jobs, notes


class LocalDevices:
    """The GPUs of this machine handed out in order, so that no two roles of a local run use
    the same one (except in shared placement, where both use GPU 0); on Slurm each job has
    nodes of its own and Slurm sets the devices."""

    def __init__(self, cfg: DictConfig, shared: bool) -> None:
        self.local = not cluster_of(cfg).spans_nodes
        self.shared = shared
        self.next = 0

    def take(self, count: int) -> dict[str, str]:
        if not self.local:
            return {}
        if self.shared:
            return dict(SHARED_DEVICE)
        ids = range(self.next, self.next + count)
        self.next += count
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}


def plan_header(p: RunPlan, cfg: DictConfig, resume: RunDir | None = None) -> str:
    """The plan in one line: what runs where, how long, with what learning rate; for a
    `resume`, what its trainer picks up from rather than the warm-up it no longer runs."""
    replicas = cfg.parallel.inference.replicas
    inference = f"x{replicas}" + (" (shared by the sweep)" if cfg.inference.shared else "")
    steps = (f"{cfg.max_steps} steps of {p.batch_size} samples" if cfg.max_steps else
             "no RL step, an eval of version 0")  # fmt: skip
    return (
        f"run {p.run_name} on cluster={p.cluster}: {steps}, trainer world {p.trainer_world_size} "
        f"(mesh {', '.join(f'{k}={v}' for k, v in p.mesh.items() if k != 'world')}), "
        f"{optimiser(p, cfg)}, inference backend {p.backend} {inference}, "
        f"async_level {cfg.algorithm.async_level}, placement {cfg.placement}, "
        f"{warm_up(cfg, resume)}, seed {cfg.seed}, "
        + ("reproducible" if not p.inexact else f"not reproducible ({'; '.join(p.inexact)})")
    )


def optimiser(p: RunPlan, cfg: DictConfig) -> str:
    """What trains: the learning rate and its schedule, the loss, and LoRA where it is on."""
    algo = cfg.algorithm
    said = f"lr {p.lr:g}"
    if algo.lr_warmup_steps:
        said += f" after {algo.lr_warmup_steps} steps rising to it"
    if algo.lr_schedule != "constant":
        said += f" then {algo.lr_schedule} to 0"
    if algo.updates_per_batch > 1:
        said += f", {algo.updates_per_batch} optimiser steps a batch"
    said += f", loss {algo.loss}"
    if cfg.model.lora.rank:
        said += f", LoRA rank {cfg.model.lora.rank} (only the adapter trains)"
    return said


def warm_up_line(cfg: DictConfig, resume: RunDir | None = None) -> str | None:
    """The supervised warm-up in plain words, where the trainer runs one: it comes before RL,
    and version 0 (the first eval) is the model after it."""
    if not cfg.warmup.steps or (resume is not None and resume.latest_checkpoint() is not None):
        return None
    return (
        f"warm-up: {cfg.warmup.steps} supervised steps on the environment's answers before RL "
        "(version 0, the first eval, is the model after them; warmup.steps=0 starts RL from "
        "the model as it is)"
    )


def warm_up(cfg: DictConfig, resume: RunDir | None) -> str:
    """The warm-up the trainer runs: none on a resume from a checkpoint (the trainer loads
    it), all of it again on a resume before the first checkpoint."""
    checkpoint = resume.latest_checkpoint() if resume is not None else None
    if checkpoint is not None:
        return f"no warm-up (resumes from checkpoint {checkpoint.name})"
    if not cfg.warmup.steps:
        return "no warm-up"
    again = " again (no checkpoint yet)" if resume is not None else ""
    return f"warm-up {cfg.warmup.steps} steps{again}"


def format_plan(p: RunPlan, cfg: DictConfig) -> str:
    """The plan as a readable table for `dry_run=true`."""
    lines = [plan_header(p, cfg)]
    if said := warm_up_line(cfg):
        lines.append(said)
    if p.jobs:
        cluster = cluster_of(cfg)
        lines.append("")
        header = f"{'job':<10} {'nodes':>5} {'gpus/node':>9} {'cpus':>5} {'mem':>7} {'time':>6}"
        lines.append(f"{header}  {cluster.where_label}")
        for j in p.jobs:
            mem = f"{j.mem_gb}GB" if j.mem_gb else "all"
            lines.append(
                f"{j.name:<10} {j.nodes:>5} {j.gpus_per_node:>9} {j.cpus_per_task:>5} "
                f"{mem:>7} {j.time_min:>5}m  {cluster.where(j)}"
            )
        lines += cluster.describe(p)
    lines.append("")
    lines.append(f"{'process':<26} {'job':<10} {'node':>5} {'gpus/node':>9}  command")
    for proc in p.processes:
        env = " ".join(f"{k}={v}" for k, v in proc.env.items())
        cmd = shell_join(proc.argv)
        first, last = proc.node, proc.node + proc.nodes - 1
        where = str(first) if first == last else f"{first}-{last}"
        lines.append(
            f"{proc.name:<26} {proc.job:<10} {where:>5} {proc.gpus_per_node:>9}  "
            f"{(env + ' ') if env else ''}{cmd}"
        )
    if any(proc.head is not None for proc in p.processes):
        lines.append(
            "note: ${RELAY_HEAD_ADDR} and ${RELAY_HEAD_PORT} are the address of a replica's "
            "head node and the port its other nodes join it on (each node's supervisor sets them)"
        )
    for note in p.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


SAFE = re.compile(r"^[\w@%+=:,./-]+$|^\$\{\w+\}$")


def shell_join(argv: list[str]) -> str:
    """`argv` as a command a shell runs as planned: arguments quoted where the shell would
    change them (JSON, spaces), `${VAR}` placeholders left for the shell to expand."""
    return " ".join(a if SAFE.match(a) else shlex.quote(a) for a in argv)
