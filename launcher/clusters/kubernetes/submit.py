"""A Kubernetes run from wherever `rl` runs with a kubeconfig: create its objects, show its
state, cancel it, submit it again.

`rl` keeps the run's record in its own run directory (config, plan, `.relay/kubernetes.json`
naming the objects); the run itself lives on the cluster's volume, which this machine need not
see. Creation is all or nothing: where one object is refused, those created before it are
deleted again and the record removed. A resume deletes the ended objects and creates them
anew with the next submission's config; the first pod brings the volume's run directory to
it (launcher/clusters/kubernetes/pod.py).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.clusters.kubernetes.api import Api, KubeError, api_for
from launcher.clusters.kubernetes.manifests import (
    EXIT_RUN_ENDED,
    EXIT_TERMINATED,
    EXIT_TIME_LIMIT,
    LABEL,
    config_files,
    manifests,
    run_folder,
    run_id,
)
from launcher.clusters.run_dir import prepare_run_dir
from launcher.errors import ConfigError
from launcher.plan.planner import RunPlan
from launcher.watch.report import override
from rl.core.config import Action
from rl.core.rundir import RunDir

DELETE_WAIT_S = 120.0
"""How long a resume waits for the ended objects to be gone before creating them anew."""
POLL_S = 2.0


def run_name_of(run_plan: RunPlan, run_dir: Path | None = None) -> str:
    """The run's name on the cluster (its directory: Hydra's for this run)."""
    if run_dir is None:
        from hydra.core.hydra_config import HydraConfig

        run_dir = Path(HydraConfig.get().runtime.output_dir)
    return run_id(run_plan.run_name, run_dir)


def objects_of(
    cfg: DictConfig,
    run_plan: RunPlan,
    overrides: list[str],
    submission: int,
    run_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """The run's objects for its `submission`-th submission."""
    plan_json = run_plan.to_json()
    run_cfg = OmegaConf.structured(cfg)  # a copy: what the pods run (action=manifests too)
    run_cfg.action = Action.run
    config_yaml = OmegaConf.to_yaml(run_cfg, resolve=True)
    files = config_files(config_yaml, plan_json, overrides, submission)
    rid = run_name_of(run_plan, run_dir)
    return manifests(cfg, run_plan.jobs, rid, files)


def write_record(
    run: RunDir, cfg: DictConfig, objects: list[dict[str, Any]], rid: str, n: int
) -> None:
    record = {
        "namespace": cfg.cluster.namespace,
        "run": rid,
        "client": str(cfg.cluster.client),
        "submission": n,
        "objects": [[obj["kind"], obj["metadata"]["name"]] for obj in objects],
    }
    run.kubernetes.write_text(json.dumps(record, indent=2))


def read_record(run: RunDir) -> dict[str, Any]:
    try:
        return json.loads(run.kubernetes.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"run_dir={run.root}: not a Kubernetes run (no {run.kubernetes.name})"
        ) from None


def create_all(api: Api, objects: list[dict[str, Any]]) -> None:
    """Create `objects` in order; where one is refused, delete those created and raise."""
    made: list[dict[str, Any]] = []
    try:
        for obj in objects:
            api.create(obj)
            made.append(obj)
    except BaseException as err:  # a refusal, or Ctrl-C between two objects
        for obj in reversed(made):
            meta = obj["metadata"]
            try:
                api.delete(obj["kind"], meta["name"], meta["namespace"], grace_s=0)
            except KubeError:
                pass
        if isinstance(err, (KubeError, ConfigError)):
            raise ConfigError(f"submission failed, nothing left created: {err}") from None
        raise


def submit(cfg: DictConfig, run_plan: RunPlan) -> RunDir:
    """Create the run's objects and keep its record here; nothing is left on failure."""
    run, _ = prepare_run_dir(cfg, run_plan)
    try:
        api = api_for(cfg.cluster.client)
        objects = objects_of(cfg, run_plan, run.overrides(), 1, run.root)
        create_all(api, objects)
    except BaseException:
        shutil.rmtree(run.root, ignore_errors=True)
        raise
    rid = run_name_of(run_plan, run.root)
    write_record(run, cfg, objects, rid, 1)
    announce(cfg, run, objects, rid)
    return run


def announce(cfg: DictConfig, run: RunDir, objects: list[dict[str, Any]], rid: str) -> None:
    print(f"run record: {run.root}")
    for obj in objects:
        print(
            f"created {obj['kind']} {obj['metadata']['name']} (namespace {cfg.cluster.namespace})"
        )
    print(f"run directory: {run_folder(cfg, rid)} on claim {cfg.cluster.volume_claim}")
    print(f"pods: kubectl get pods -n {cfg.cluster.namespace} -l {LABEL}/run={rid}")
    print(f"status: uv run rl action=status {override('run_dir', run.root)}")


def resubmit(cfg: DictConfig, run_plan: RunPlan, run: RunDir) -> None:
    """Create the ended run's objects anew, as its next submission."""
    record = read_record(run)
    api = api_for(cfg.cluster.client)
    check_ended(run, api)
    delete_all(api, record)
    wait_gone(api, record)
    n = int(record["submission"]) + 1
    objects = objects_of(cfg, run_plan, run.overrides(), n, run.root)
    create_all(api, objects)
    write_record(run, cfg, objects, record["run"], n)
    announce(cfg, run, objects, record["run"])


def delete_all(api: Api, record: dict[str, Any], grace_s: int | None = None) -> None:
    """Delete the run's objects, Jobs first (foreground: their pods go first)."""
    order = sorted(record["objects"], key=lambda o: o[0] not in ("Job", "JobSet"))
    for kind, name in order:
        api.delete(kind, name, record["namespace"], grace_s=grace_s)


def wait_gone(api: Api, record: dict[str, Any]) -> None:
    selector = f"{LABEL}/run={record['run']}"
    deadline = time.monotonic() + DELETE_WAIT_S
    while api.jobs(record["namespace"], selector) or api.pods(record["namespace"], selector):
        if time.monotonic() > deadline:
            raise ConfigError(
                f"resume: the run's ended Jobs or pods are still there after {DELETE_WAIT_S:g} s "
                f"(kubectl get jobs,pods -l {selector}); try again once they are gone"
            )
        time.sleep(POLL_S)


def job_state(job: Any) -> str:
    """A Job's state from its conditions: complete, failed (and why), queued (suspended:
    Kueue has not admitted it), running, or pending."""
    conditions = {c.type: c for c in (job.status.conditions or []) if c.status == "True"}
    if "Complete" in conditions:
        return "complete"
    if "Failed" in conditions:
        c = conditions["Failed"]
        return f"failed ({c.reason}: {c.message})" if c.message else f"failed ({c.reason})"
    if "Suspended" in conditions or job.spec.suspend:
        return "queued (suspended until admitted)"
    return "running" if job.status.active else "pending"


EXITS = {
    0: "done",
    EXIT_RUN_ENDED: "the run ended",
    EXIT_TIME_LIMIT: "stopped at the time limit",
    EXIT_TERMINATED: "stopped on SIGTERM",
    137: "killed",
}


def pod_state(pod: Any) -> str:
    """A pod's phase with what explains it: a container waiting (ImagePullBackOff), the
    supervisor's exit code and its meaning, a disruption (preemption, eviction)."""
    said = pod.status.phase or "Unknown"
    for status in pod.status.container_statuses or []:
        if status.state.waiting is not None:
            said += f", {status.state.waiting.reason}"
        if (ended := status.state.terminated) is not None:
            said += f", exit {ended.exit_code} ({EXITS.get(ended.exit_code, ended.reason)})"
    for condition in pod.status.conditions or []:
        if condition.type == "DisruptionTarget" and condition.status == "True":
            said += f", disrupted ({condition.reason})"
    return said


def run_state(jobs: list[Any], pods: list[Any]) -> str:
    """The run's state from its Jobs and pods."""
    if not jobs:
        return "no Job on the cluster (deleted, or not created yet)"
    states = [job_state(job) for job in jobs]
    if all(s == "complete" for s in states):
        return "finished"
    exits = {
        s.state.terminated.exit_code
        for pod in pods
        for s in pod.status.container_statuses or []
        if s.state.terminated is not None
    }
    if any(s.startswith("failed") for s in states):
        if EXIT_TIME_LIMIT in exits:
            return "stopped at the time limit (cluster.time_min), after a checkpoint"
        return "failed"
    if any(s.startswith("queued") for s in states):
        return "queued"
    return "running" if any(s == "running" for s in states) else "pending"


def format_status(run: RunDir, api: Api | None = None) -> str:
    """The run's Jobs and pods as the API reports them."""
    record = read_record(run)
    api = api or api_for(record["client"])
    ns, selector = record["namespace"], f"{LABEL}/run={record['run']}"
    try:
        jobs, pods = api.jobs(ns, selector), api.pods(ns, selector)
    except KubeError as err:
        return f"run {run.root}: the cluster did not answer ({err})"
    state = run_state(jobs, pods)
    lines = [f"run {run.root}: {state}"]
    lines.append(
        f"  on the cluster: {record['run']} in namespace {ns}, submission {record['submission']}"
    )
    for job in sorted(jobs, key=lambda j: j.metadata.name):
        done, total = job.status.succeeded or 0, job.spec.completions
        lines.append(f"  Job {job.metadata.name}: {job_state(job)}, {done}/{total} pods done")
    for pod in sorted(pods, key=lambda p: p.metadata.name):
        lines.append(f"  pod {pod.metadata.name}: {pod_state(pod)}")
    if state not in ("running", "pending", "queued", "finished"):
        lines.append(f"  resume: uv run rl {override('resume', run.root)}")
    return "\n".join(lines)


def check_ended(run: RunDir, api: Api | None = None) -> None:
    """ConfigError while a Job of the run is neither complete nor failed."""
    record = read_record(run)
    api = api or api_for(record["client"])
    jobs = api.jobs(record["namespace"], f"{LABEL}/run={record['run']}")
    live = [
        job.metadata.name for job in jobs if not job_state(job).startswith(("complete", "failed"))
    ]
    if live:
        raise ConfigError(
            f"resume={run.root}: Jobs {', '.join(live)} are still queued or running "
            f"(rl action=cancel {override('run_dir', run.root)} first)"
        )


def cancel(run: RunDir, force: bool = False, api: Api | None = None) -> None:
    """Delete the run's objects, Jobs first with foreground propagation: each pod gets
    SIGTERM, on which its supervisor has the trainer checkpoint the step under way within the
    pod's grace period (`force`: no grace, no checkpoint)."""
    record = read_record(run)
    api = api or api_for(record["client"])
    if not force:
        print(
            "deleting the run's Jobs: each pod's supervisor gets SIGTERM, and the trainer "
            "checkpoints the step under way within the pod's grace period (force=true: at once)",
            flush=True,
        )
    try:
        delete_all(api, record, grace_s=0 if force else None)
    except KubeError as err:
        raise ConfigError(f"cancel: {err}") from None
    print(f"cancelled {record['run']}: {', '.join(f'{k} {n}' for k, n in record['objects'])}")
    print(f"resume: uv run rl {override('resume', run.root)}")
