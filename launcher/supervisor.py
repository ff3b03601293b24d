"""The role supervisor each Slurm job runs on each of its nodes (one submitit task per node).

It starts its job's roles from the plan in the run directory (with the node's address, the
trainer's rendezvous taken from the allocation), then watches three things until the run ends:
its own roles, the other jobs of the run (through the accounting database), and the run
directory's `failure.json`. A role that fails, or another job that ends badly, cancels the
whole run with the reason recorded. When Slurm asks for a checkpoint (SIGUSR2 before the time
limit, or on preemption) the trainer checkpoints at its current step and submitit requeues
the job; the restarted trainer resumes from that checkpoint, and requeued control or
inference jobs pick up from the queue's store.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import submitit

from launcher import slurm_cli
from launcher.errors import ConfigError
from launcher.processes import (
    FINISHING_ROLES,
    Child,
    RunFailed,
    expand,
    restart_or_fail,
    spawn,
    stop_children,
)
from launcher.report import finish_run, read_records
from rl.rundir import RunDir
from rl.runtime import load_run_config, setup_logging

POLL_S = 1.0
PEER_POLL_S = 5.0
# States a job can leave again (a preempted or failed node's job may be requeued).
REQUEUABLE = ("PREEMPTED", "NODE_FAIL")
REQUEUE_GRACE_S = 90.0
STARTED = ("RUNNING", "COMPLETING", "COMPLETED")
CANCEL_WAIT_S = 60.0


class RunEnded(RuntimeError):
    """The run failed or was cancelled; `failure.json` says why."""


# Named for what they hold: a job's roles and one node's supervisor ("group" in Relay is an RL
# group, the completions of one prompt).
class JobRoles(submitit.helpers.Checkpointable):
    """What submitit runs in each job: `JobRoles(run_dir, job)()` on every node of the job.

    submitit pickles it on the login node and the job unpickles it by its module path
    (`launcher.supervisor.JobRoles`), so it stays a top-level class of this module.
    """

    def __init__(self, run_dir: str, job: str) -> None:
        self.run_dir, self.job = run_dir, job

    def __getstate__(self) -> dict[str, Any]:
        return {"run_dir": self.run_dir, "job": self.job}

    def __call__(self) -> None:
        self._supervisor = NodeSupervisor(RunDir(Path(self.run_dir)), self.job)
        self._supervisor.run()

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """submitit calls this on SIGUSR2 (time limit or preemption) and requeues what it
        returns: this job, whose roles resume from the run directory when it starts again."""
        supervisor = getattr(self, "_supervisor", None)
        if supervisor is not None:
            supervisor.stop_for_requeue()
        return super().checkpoint(*args, **kwargs)


class NodeSupervisor:
    """One node of one job: starts the node's roles and watches them and the other jobs."""

    def __init__(self, rundir: RunDir, job: str) -> None:
        self.rundir, self.job = rundir, job
        self.node = int(os.environ.get("SLURM_NODEID", "0"))
        self.job_id = os.environ["SLURM_JOB_ID"]
        self.cfg = load_run_config(rundir.root)
        self.plan = rundir.read_plan()
        self.log = setup_logging(f"{job}-node{self.node}")
        self.children: list[Child] = []
        self.stopping = False
        self.bad_since: dict[str, float] = {}
        rundir.control.mkdir(exist_ok=True)

    # --- start -----------------------------------------------------------------------------

    def processes(self) -> list[dict[str, Any]]:
        """The plan's processes this node runs: the whole trainer on every trainer node,
        inference replicas each on their first node, the control roles on node 0."""
        mine, offset = [], 0
        for proc in self.plan["processes"]:
            if proc["job"] != self.job:
                continue
            if self.job == "trainer" or offset == self.node:
                mine.append(proc)
            offset += proc["nodes"] if self.job == "inference" else 0
        return mine

    def environment(self) -> dict[str, str]:
        nodes = slurm_cli.hostnames(os.environ["SLURM_JOB_NODELIST"])
        here = os.environ.get("SLURMD_NODENAME", nodes[self.node])
        port = self.cfg.cluster.master_port or 20000 + int(self.job_id) % 20000
        return {
            "RELAY_RUN_DIR": str(self.rundir.root),
            "RELAY_TOKEN": self.rundir.token(),
            "RELAY_HOST": slurm_cli.node_address(here),
            "RELAY_MASTER_ADDR": slurm_cli.node_address(nodes[0]),
            "RELAY_MASTER_PORT": str(port),
            "SLURM_NODEID": str(self.node),
        }

    def start(self) -> None:
        if self.job == "trainer":  # a request from before a requeue is answered already
            for marker in (self.rundir.checkpoint_request, self.rundir.checkpointed):
                marker.unlink(missing_ok=True)
        values = self.environment()
        self.rundir.logs.mkdir(exist_ok=True)
        for proc in self.processes():
            env = {**os.environ, **proc["env"], **values}
            name = proc["name"] if self.job != "trainer" else f"trainer-node{self.node}"
            argv = expand(proc["argv"], values)
            self.children.append(spawn(name, proc["role"], argv, env, self.rundir.log(name)))
            self.log.info("started %s on %s: %s", name, values["RELAY_HOST"], " ".join(argv))

    # --- watch -----------------------------------------------------------------------------

    def peers(self) -> dict[str, str]:
        jobs = slurm_cli.read_jobs(self.rundir)
        return {name: job_id for name, job_id in jobs.items() if name != self.job}

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
        """Start the roles only once every other job of the run has started."""
        last_note = 0.0
        while True:
            states = self.check_peers(peers)
            waiting = {
                name: states[job_id]
                for name, job_id in peers.items()
                if job_id not in states or states[job_id].state.split()[0] not in STARTED
            }
            if not waiting:
                return
            if time.monotonic() - last_note > 30:
                self.log.info(
                    "waiting for jobs to start: %s",
                    ", ".join(f"{n} ({s.state}, {s.reason})" for n, s in waiting.items()),
                )
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
        slurm_cli.record_failure(self.rundir, reason, job)
        ids = list(slurm_cli.read_jobs(self.rundir).values())
        others = [job_id for job_id in ids if job_id != self.job_id]
        slurm_cli.slurm("scancel", *others, *([self.job_id] if cancel_self else []), check=False)
        if cancel_self:  # end as CANCELLED, not FAILED: wait for Slurm's SIGTERM (bounded)
            deadline = time.monotonic() + CANCEL_WAIT_S
            while not self.stopping and time.monotonic() < deadline:
                time.sleep(0.2)
        self.stopping = True
        raise RunEnded(reason)

    def check_children(self) -> list[Child]:
        """The roles that finished cleanly; a role that died is restarted, within
        `max_restarts`, and past that fails the run."""
        finished = []
        for child in self.children:
            code = child.proc.poll()
            if code is None:
                continue
            if self.stopping or self.rundir.checkpoint_request.exists():
                continue  # stopped for a checkpoint or by Slurm: neither done nor failed
            if code == 0 and child.role in FINISHING_ROLES:
                finished.append(child)
                continue
            try:
                restart_or_fail(child, code, self.cfg.max_restarts)
            except RunFailed as err:
                self.fail(f"in job {self.job} ({self.job_id}): {err}", self.job)
        return finished

    def finished(self, done: list[Child]) -> bool:
        """Whether this node's part of the run is over (and, for control, report it)."""
        if self.job == "trainer":
            if done and self.node == 0:
                self.rundir.mark_done("trainer")
            return bool(done)
        if self.job == "inference":
            return self.rundir.complete.exists()
        if any(c.role == "orchestrator" for c in done):
            self.rundir.mark_done("orchestrator")
        if not all(self.rundir.done(role).exists() for role in FINISHING_ROLES):
            return False
        self.report()
        self.rundir.complete.touch()
        return True

    def report(self) -> None:
        records = read_records(self.rundir.metrics)
        started = self.rundir.config.stat().st_mtime
        finish_run(self.cfg, self.rundir, records, time.time() - started)

    def run(self) -> None:
        previous = signal.signal(signal.SIGTERM, self._terminated)
        try:
            peers = self.peers()
            self.wait_for_peers(peers)
            self.start()
            last_peer_check = time.monotonic()
            while True:
                self.check_failure()
                if self.finished(self.check_children()):
                    self.log.info("this node's part of the run is over")
                    return
                if time.monotonic() - last_peer_check > PEER_POLL_S:
                    self.check_peers(peers)
                    last_peer_check = time.monotonic()
                time.sleep(POLL_S)
        finally:
            stop_children(self.children)
            signal.signal(signal.SIGTERM, previous)

    def _terminated(self, signum: int, frame: object) -> None:
        """scancel, preemption or the time limit: Slurm signals every process of the job, so
        the roles are ending too; that is not a role failure. The other jobs see this job's
        state in the accounting database and record the cause."""
        self.log.warning("SIGTERM from Slurm: this job is being cancelled or preempted")
        self.stopping = True

    # --- requeue ---------------------------------------------------------------------------

    def stop_for_requeue(self) -> None:
        """Called by submitit on SIGUSR2: the trainer checkpoints at the step it is on; the
        other roles keep their place in the run directory (queue store, orchestrator through
        the queue) and just stop."""
        self.stopping = True
        if self.job == "trainer" and self.children:
            self.rundir.checkpoint_request.touch()
            budget = max(10.0, self.cfg.cluster.signal_delay_s - 30.0)
            deadline = time.monotonic() + budget
            while time.monotonic() < deadline and any(c.proc.poll() is None for c in self.children):
                time.sleep(0.2)
            marker = self.rundir.checkpointed
            if marker.exists():
                self.log.info("trainer checkpointed at step %s; requeueing", marker.read_text())
            else:
                self.log.warning("trainer did not checkpoint in %.0f s; requeueing", budget)
        stop_children(self.children)
        self.children = []
