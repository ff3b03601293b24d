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
import time
from pathlib import Path
from typing import Any

import submitit

from launcher.clusters.processes import POLL_S
from launcher.clusters.slurm import cli as slurm_cli
from launcher.clusters.supervisor import (
    HEAD_PORT_BASE,
    HEAD_PORT_RANGE,
    PEER_POLL_S,
    RoleSupervisor,
    RunEnded,
    nothing_left,
)
from launcher.errors import ConfigError
from rl.core.rundir import RunDir, shared_service

# States a job can leave again (a preempted or failed node's job may be requeued).
REQUEUABLE = ("PREEMPTED", "NODE_FAIL")
REQUEUE_GRACE_S = 90.0
STARTED = ("RUNNING", "COMPLETING", "COMPLETED")
CANCEL_WAIT_S = 60.0


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


def restart_key() -> str:
    """This start of this job: its id and how often Slurm has requeued it."""
    return f"{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"


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


class NodeSupervisor(RoleSupervisor):
    """One node of one Slurm job: its rank and peers from Slurm's variables and clients."""

    scheduler = "Slurm"
    stops_together = True

    def __init__(self, rundir: RunDir, job: str) -> None:
        self.job_id = os.environ["SLURM_JOB_ID"]
        self.bad_since: dict[str, float] = {}
        super().__init__(rundir, job, int(os.environ.get("SLURM_NODEID", "0")))

    def here(self) -> str:
        name = os.environ.get("SLURMD_NODENAME") or self.node_host(self.node)
        return slurm_cli.node_address(name)

    def node_host(self, node: int) -> str:
        return slurm_cli.hostnames(os.environ["SLURM_JOB_NODELIST"])[node]

    def address(self, node: int) -> str:
        return slurm_cli.node_address(self.node_host(node))

    def start_key(self) -> str:
        return restart_key()

    def job_label(self) -> str:
        return self.job_id

    def node_name(self) -> str:
        return os.environ.get("SLURMD_NODENAME", "?")

    def head_port(self, head: int) -> int:
        """One per job and head node: replicas of runs sharing a node never share one."""
        return HEAD_PORT_BASE + (int(self.job_id) * 64 + head) % HEAD_PORT_RANGE

    def role_env(self, proc: dict[str, Any], values: dict[str, str]) -> dict[str, str]:
        env = {**super().role_env(proc, values), "SLURM_NODEID": str(self.node)}
        if planned := proc["env"].get("CUDA_VISIBLE_DEVICES"):  # among the job's own GPUs
            env["CUDA_VISIBLE_DEVICES"] = bind_devices(
                planned, os.environ.get("CUDA_VISIBLE_DEVICES")
            )
        return env

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

    def cancel_jobs(self, cancel_self: bool) -> None:
        """scancel the run's other jobs; with `cancel_self` this one too, ending as CANCELLED,
        not FAILED: its roles stop on Slurm's SIGTERM (waited for, bounded)."""
        ids = list(slurm_cli.read_jobs(self.rundir).values())
        others = [job_id for job_id in ids if job_id != self.job_id]
        slurm_cli.slurm("scancel", *others, *([self.job_id] if cancel_self else []), check=False)
        if cancel_self:
            deadline = time.monotonic() + CANCEL_WAIT_S
            while not self.stopping and time.monotonic() < deadline:
                time.sleep(POLL_S)

    def stop_for_requeue(self) -> None:
        """Called by submitit on SIGUSR2 (time limit or preemption)."""
        if not self.stopping:
            self.checkpoint_and_stop(self.checkpoint_budget_s())
