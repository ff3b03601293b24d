"""What each pod of a Kubernetes run runs: `python -m launcher.clusters.kubernetes.pod
--run-dir <on the volume> --config <the ConfigMap> --job <job>`.

The pod is node `JOB_COMPLETION_INDEX` of its job. Its supervisor is the one every scheduler
runs (launcher/clusters/supervisor.py), told by the pod where it is: its own address from the
Downward API, the other nodes by their Service names (`<job>-<index>.<service>`), this start
by the pod's name (a pod the Job controller recreates is a new start).

The first pod of the first job brings the run directory to the ConfigMap's submission: it
creates it (a fresh token) for the first, and for a resubmission writes the new config and
clears what the ended submission left (done markers, `complete`, `failure.json`); every other
pod waits for it. Jobs of a per_role run wait for each other through the run directory, and
end together through `failure.json`: a supervisor that sees it exits with
`EXIT_RUN_ENDED`, which the pod failure policy turns into the Job's failure.

Kubernetes warns no one of `activeDeadlineSeconds`: each supervisor stops the run itself at
`cluster.time_min` from the submission's first pod (the trainer checkpointing first,
`signal_delay_s` before), and exits with `EXIT_TIME_LIMIT`; `rl resume=` continues it. On
SIGTERM (preemption, a drain, a cancel) the trainer checkpoints the step under way and the pod
exits 143: a disrupted pod is recreated, and resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from pathlib import Path

from launcher.clusters.kubernetes.manifests import EXIT_RUN_ENDED, EXIT_TERMINATED, EXIT_TIME_LIMIT
from launcher.clusters.processes import FINISHING_ROLES
from launcher.clusters.supervisor import PEER_POLL_S, RoleSupervisor, RunEnded
from launcher.errors import ConfigError
from rl.core.rundir import RunDir, write_atomic

DEFAULT_MASTER_PORT = 29500
"""The trainer's rendezvous port: each pod has its own network namespace, so a fixed one."""
SETUP_WAIT_S = 600.0
"""How long a pod waits for the first pod to bring the run directory to its submission."""


class PodSupervisor(RoleSupervisor):
    """One pod of one Job: its rank, addresses and start from the pod's environment."""

    scheduler = "Kubernetes"

    def __init__(self, rundir: RunDir, job: str, node: int, env: dict[str, str]) -> None:
        self.env = env
        self.stopped_at_limit = False
        super().__init__(rundir, job, node)
        self.deadline = self.first_start() + self.cfg.cluster.time_min * 60

    def here(self) -> str:
        return self.env["RELAY_POD_IP"]

    def address(self, node: int) -> str:
        return f"{self.env['RELAY_JOB_NAME']}-{node}.{self.env['RELAY_SUBDOMAIN']}"

    def start_key(self) -> str:
        return self.env["RELAY_POD_NAME"]

    def node_name(self) -> str:
        return self.env["RELAY_POD_NAME"]

    def job_label(self) -> str:
        return f"pod {self.env['RELAY_POD_NAME']}"

    def master_port(self, first: bool) -> int:
        return int(self.cfg.cluster.master_port or DEFAULT_MASTER_PORT)

    def first_start(self) -> float:
        """When the first pod of this submission started (recorded once): the supervisors
        count `cluster.time_min` from it, their Jobs' deadlines from a little earlier."""
        path = self.rundir.control / f"deadline_from.{submission_of(self.rundir)}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return float(path.read_text() or time.time())
        with os.fdopen(fd, "w") as f:
            f.write(repr(time.time()))
        return time.time()

    def peers(self) -> dict[str, str]:
        jobs = {proc["job"] for proc in self.plan["processes"]}
        return {job: job for job in sorted(jobs - {self.job})}

    def started_marker(self, job: str) -> Path:
        return self.rundir.control / f"started.{job}.{submission_of(self.rundir)}"

    def wait_for_peers(self, peers: dict[str, str]) -> None:
        """Node 0 of each job says it started; every node waits for the other jobs' word,
        for at most `timeouts.co_start_s`."""
        if self.node == 0:
            self.started_marker(self.job).touch()
        deadline = time.monotonic() + self.cfg.timeouts.co_start_s
        while waiting := [job for job in peers if not self.started_marker(job).exists()]:
            if time.monotonic() > deadline:
                self.fail(
                    f"jobs did not start together within {self.cfg.timeouts.co_start_s:g} s "
                    f"(timeouts.co_start_s): {', '.join(waiting)} (kubectl describe their "
                    f"pods: a quota, an image pull, no node)",
                    self.job,
                    cancel_self=True,
                )
            self.check_failure()
            time.sleep(PEER_POLL_S)

    def on_tick(self) -> None:
        """At `signal_delay_s` before `cluster.time_min`: checkpoint and stop the run."""
        if time.time() < self.deadline - self.cfg.cluster.signal_delay_s:
            return
        self.log.warning(
            "cluster.time_min=%s reached (less signal_delay_s=%s): checkpointing and stopping",
            self.cfg.cluster.time_min,
            self.cfg.cluster.signal_delay_s,
        )
        self.stopped_at_limit = True  # every pod stops now: the others wait for the trainer
        self.checkpoint_and_stop(self.checkpoint_budget_s(), together=True)


def submission_of(run: RunDir) -> int:
    try:
        return int(run.submission.read_text())
    except FileNotFoundError:
        return 0


def prepare(run: RunDir, config: Path, first: bool) -> None:
    """Bring the run directory to the ConfigMap's submission (the first pod), or wait for it."""
    wanted = int((config / "submission").read_text())
    if not first:
        deadline = time.monotonic() + SETUP_WAIT_S
        while submission_of(run) < wanted or not run.is_run():
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"the first pod did not prepare {run.root} within {SETUP_WAIT_S:g} s"
                )
            time.sleep(1.0)
        return
    if submission_of(run) >= wanted and run.is_run():
        return  # a recreated first pod: the directory is ready
    from omegaconf import OmegaConf

    config_yaml = (config / "config.yaml").read_text()
    plan_json = (config / "plan.json").read_text()
    overrides = json.loads((config / "overrides.json").read_text())
    if not run.is_run():
        run.create(OmegaConf.create(config_yaml), secrets.token_hex(16), plan_json)
        run.add_overrides(overrides)
    else:  # a resubmission: the new config, and nothing of the ended one's end
        run.write_config(config_yaml)
        write_atomic(run.plan, plan_json)
        write_atomic(run.overrides_file, json.dumps(overrides))
        for marker in (*(run.done(role) for role in FINISHING_ROLES), run.complete):
            marker.unlink(missing_ok=True)
        run.end_submission()
    write_atomic(run.submission, str(wanted))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--job", required=True)
    args = parser.parse_args(argv)
    env = dict(os.environ)
    node = int(env.get("JOB_COMPLETION_INDEX", "0"))
    run = RunDir(args.run_dir)
    plan = json.loads((args.config / "plan.json").read_text())
    first_job = plan["jobs"][0]["name"] if plan["jobs"] else args.job
    prepare(run, args.config, first=args.job == first_job and node == 0)
    supervisor = PodSupervisor(run, args.job, node, env)
    sys.exit(supervise(supervisor))


def supervise(supervisor: PodSupervisor) -> int:
    """Run the pod's supervisor; its exit code (what the Job's pod failure policy reads)."""
    try:
        supervisor.run()
    except RunEnded as end:
        supervisor.log.warning("%s", end)
        return EXIT_RUN_ENDED
    if supervisor.stopped_at_limit:
        return EXIT_TIME_LIMIT
    if supervisor.stopping:
        return EXIT_TERMINATED
    return 0


if __name__ == "__main__":
    main()
