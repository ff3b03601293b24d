"""The `Cluster` interface: what the planner and the `rl` command ask of the place a run's
processes start, and the registry that picks one by `cluster.kind`.

A cluster answers, at plan time, whether its processes span nodes of their own (a scheduler's
nodes, each job's devices set on its nodes) or share this machine (its GPUs handed out by the
plan), which scheduler jobs hold the plan's processes, its notes and limits; and, at run time,
how to start, resume and check a run on it, including a sweep's shared base and shared
inference. Each cluster is a folder of `launcher/clusters/` with a class derived from
`Cluster`, registered by name in `CLUSTERS` (or with `register`): the planner reaches it
through `cluster_of`, the one place that reads `cluster.kind`. The classes are imported by
name when first asked for, so that the planner, below them, never imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from rl.envs import load_callable

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from rl.core.rundir import RunDir


@dataclass
class Process:
    """One process the launcher starts."""

    role: str
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    job: str = "local"
    nodes: int = 1
    gpus_per_node: int = 0
    node: int = 0
    """The first of its job's nodes it runs on (the trainer runs on `nodes` nodes from it)."""
    head: int | None = None
    """For each process of an inference replica spanning nodes (one per node): the node of the
    replica's head, whose address and port the others join (`${RELAY_HEAD_ADDR}`,
    `${RELAY_HEAD_PORT}`)."""


@dataclass
class Job:
    """One job a scheduler runs (on Slurm the whole run, or in per_role the control, inference
    or trainer job) with its resources; its processes name it (`Process.job`)."""

    name: str
    nodes: int
    gpus_per_node: int
    cpus_per_task: int
    mem_gb: int
    """Memory per node in GB; 0: all of each node's (`--mem=0`)."""
    time_min: int
    partition: str | None
    account: str | None
    qos: str | None
    constraint: str | None
    sbatch_extra: dict[str, Any] = field(default_factory=dict)
    exclusive: bool = False


NODE_ADDRESS = "<the node's address>"


def node_env(cfg: DictConfig | Any, address: str = NODE_ADDRESS) -> dict[str, str]:
    """What each node's supervisor sets for its roles, beyond the plan's own variables: vLLM's
    NIXL side channel on the node's own address (its default, localhost, fails prefill and
    decode across nodes), and NCCL's and gloo's interface where `cluster.network_interface`
    names one."""
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": address}
    if interface := cfg.cluster.network_interface:
        env |= {"NCCL_SOCKET_IFNAME": interface, "GLOO_SOCKET_IFNAME": interface}
    return env


TERM_CHECKPOINT_S = 60.0
"""The least a supervisor waits for the trainer's checkpoint after a SIGTERM (else the plan's
estimate); the scheduler's SIGKILL follows after its grace (Slurm's KillWait, a pod's
terminationGracePeriodSeconds), which ends the wait sooner."""


def checkpoint_budget_s(cfg: Any) -> float:
    """How long the trainer may take to checkpoint when warned of a time limit: the plan's
    signal delay (a step and a checkpoint, with a margin) less a margin for stopping."""
    return max(10.0, cfg.cluster.signal_delay_s - 30.0)


def term_budget_s(cfg: Any) -> float:
    """How long a supervisor waits for the trainer's checkpoint after a SIGTERM."""
    return max(TERM_CHECKPOINT_S, checkpoint_budget_s(cfg))


class Cluster:
    """A place to run: the defaults are those of this machine, where nothing is scheduled."""

    spans_nodes: ClassVar[bool] = False
    """Whether a run's processes are placed on nodes of their own (a scheduler's), or all on
    this machine, whose GPUs the plan hands out."""

    sees_files: ClassVar[bool] = True
    """Whether the machine `rl` runs on sees what the run's processes read (`model.path`, the
    run directory's filesystem), so that it can check them before starting anything."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    # --- at plan time --------------------------------------------------------------------

    def place(self, size: Any, processes: list[Process]) -> tuple[list[Process], list[Job]]:
        """The plan's processes as this cluster runs them, and the scheduler jobs holding
        them (none: they start here)."""
        return processes, []

    def describe(self, run_plan: Any) -> list[str]:
        """What a dry run prints of the plan's jobs (`run_plan`, launcher/plan/planner.py's
        RunPlan) beyond their table: how they are submitted."""
        return []

    where_label: ClassVar[str] = "where"
    """The heading of the plan's job table's last column: where a job goes (`where`)."""

    def where(self, job: Job) -> str:
        """Where the scheduler puts `job`, as the plan's job table shows it."""
        return "-"

    def notes(self) -> list[str]:
        """What a reader of the plan should know of this cluster."""
        return []

    def time_limit_s(self) -> int | None:
        """Seconds a job of the run may run (None: no limit)."""
        return None

    def signal_limit(self) -> tuple[int, str] | None:
        """The most seconds before a time limit the checkpoint warning may come, and what
        sets it (for the refusal); None: no time limit, nothing warns."""
        return None

    # --- at run time ---------------------------------------------------------------------

    def start(self, run_plan: Any) -> None:
        """Start (or submit) the planned run."""
        raise NotImplementedError(f"cluster={self.cfg.cluster.name} cannot start a run")

    def resume(self, run_plan: Any, run: RunDir) -> None:
        """Continue the interrupted run in `run`."""
        raise NotImplementedError(f"cluster={self.cfg.cluster.name} cannot resume a run")

    def check_ended(self, run: RunDir) -> None:
        """ConfigError while any process (or job) of the run is still alive."""

    def status(self, run: RunDir) -> str | None:
        """What `rl action=status` says of the run beyond its directory; None: the
        directory says it all (launcher/watch/status.py)."""
        return None

    def manifests(self, run_plan: Any, overrides: list[str]) -> str:
        """The run as the objects this cluster would create (`rl action=manifests`)."""
        from launcher.errors import ConfigError

        raise ConfigError(
            f"action=manifests: cluster={self.cfg.cluster.name} creates no objects to print; "
            f"it is Kubernetes' (cluster=kubernetes)"
        )

    def cancel(self, run: RunDir, force: bool) -> None:
        """End the run (`rl action=cancel`), its trainer first checkpointing unless `force`."""
        from launcher.errors import ConfigError

        raise ConfigError(
            f"run_dir={run.root}: a run on this machine; stop it with Ctrl-C where it runs "
            f"(the trainer checkpoints first)"
        )

    def start_base(self, run: RunDir) -> str | None:
        """A sweep's shared base, where this cluster builds it apart from the points: the id
        of the job building it, which the points' jobs start after; None: the caller warms
        it up here."""
        return None

    def run_shared(self, points: list[Any], sweep_dir: Any, token: str) -> int | None:
        """A sweep sharing inference, where this cluster runs it apart: how many points did
        not finish; None: the caller runs it here."""
        return None


CLUSTERS: dict[str, str | type[Cluster]] = {
    "local": "launcher.clusters.local.cluster:Local",
    "slurm": "launcher.clusters.slurm.cluster:Slurm",
    "kubernetes": "launcher.clusters.kubernetes.cluster:Kubernetes",
}
"""Every cluster by `cluster.kind`: its class, or where to import it from (`module:Class`)."""


def register(kind: str, cluster: str | type[Cluster]) -> None:
    """Make `cluster.kind=<kind>` run on `cluster` (a class, or `module:Class`)."""
    CLUSTERS[kind] = cluster


def cluster_of(cfg: DictConfig | Any) -> Cluster:
    """The cluster `cfg.cluster.kind` names, for this run."""
    kind = str(cfg.cluster.kind)
    if kind not in CLUSTERS:
        from launcher.errors import refuse

        refuse(f"cluster.kind={kind}", f"no such cluster; known: {', '.join(sorted(CLUSTERS))}")
    found = CLUSTERS[kind]
    if isinstance(found, str):  # imported once, when first asked for
        found = CLUSTERS[kind] = load_callable(found, f"cluster.kind={kind}")
    return found(cfg)
