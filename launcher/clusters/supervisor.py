"""The role supervisor a scheduler runs on each node of a run's job: a Slurm job's task
(launcher/clusters/slurm/supervisor.py) or a Kubernetes pod (launcher/clusters/kubernetes/pod.py).

It starts its job's roles from the plan in the run directory (with the node's address, and
the trainer's rendezvous on the role's first node), then watches until the run ends: its own
roles, the run directory's `failure.json`, and where the scheduler can say, the run's other
jobs. A role that fails (past `max_restarts`), or another job that ends badly, ends the whole
run with the reason recorded. Asked to stop (a signal before a time limit, preemption, a
cancel), the trainer first checkpoints at the step it is on, so that the run resumes without
redoing a step.

What differs by scheduler is behind a few methods a subclass gives: which node of its job it
is, its own and the other nodes' addresses, what names this start of the job, and how it
knows and cancels the other jobs.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from launcher.clusters.base import checkpoint_budget_s, node_env, term_budget_s
from launcher.clusters.processes import (
    FINISHING_ROLES,
    POLL_S,
    Child,
    Liveness,
    RunFailed,
    expand,
    restart_or_fail,
    spawn,
    stop_children,
)
from launcher.errors import ConfigError
from launcher.watch.report import finish_run
from launcher.watch.tracking import Follow
from rl.core.rundir import SERVICE, RunDir, point_dirs, write_atomic
from rl.core.runtime import CHECKPOINT_ON_TERM_ENV, RUN_DIR_ENV, load_run_config, setup_logging

SUPERVISE_S = 1.0  # how often the supervisor looks at its roles, the run and its peers
PEER_POLL_S = 5.0
# Ports a replica spanning nodes is joined on at its head (vLLM's data-parallel RPC or
# torch.distributed port): away from the trainer's (20000-39999).
HEAD_PORT_BASE = 40000
HEAD_PORT_RANGE = 20000


def all_points_ended(sweep_dir: Path) -> bool:
    """Whether every point of a shared-inference sweep has finished or failed."""
    points = map(RunDir, point_dirs(sweep_dir))
    return all(p.complete.exists() or p.failure.exists() for p in points)


class RunEnded(RuntimeError):
    """The run failed or was cancelled; `failure.json` says why."""


def nothing_left(run: RunDir, job: str) -> bool:
    """Whether `job` has no more work in the run: it ended, or the job's part of it is done
    (a per_role trainer job's steps; for any other job, the whole run with its report)."""
    if run.complete.exists() or run.failure.exists():
        return True
    return job == "trainer" and run.done("trainer").exists()


def free_port() -> int:
    """A port free on this node now (the trainer's rendezvous: derived from the job id, it
    could collide with another run's on a shared node)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


class RoleSupervisor:
    """One node of one job: starts the node's roles and watches them and the run.

    A scheduler's subclass says where it runs (`address`, `here`, `start_key`, `node_name`)
    and how it knows its peers (`peers`, `check_peers`, `wait_for_peers`, `cancel_jobs`)."""

    scheduler = "the scheduler"
    """Who sends this supervisor its signals, for its log."""
    stops_together = False
    """Whether a stop reaches every node of a job at once (so that a node without the trainer
    waits for its checkpoint before its roles stop)."""

    def __init__(self, rundir: RunDir, job: str, node: int) -> None:
        self.rundir, self.job, self.node = rundir, job, node
        self.cfg = load_run_config(rundir.root)
        self.plan = rundir.read_plan()
        self.log = setup_logging(f"{job}-node{self.node}")  # every node's, the first's too
        self.children: list[Child] = []
        self.stopping = False
        timeouts = self.cfg.timeouts
        self.liveness = Liveness(rundir, timeouts.hung_s, timeouts.ready_s)
        self.follow: Follow | None = None  # the control job logs the run's metrics live
        self.failed_here = False  # one of this job's roles failed (it ends FAILED)
        rundir.control.mkdir(exist_ok=True)

    # --- where it runs: given by the scheduler ----------------------------------------------

    def here(self) -> str:
        """This node's address, as the other nodes reach it."""
        raise NotImplementedError

    def address(self, node: int) -> str:
        """The address of node `node` of this job."""
        raise NotImplementedError

    def start_key(self) -> str:
        """What names this start of this node's job (a requeue or a new pod is another)."""
        raise NotImplementedError

    def node_name(self) -> str:
        """This node's name, for the log."""
        raise NotImplementedError

    def head_port(self, head: int) -> int:
        """The port the nodes of a replica spanning nodes join its head on (node `head`)."""
        return HEAD_PORT_BASE + head % HEAD_PORT_RANGE

    def peers(self) -> dict[str, str]:
        """The run's other jobs, by name, with what the scheduler knows them by."""
        return {}

    def check_peers(self, peers: dict[str, str]) -> Any:
        """Fail the run where one of `peers` has ended badly (where the scheduler can say)."""

    def wait_for_peers(self, peers: dict[str, str]) -> None:
        """Return once every job of `peers` has started (or fail the run)."""

    def cancel_jobs(self, cancel_self: bool) -> None:
        """Ask the scheduler to end the run's other jobs (and this one, with `cancel_self`)."""

    # --- start -----------------------------------------------------------------------------

    def processes(self) -> list[dict[str, Any]]:
        """The plan's processes this node runs: inference instances on the node the plan put
        them (several share a node when each needs part of its GPUs; a replica spanning nodes
        starts a process on each), the control roles on the first node of theirs, and the
        trainer's torchrun on every node from its first (`nodes` of them)."""
        return [
            proc
            for proc in self.plan["processes"]
            if proc["job"] == self.job
            and proc["node"] <= self.node < proc["node"] + proc.get("nodes", 1)
        ]

    def runs(self, role: str) -> bool:
        return any(proc["role"] == role for proc in self.processes())

    def environment(self, proc: dict[str, Any]) -> dict[str, str]:
        """What a process's command line and environment read: the run, this node's address
        (vLLM's NIXL side channel too, and the network interface where one is named), its node
        rank among its role's nodes, and the trainer's rendezvous on the role's first node."""
        here = self.here()
        values = {
            RUN_DIR_ENV: str(self.rundir.root),
            "RELAY_TOKEN": self.rundir.token(),
            "RELAY_HOST": here,
            "RELAY_NODE_RANK": str(self.node - proc["node"]),
            CHECKPOINT_ON_TERM_ENV: "1",
            **node_env(self.cfg, here),
        }
        if proc["role"] == "trainer":
            values["RELAY_MASTER_ADDR"] = self.address(proc["node"])
            values["RELAY_MASTER_PORT"] = str(self.master_port(first=self.node == proc["node"]))
        return values

    def master_port(self, first: bool) -> int:
        """The trainer's rendezvous port: `cluster.master_port`, or one free on its first
        node, which that node's supervisor picks and the others read from the run
        directory (one file per start of the job)."""
        if self.cfg.cluster.master_port:
            return int(self.cfg.cluster.master_port)
        path = self.rundir.control / f"master_port.{self.start_key()}"
        if first:
            write_atomic(path, str(free_port()))
        deadline = time.monotonic() + self.cfg.timeouts.peer_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise ConfigError(f"the trainer's first node did not write {path}")
            self.check_failure()
            time.sleep(POLL_S)
        return int(path.read_text())

    def head_values(self, head: int) -> dict[str, str]:
        """Where the other nodes of a replica spanning nodes find its head: the head node's
        address, and a port of the job's own (one per head node, so replicas never share)."""
        return {"RELAY_HEAD_ADDR": self.address(head), "RELAY_HEAD_PORT": str(self.head_port(head))}

    def role_env(self, proc: dict[str, Any], values: dict[str, str]) -> dict[str, str]:
        """A process's environment: this one's, the plan's variables for it, and `values`."""
        return {**os.environ, **proc["env"], **values}

    def start(self) -> None:
        if self.runs("trainer"):  # a request from before a restart is answered already
            for marker in (self.rundir.checkpoint_request, self.rundir.checkpointed):
                marker.unlink(missing_ok=True)
        self.rundir.logs.mkdir(exist_ok=True)
        for proc in self.processes():
            values = self.environment(proc)
            if proc.get("head") is not None:  # a node of a replica spanning nodes
                values = {**values, **self.head_values(proc["head"])}
            env = self.role_env(proc, values)
            rank = self.node - proc["node"]
            name = proc["name"] if proc["role"] != "trainer" else f"trainer-node{rank}"
            argv = expand(proc["argv"], values)
            self.children.append(spawn(name, proc["role"], argv, env, self.rundir.log(name)))
            self.log.info(
                "started %s on %s (%s): %s",
                name,
                self.node_name(),
                values["RELAY_HOST"],
                " ".join(argv),
            )

    # --- watch -----------------------------------------------------------------------------

    def is_service(self) -> bool:
        """Whether this job is a shared-inference sweep's service (not a run of its own)."""
        return self.cfg.inference.shared and self.rundir.root.name == SERVICE

    def check_failure(self) -> None:
        reason = self.rundir.failure_reason()
        if reason is not None:
            raise RunEnded(f"the run ended: {reason}")

    def fail(self, reason: str, job: str, cancel_self: bool = False) -> None:
        """Record why (if nobody has yet), end the run's other jobs, and end this one.

        When another job ended, this one is cancelled with the rest; when one of this job's
        roles failed, this job ends failed and the others are cancelled.
        """
        self.log.error("%s: cancelling the run", reason)
        self.failed_here = not cancel_self
        self.rundir.record_failure(reason, job)
        self.cancel_jobs(cancel_self)
        self.stopping = True
        raise RunEnded(reason)

    def check_children(self) -> list[Child]:
        """The roles that finished cleanly; a role that died, or hung (no heartbeat for
        `timeouts.hung_s`: launcher/clusters/processes.py's Liveness), is restarted, within
        `max_restarts`, and past that fails the run."""
        finished = []
        for child in self.children:
            if not self.stopping and child.proc.poll() is None:
                self.liveness.kill_if_hung(child)
            code = child.proc.poll()
            if code is None:
                continue
            if self.stopping:
                continue  # stopped by the scheduler or for a requeue: neither done nor failed
            if child.role == "trainer" and (
                self.checkpoint_requested() or self.rundir.checkpointed.exists()
            ):
                continue  # it checkpointed and stopped, as asked: neither done nor failed
            if code == 0 and child.role in FINISHING_ROLES:
                finished.append(child)
                continue
            try:
                restart_or_fail(child, code, self.cfg.max_restarts)
            except RunFailed as err:
                self.fail(f"in job {self.job} ({self.job_label()}): {err}", self.job)
        return finished

    def job_label(self) -> str:
        """This job as the scheduler knows it, for the failure's reason."""
        return self.start_key()

    def checkpoint_requested(self) -> bool:
        """Whether a checkpoint request is pending. One older than any checkpoint budget is
        stale (whoever asked has given up) and counts for nothing: the trainer job
        removes it, so that a trainer it restarts does not stop again at once."""
        request = self.rundir.checkpoint_request
        try:
            age = time.time() - request.stat().st_mtime
        except FileNotFoundError:
            return False
        if age <= term_budget_s(self.cfg) + SUPERVISE_S:
            return True
        if self.runs("trainer"):
            self.log.warning("removing a stale checkpoint request (%.0f s old)", age)
            request.unlink(missing_ok=True)
        return False

    def checkpoint_budget_s(self) -> float:
        """How long the trainer may take to checkpoint when warned of the time limit."""
        return checkpoint_budget_s(self.cfg)

    def finished(self, done: list[Child]) -> bool:
        """Whether this node's part of the run is over: a trainer node's once its trainer is
        done (its first node records it); a node with the control roles reports the run and
        marks it complete once the trainer and the orchestrator are done; any other node's
        (inference) once the run is complete."""
        ended = {child.role for child in done}
        if "trainer" in ended and self.node == self.trainer_first_node():
            self.rundir.mark_done("trainer")
        if self.is_service():  # serves until every point of the sweep has ended
            if all_points_ended(self.rundir.root.parent):
                self.rundir.complete.touch()
            return self.rundir.complete.exists()
        if {p["role"] for p in self.processes()} == {"trainer"}:
            return "trainer" in ended or self.rundir.done("trainer").exists()
        if "orchestrator" in ended:
            self.rundir.mark_done("orchestrator")
        if self.runs("orchestrator") and not self.rundir.complete.exists():
            if not all(self.rundir.done(role).exists() for role in FINISHING_ROLES):
                return False
            self.report()
            self.rundir.complete.touch()
        return self.rundir.complete.exists()

    def trainer_first_node(self) -> int:
        trainer = [p for p in self.plan["processes"] if p["role"] == "trainer"]
        return trainer[0]["node"] if trainer and trainer[0]["job"] == self.job else -1

    def report(self, status: str = "finished") -> None:
        """Log what is left to wandb, end the wandb run and write the run's summary."""
        mode = self.follow.close(exit_code=0 if status == "finished" else 1) if self.follow else ""
        self.follow = None
        started = self.rundir.config.stat().st_mtime
        finish_run(self.cfg, self.rundir, time.time() - started, mode, status)

    def run(self) -> None:
        previous = signal.signal(signal.SIGTERM, self._terminated)
        try:
            self.supervise()
        except (RunEnded, SystemExit):
            raise
        except Exception as err:  # a supervisor bug or a scheduler answering nonsense: say so
            reason = f"in job {self.job} ({self.job_label()}): supervisor error: {err!r}"
            self.fail(reason, self.job)
        finally:
            stop_children(self.children)
            signal.signal(signal.SIGTERM, previous)
            if self.follow is not None:  # the run failed, or this job stops for a requeue
                self.report("failed" if self.rundir.failure.exists() else "stopped")

    def supervise(self) -> None:
        """Wait for the other jobs, start this node's roles and watch until the run ends."""
        peers = self.peers()
        self.wait_for_peers(peers)
        self.start()
        if self.runs("orchestrator"):
            self.follow = Follow(self.cfg, self.rundir, echo=True)
        last_peer_check = time.monotonic()
        while True:
            if self.stopping:  # a SIGTERM: the roles have stopped (the trainer after its
                self.log.info("stopped as %s asked", self.scheduler)  # checkpoint)
                return
            if self.follow is not None:
                self.follow.poll()
            self.check_failure()
            self.on_tick()
            if self.finished(self.check_children()):
                self.log.info("this node's part of the run is over")
                return
            # Node 0 of each job asks about the others; every node reads failure.json.
            if peers and self.node == 0 and time.monotonic() - last_peer_check > PEER_POLL_S:
                self.check_peers(peers)
                last_peer_check = time.monotonic()
            time.sleep(SUPERVISE_S)

    def on_tick(self) -> None:
        """What a scheduler's supervisor checks on each look beyond the roles (a deadline)."""

    def _terminated(self, signum: int, frame: object) -> None:
        """A cancel, requeue, node loss, preemption or the time limit: the roles are ending
        too; that is not a role failure. The trainer first checkpoints the step it is on
        (within the scheduler's grace period), so that a resumed run redoes no step."""
        if self.stopping:
            return
        self.log.warning(
            "SIGTERM from %s: this job is being cancelled, requeued or preempted", self.scheduler
        )
        self.checkpoint_and_stop(term_budget_s(self.cfg))

    # --- stop ---------------------------------------------------------------------------

    def checkpoint_and_stop(self, budget: float, together: bool | None = None) -> None:
        """The trainer checkpoints at the step it is on (waited for up to `budget` seconds);
        the other roles keep their place in the run directory (queue store, orchestrator
        through the queue) and stop. Where every node is told `together` (a run that is one
        Slurm job, a time limit), the queue and the inference servers wait for the trainer's
        checkpoint (the step under way needs them) before they stop."""
        together = self.stops_together if together is None else together
        self.stopping = True
        if self.runs("trainer") and self.children:
            self.rundir.checkpoint_request.touch()
            deadline = time.monotonic() + budget
            while time.monotonic() < deadline and any(c.proc.poll() is None for c in self.children):
                time.sleep(POLL_S)
            marker = self.rundir.checkpointed
            if marker.exists():
                self.log.info("trainer checkpointed at step %s; stopping", marker.read_text())
            else:
                self.log.warning("trainer stopped without checkpointing (waited %.0f s)", budget)
        elif together and self.children and self.trainer_first_node() >= 0:
            self.rundir.checkpoint_request.touch()
            deadline = time.monotonic() + budget
            ended = (self.rundir.checkpointed, self.rundir.complete, self.rundir.failure)
            while time.monotonic() < deadline and not any(p.exists() for p in ended):
                time.sleep(POLL_S)
            self.log.info("stopping after the trainer's checkpoint")
        stop_children(self.children)
        self.children = []
