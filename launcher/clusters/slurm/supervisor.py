"""The role supervisor each Slurm job runs on each of its nodes (one submitit task per node).

It starts its job's roles from the plan in the run directory (with the node's address, the
trainer's rendezvous taken from the allocation), then watches three things until the run ends:
its own roles, the other jobs of the run (through Slurm's controller, or its accounting
database for jobs the controller has forgotten), and the run directory's `failure.json`. A
role that fails, or another job that ends badly, cancels the whole run with the reason
recorded. When Slurm asks for a checkpoint (SIGUSR2 before the time limit, or on preemption)
the trainer checkpoints at its current step and submitit requeues the job; the restarted
trainer resumes from that checkpoint, and requeued control or inference jobs pick up from the
queue's store. A SIGTERM (`scontrol requeue`, node loss, scancel) gets the same checkpoint,
within Slurm's KillWait. A job with no work left is never requeued.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import submitit

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
from launcher.clusters.slurm import cli as slurm_cli
from launcher.clusters.slurm.jobs import node_env
from launcher.errors import ConfigError
from launcher.watch.report import finish_run
from launcher.watch.tracking import Follow
from rl.core.rundir import SERVICE, RunDir, point_dirs, shared_service, write_atomic
from rl.core.runtime import (
    CHECKPOINT_ON_TERM_ENV,
    RUN_DIR_ENV,
    load_run_config,
    setup_logging,
)

SUPERVISE_S = 1.0  # how often the supervisor looks at its roles, the run and its peers
PEER_POLL_S = 5.0
# States a job can leave again (a preempted or failed node's job may be requeued).
REQUEUABLE = ("PREEMPTED", "NODE_FAIL")
REQUEUE_GRACE_S = 90.0
STARTED = ("RUNNING", "COMPLETING", "COMPLETED")
CANCEL_WAIT_S = 60.0
# The least the trainer may take to checkpoint after a SIGTERM (else the plan's estimate);
# Slurm's SIGKILL follows after its KillWait (30 s by default), which ends the wait sooner
# (the plan warns where KillWait is shorter than the checkpoint needs).
TERM_CHECKPOINT_S = 60.0
# Ports a replica spanning nodes is joined on at its head (vLLM's data-parallel RPC or
# torch.distributed port): one per job and head node, away from the trainer's (20000-39999).
HEAD_PORT_BASE = 40000
HEAD_PORT_RANGE = 20000


def all_points_ended(sweep_dir: Path) -> bool:
    """Whether every point of a shared-inference sweep has finished or failed."""
    points = map(RunDir, point_dirs(sweep_dir))
    return all(p.complete.exists() or p.failure.exists() for p in points)


class RunEnded(RuntimeError):
    """The run failed or was cancelled; `failure.json` says why."""


# Named for what they hold: a job's roles and one node's supervisor ("group" in Relay is an RL
# group, the completions of one prompt).
class JobRoles(submitit.helpers.Checkpointable):
    """What submitit runs in each job: `JobRoles(run_dir, job)()` on every node of the job.

    submitit pickles it on the login node and the job unpickles it by its module path
    (`launcher.clusters.slurm.supervisor.JobRoles`), so it stays a top-level class of this module.
    """

    def __init__(self, run_dir: str, job: str) -> None:
        self.run_dir, self.job = run_dir, job

    def __getstate__(self) -> dict[str, Any]:
        return {"run_dir": self.run_dir, "job": self.job}

    def __call__(self) -> None:
        self._supervisor = NodeSupervisor(RunDir(Path(self.run_dir)), self.job)
        try:
            self._supervisor.run()
        except RunEnded as end:
            # Said in one line, not a traceback: a job whose own role failed ends FAILED; one
            # ended with the run (a cancel, another job's failure) ends as Slurm ended it.
            self._supervisor.log.warning("%s", end)
            if self._supervisor.failed_here:
                raise SystemExit(1) from None

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """submitit calls this on SIGUSR2 (time limit or preemption) and requeues what it
        returns: this job, whose roles resume from the run directory when it starts again.

        A job with nothing left to do (the run complete or ended, or this job's part of it
        done) is not requeued: it ends here, as it would have a moment later. (Returning None
        would make submitit end the job FAILED, which the other jobs take for a failure.)
        """
        supervisor = getattr(self, "_supervisor", None)
        if supervisor is not None:
            supervisor.stop_for_requeue()
        if nothing_left(RunDir(Path(self.run_dir)), self.job):
            raise SystemExit(0)
        return super().checkpoint(*args, **kwargs)


def nothing_left(run: RunDir, job: str) -> bool:
    """Whether `job` has no more work in the run: it ended, or the job's part of it is done
    (a per_role trainer job's steps; for any other job, the whole run with its report)."""
    if run.complete.exists() or run.failure.exists():
        return True
    return job == "trainer" and run.done("trainer").exists()


def restart_key() -> str:
    """This start of this job: its id and how often Slurm has requeued it."""
    return f"{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"


def free_port() -> int:
    """A port free on this node now (the trainer's rendezvous: derived from the job id, it
    could collide with another run's on a shared node)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def bind_devices(planned: str, allocated: str | None) -> str:
    """The GPUs a process gets: the plan numbers a node's GPUs from 0; Slurm may have given
    the job other ones (CUDA_VISIBLE_DEVICES=4,5,6,7 without device cgroups), so the plan's
    i-th is the job's i-th."""
    if not allocated:
        return planned
    ours = allocated.split(",")
    wanted = [int(i) for i in planned.split(",")]
    if max(wanted) >= len(ours):
        raise ConfigError(f"the plan binds GPUs {planned} but Slurm gave this job only {allocated}")
    return ",".join(ours[i] for i in wanted)


class NodeSupervisor:
    """One node of one job: starts the node's roles and watches them and the other jobs."""

    def __init__(self, rundir: RunDir, job: str) -> None:
        self.rundir, self.job = rundir, job
        self.node = int(os.environ.get("SLURM_NODEID", "0"))
        self.job_id = os.environ["SLURM_JOB_ID"]
        self.cfg = load_run_config(rundir.root)
        self.plan = rundir.read_plan()
        self.log = setup_logging(f"{job}-node{self.node}")  # every node's, the first's too
        self.children: list[Child] = []
        self.stopping = False
        self.bad_since: dict[str, float] = {}
        timeouts = self.cfg.timeouts
        self.liveness = Liveness(rundir, timeouts.hung_s, timeouts.ready_s)
        self.follow: Follow | None = None  # the control job logs the run's metrics live
        self.failed_here = False  # one of this job's roles failed (it ends FAILED)
        rundir.control.mkdir(exist_ok=True)

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
        nodes = slurm_cli.hostnames(os.environ["SLURM_JOB_NODELIST"])
        here = slurm_cli.node_address(os.environ.get("SLURMD_NODENAME", nodes[self.node]))
        values = {
            RUN_DIR_ENV: str(self.rundir.root),
            "RELAY_TOKEN": self.rundir.token(),
            "RELAY_HOST": here,
            "RELAY_NODE_RANK": str(self.node - proc["node"]),
            "SLURM_NODEID": str(self.node),
            CHECKPOINT_ON_TERM_ENV: "1",
            **node_env(self.cfg, here),
        }
        if proc["role"] == "trainer":
            values["RELAY_MASTER_ADDR"] = slurm_cli.node_address(nodes[proc["node"]])
            values["RELAY_MASTER_PORT"] = str(self.master_port(first=self.node == proc["node"]))
        return values

    def master_port(self, first: bool) -> int:
        """The trainer's rendezvous port: `cluster.master_port`, or one free on its first
        node, which that node's supervisor picks and the others read from the run
        directory (one file per start of the job)."""
        if self.cfg.cluster.master_port:
            return int(self.cfg.cluster.master_port)
        path = self.rundir.control / f"master_port.{restart_key()}"
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
        nodes = slurm_cli.hostnames(os.environ["SLURM_JOB_NODELIST"])
        port = HEAD_PORT_BASE + (int(self.job_id) * 64 + head) % HEAD_PORT_RANGE
        return {
            "RELAY_HEAD_ADDR": slurm_cli.node_address(nodes[head]),
            "RELAY_HEAD_PORT": str(port),
        }

    def start(self) -> None:
        if self.runs("trainer"):  # a request from before a requeue is answered already
            for marker in (self.rundir.checkpoint_request, self.rundir.checkpointed):
                marker.unlink(missing_ok=True)
        self.rundir.logs.mkdir(exist_ok=True)
        for proc in self.processes():
            values = self.environment(proc)
            if proc.get("head") is not None:  # a node of a replica spanning nodes
                values = {**values, **self.head_values(proc["head"])}
            env = {**os.environ, **proc["env"], **values}
            if planned := proc["env"].get("CUDA_VISIBLE_DEVICES"):  # among the job's own GPUs
                allocated = os.environ.get("CUDA_VISIBLE_DEVICES")
                env["CUDA_VISIBLE_DEVICES"] = bind_devices(planned, allocated)
            rank = self.node - proc["node"]
            name = proc["name"] if proc["role"] != "trainer" else f"trainer-node{rank}"
            argv = expand(proc["argv"], values)
            self.children.append(spawn(name, proc["role"], argv, env, self.rundir.log(name)))
            node = os.environ.get("SLURMD_NODENAME", "?")
            self.log.info(
                "started %s on %s (%s): %s", name, node, values["RELAY_HOST"], " ".join(argv)
            )

    # --- watch -----------------------------------------------------------------------------

    def is_service(self) -> bool:
        """Whether this job is a shared-inference sweep's service (not a run of its own)."""
        return self.cfg.inference.shared and self.rundir.root.name == SERVICE

    def peers(self) -> dict[str, str]:
        jobs = slurm_cli.read_jobs(self.rundir)
        peers = {name: job_id for name, job_id in jobs.items() if name != self.job}
        if self.cfg.inference.shared and not self.is_service():
            # A sweep point's servers are the sweep's shared inference: its job is waited for
            # and watched (it failing ends this point), never cancelled from here.
            service = slurm_cli.read_jobs(RunDir(shared_service(self.rundir.root)))
            peers.update({f"shared {name}": job_id for name, job_id in service.items()})
        return peers

    def check_peers(self, peers: dict[str, str]) -> dict[str, slurm_cli.JobState]:
        """Each peer job's state; cancels the run when one has ended badly."""
        try:
            states = slurm_cli.job_states(list(peers.values()))
        except ConfigError as err:  # the accounting database did not answer: ask again later
            self.log.warning("could not read job states: %s", err)
            return {}
        now = time.monotonic()
        for name, job_id in peers.items():
            state = states.get(job_id)
            if state is None or not slurm_cli.ended_badly(state.state):
                self.bad_since.pop(name, None)
                continue
            first = self.bad_since.setdefault(name, now)
            if state.state.split()[0] in REQUEUABLE and now - first < REQUEUE_GRACE_S:
                continue  # Slurm may requeue it
            self.fail(f"job {name} ({job_id}) ended {state.state}", name, cancel_self=True)
        return states

    def wait_for_peers(self, peers: dict[str, str]) -> None:
        """Start the roles only once every other job of the run has started (a run that is one
        job has none to wait for), for at most `timeouts.co_start_s`: past it the run is
        cancelled, naming the jobs that did not start and why. Node 0 of the job asks Slurm
        and records that they started; its other nodes read that. A job Slurm does not list yet
        (or while neither the controller nor the accounting answers) is waited for like a
        pending one."""
        if not peers:
            return
        started = self.rundir.control / f"peers_started.{self.job}.{restart_key()}"
        deadline = time.monotonic() + self.cfg.timeouts.co_start_s
        if self.node != 0:
            while not started.exists():
                self.check_failure()
                time.sleep(PEER_POLL_S)
            return
        last_note = 0.0
        unlisted = slurm_cli.JobState("not listed yet", "", "", "Slurm has no state for it")
        while True:
            states = self.check_peers(peers)
            waiting = {
                name: states.get(job_id, unlisted)
                for name, job_id in peers.items()
                if states.get(job_id, unlisted).state.split()[0] not in STARTED
            }
            if not waiting:
                started.touch()
                return
            said = ", ".join(f"{n} ({s.state}, {s.reason})" for n, s in waiting.items())
            if time.monotonic() > deadline:
                self.fail(
                    f"jobs did not start together within {self.cfg.timeouts.co_start_s:g} s "
                    f"(timeouts.co_start_s): {said}",
                    self.job,
                    cancel_self=True,
                )
            if time.monotonic() - last_note > 30:
                self.log.info("waiting for jobs to start: %s", said)
                last_note = time.monotonic()
            self.check_failure()
            time.sleep(PEER_POLL_S)

    def check_failure(self) -> None:
        reason = slurm_cli.failure_reason(self.rundir)
        if reason is not None:
            raise RunEnded(f"the run ended: {reason}")

    def fail(self, reason: str, job: str, cancel_self: bool = False) -> None:
        """Record why (if nobody has yet), cancel the run's jobs, and end this one.

        When another job ended, this one is cancelled with the rest; when one of this job's
        roles failed, this job ends FAILED and the others are cancelled.
        """
        self.log.error("%s: cancelling the run", reason)
        self.failed_here = not cancel_self
        slurm_cli.record_failure(self.rundir, reason, job)
        ids = list(slurm_cli.read_jobs(self.rundir).values())
        others = [job_id for job_id in ids if job_id != self.job_id]
        slurm_cli.slurm("scancel", *others, *([self.job_id] if cancel_self else []), check=False)
        if cancel_self:  # end as CANCELLED, not FAILED: wait for Slurm's SIGTERM (bounded)
            deadline = time.monotonic() + CANCEL_WAIT_S
            while not self.stopping and time.monotonic() < deadline:
                time.sleep(POLL_S)
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
                continue  # stopped by Slurm or for a requeue: neither done nor failed
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
                self.fail(f"in job {self.job} ({self.job_id}): {err}", self.job)
        return finished

    def checkpoint_requested(self) -> bool:
        """Whether a checkpoint request is pending. One older than any checkpoint budget is
        stale (whoever asked has given up) and counts for nothing: the trainer job
        removes it, so that a trainer it restarts does not stop again at once."""
        request = self.rundir.checkpoint_request
        try:
            age = time.time() - request.stat().st_mtime
        except FileNotFoundError:
            return False
        if age <= max(self.checkpoint_budget_s(), TERM_CHECKPOINT_S) + SUPERVISE_S:
            return True
        if self.runs("trainer"):
            self.log.warning("removing a stale checkpoint request (%.0f s old)", age)
            request.unlink(missing_ok=True)
        return False

    def checkpoint_budget_s(self) -> float:
        """How long the trainer may take to checkpoint when Slurm warns of the time limit."""
        return max(10.0, self.cfg.cluster.signal_delay_s - 30.0)

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
        except Exception as err:  # a supervisor bug or Slurm answering nonsense: say so
            self.fail(f"in job {self.job} ({self.job_id}): supervisor error: {err!r}", self.job)
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
            if self.stopping:  # Slurm's SIGTERM: the roles have stopped (the trainer after
                self.log.info("stopped as Slurm asked")  # its checkpoint); so does this node
                return
            if self.follow is not None:
                self.follow.poll()
            self.check_failure()
            if self.finished(self.check_children()):
                self.log.info("this node's part of the run is over")
                return
            # Node 0 of each job asks Slurm about the others; every node reads failure.json.
            if peers and self.node == 0 and time.monotonic() - last_peer_check > PEER_POLL_S:
                self.check_peers(peers)
                last_peer_check = time.monotonic()
            time.sleep(SUPERVISE_S)

    def _terminated(self, signum: int, frame: object) -> None:
        """scancel, `scontrol requeue`, node loss, preemption or the time limit: the roles are
        ending too; that is not a role failure. As on SIGUSR2, the trainer first checkpoints
        the step it is on (within Slurm's KillWait), so that a requeued or resumed run redoes
        no step. The other jobs see this job's state and record the cause."""
        if self.stopping:
            return
        self.log.warning("SIGTERM from Slurm: this job is being cancelled, requeued or preempted")
        self.checkpoint_and_stop(max(TERM_CHECKPOINT_S, self.checkpoint_budget_s()))

    # --- requeue ---------------------------------------------------------------------------

    def stop_for_requeue(self) -> None:
        """Called by submitit on SIGUSR2 (time limit or preemption)."""
        if not self.stopping:
            self.checkpoint_and_stop(self.checkpoint_budget_s())

    def checkpoint_and_stop(self, budget: float) -> None:
        """The trainer checkpoints at the step it is on (waited for up to `budget` seconds);
        the other roles keep their place in the run directory (queue store, orchestrator
        through the queue) and stop. In a run that is one job every node is told together:
        the queue and the inference servers then wait for the trainer's checkpoint (the step
        under way needs them) before they stop."""
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
        elif self.children and self.trainer_first_node() >= 0:  # the trainer is in this job
            self.rundir.checkpoint_request.touch()
            deadline = time.monotonic() + budget
            ended = (self.rundir.checkpointed, self.rundir.complete, self.rundir.failure)
            while time.monotonic() < deadline and not any(p.exists() for p in ended):
                time.sleep(POLL_S)
            self.log.info("stopping after the trainer's checkpoint")
        stop_children(self.children)
        self.children = []
