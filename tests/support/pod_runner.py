"""Plays a Kubernetes cluster's kubelet and Job controller on this machine, for the objects a
Kubernetes run is written as (`rl ... action=manifests`), so that the pods run as they would:

- each pod's container runs its `command` and `args` with its `env`: plain values, the
  Downward API's fields (`status.podIP` is this machine's loopback, `metadata.name` a fresh
  pod name each time), and `JOB_COMPLETION_INDEX` as the Job controller sets it; the image's
  PATH has this project's interpreter first and its working directory is the project (as the
  Dockerfile's);
- each volume is a local folder: the claim's (one for the whole cluster, as ReadWriteMany),
  the ConfigMap's files, `/dev/shm` this machine's own. With no mount namespace, a container
  path in the command line or the environment is rewritten to the folder it is mounted from;
- each headless Service's pod names (`<job>-<index>.<service>`, and with the namespace and
  `svc.cluster.local`) resolve to this machine: lines added to /etc/hosts while the runner
  lives, and removed after;
- a pod is stopped as the kubelet stops it: SIGTERM to the container's first process, then,
  after `terminationGracePeriodSeconds`, SIGKILL to every process left in the container;
- the Job controller: a pod that failed is judged by the Job's `podFailurePolicy` (a pod ended
  by a disruption carries the `DisruptionTarget` condition), recreated with the same index
  unless the policy fails the Job or `backoffLimit` is spent; the Job is complete once every
  index has succeeded.

- a JobSet: the Jobs its controller creates from each replicated job, their pods in its
  subdomain (its controller's own Service); its failure policy is not played.

Only what the tests use is played: Indexed Jobs with one container, JobSets of them, their
Services and ConfigMaps, PersistentVolumeClaim, ConfigMap and emptyDir volumes.
"""

from __future__ import annotations

import copy
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
HOSTS = Path("/etc/hosts")
LOOPBACK = "127.0.0.1"


def hosts_writable() -> bool:
    return os.access(HOSTS, os.W_OK)


@dataclass
class Pod:
    job: str
    index: int
    name: str
    proc: subprocess.Popen
    log: Path
    disrupted: bool = False


@dataclass
class JobState:
    obj: dict[str, Any]
    failures: int = 0
    succeeded: set[int] = field(default_factory=set)
    failed: str | None = None
    pods: dict[int, Pod] = field(default_factory=dict)
    ended: list[Pod] = field(default_factory=list)


class PodRunner:
    """The objects of one run, played here under `root`."""

    def __init__(
        self, stream: str, root: Path, namespace: str = "default", claims: Path | None = None
    ) -> None:
        self.objects = [obj for obj in yaml.safe_load_all(stream) if obj]
        self.root, self.namespace = root, namespace
        self.claims_root = claims or root / "claims"  # another runner's: the same volumes
        self.claims: dict[str, Path] = {}
        self.config_maps: dict[str, Path] = {}
        for obj in self.by_kind("ConfigMap"):
            folder = root / "configmaps" / obj["metadata"]["name"]
            folder.mkdir(parents=True)
            for name, text in obj["data"].items():
                (folder / name).write_text(text)
            self.config_maps[obj["metadata"]["name"]] = folder
        self.jobs = {obj["metadata"]["name"]: JobState(obj) for obj in self.by_kind("Job")}
        for jobset in self.by_kind("JobSet"):
            for job in jobset_jobs(jobset):
                self.jobs[job["metadata"]["name"]] = JobState(job)
        self.hosts_added = self.resolve_services()

    def by_kind(self, kind: str) -> list[dict[str, Any]]:
        return [obj for obj in self.objects if obj["kind"] == kind]

    # --- cluster DNS --------------------------------------------------------------------

    def resolve_services(self) -> list[str]:
        """/etc/hosts lines for every pod name the Services give (added now)."""
        services = {obj["metadata"]["name"] for obj in self.by_kind("Service")}
        services |= {jobset_subdomain(obj) for obj in self.by_kind("JobSet")}  # its own
        lines = []
        for name, state in self.jobs.items():
            spec = state.obj["spec"]
            subdomain = spec["template"]["spec"].get("subdomain")
            if subdomain not in services:
                continue
            for index in range(spec["completions"]):
                short = f"{name}-{index}.{subdomain}"
                full = f"{short}.{self.namespace}.svc.cluster.local"
                lines.append(f"{LOOPBACK} {short} {full}  # relay pod runner {id(self)}")
        if lines:
            with HOSTS.open("a") as hosts:
                hosts.write("".join(f"{line}\n" for line in lines))
        return lines

    def close(self) -> None:
        """Stop every pod left (SIGKILL) and take the runner's lines out of /etc/hosts."""
        for state in self.jobs.values():
            for pod in list(state.pods.values()):
                if pod.proc.poll() is None:
                    kill_container(pod)
        if self.hosts_added:
            added = "".join(f"{line}\n" for line in self.hosts_added)
            HOSTS.write_text(HOSTS.read_text().replace(added, ""))
            self.hosts_added = []

    # --- the kubelet ---------------------------------------------------------------------

    def mounts(self, pod_spec: dict[str, Any], container: dict[str, Any]) -> dict[str, Path]:
        """Each volume mount's container path and the local folder it is."""
        volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
        found = {}
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                folder = self.claims.setdefault(claim, self.claims_root / claim)
                folder.mkdir(parents=True, exist_ok=True)
            elif "configMap" in volume:
                folder = self.config_maps[volume["configMap"]["name"]]
            elif volume.get("emptyDir", {}).get("medium") == "Memory":
                folder = Path("/dev/shm")
            else:
                raise NotImplementedError(f"volume {volume}")
            found[mount["mountPath"]] = folder
        return found

    def start(self, job: str, index: int) -> Pod:
        """Create the pod of `job`'s `index` and start its container."""
        state = self.jobs[job]
        template = state.obj["spec"]["template"]
        spec = template["spec"]
        (container,) = spec["containers"]
        mounts = self.mounts(spec, container)
        pod_name = f"{job}-{index}-{secrets.token_hex(3)}"
        fields = {
            "status.podIP": LOOPBACK,
            "metadata.name": pod_name,
            "metadata.namespace": self.namespace,
        }

        def local(value: str) -> str:
            for path, folder in sorted(mounts.items(), key=lambda m: -len(m[0])):
                if value == path or value.startswith(path + "/"):
                    return str(folder) + value[len(path) :]
            return value

        env = {
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # the image's
            "HOME": os.environ.get("HOME", "/root"),
            "HOSTNAME": f"{job}-{index}",
            "JOB_COMPLETION_INDEX": str(index),
            "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"),
        }
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = local(var["value"])
            else:
                env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        argv = [local(arg) for arg in (*container["command"], *container.get("args", []))]
        log = self.root / "pods" / f"{pod_name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        pod = Pod(job, index, pod_name, proc, log)
        state.pods[index] = pod
        return pod

    def start_all(self) -> None:
        """Every Job's pods, all indices at once (parallelism = completions)."""
        for name, state in self.jobs.items():
            for index in range(state.obj["spec"]["completions"]):
                self.start(name, index)

    def preempt(self, job: str, index: int) -> int:
        """Preempt a pod as the scheduler does: it gets the DisruptionTarget condition, and
        is stopped as the kubelet stops a pod; returns its exit code."""
        pod = self.jobs[job].pods[index]
        pod.disrupted = True
        grace = self.jobs[job].obj["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        os.kill(pod.proc.pid, signal.SIGTERM)
        try:
            return pod.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            kill_container(pod)
            return pod.proc.wait()

    # --- the Job controller --------------------------------------------------------------

    def step(self) -> None:
        """Look at every pod once: judge those that ended, recreate those the Job retries."""
        for name, state in self.jobs.items():
            for index, pod in list(state.pods.items()):
                code = pod.proc.poll()
                if code is None:
                    continue
                del state.pods[index]
                state.ended.append(pod)
                if state.failed is not None:
                    continue
                if code == 0:
                    state.succeeded.add(index)
                    continue
                action = policy_action(state.obj["spec"], code, pod.disrupted)
                if action == "FailJob":
                    self.fail(state, f"PodFailurePolicy: pod {pod.name} exited {code}")
                    continue
                if action != "Ignore":
                    state.failures += 1
                if state.failures > state.obj["spec"].get("backoffLimit", 6):
                    self.fail(state, "BackoffLimitExceeded")
                    continue
                self.start(name, index)

    def fail(self, state: JobState, reason: str) -> None:
        """The Job failed: its pods left are terminated."""
        state.failed = reason
        for pod in state.pods.values():
            if pod.proc.poll() is None:
                os.kill(pod.proc.pid, signal.SIGTERM)

    def complete(self, job: str) -> bool:
        state = self.jobs[job]
        return len(state.succeeded) == state.obj["spec"]["completions"]

    def wait_ended(self, timeout: float) -> dict[str, str]:
        """Play the controller until every Job is complete or failed; each Job's end."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.step()
            ends = {
                name: "complete" if self.complete(name) else f"failed ({state.failed})"
                for name, state in self.jobs.items()
                if self.complete(name) or (state.failed and not state.pods)
            }
            if len(ends) == len(self.jobs):
                return ends
            time.sleep(0.5)
        raise AssertionError(f"the Jobs did not end within {timeout:.0f} s")


def jobset_subdomain(jobset: dict[str, Any]) -> str:
    return jobset["spec"].get("network", {}).get("subdomain") or jobset["metadata"]["name"]


def jobset_jobs(jobset: dict[str, Any]) -> list[dict[str, Any]]:
    """The Jobs the JobSet controller creates: `<jobset>-<replicated job>-<i>` for each
    replica, from its template, their pods in the JobSet's subdomain."""
    jobs = []
    for replicated in jobset["spec"]["replicatedJobs"]:
        for i in range(replicated.get("replicas", 1)):
            template = copy.deepcopy(replicated["template"])
            template["spec"]["template"]["spec"]["subdomain"] = jobset_subdomain(jobset)
            name = f"{jobset['metadata']['name']}-{replicated['name']}-{i}"
            meta = {**template.get("metadata", {}), "name": name}
            jobs.append({"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
                         "spec": template["spec"]})  # fmt: skip
    return jobs


def policy_action(spec: dict[str, Any], code: int, disrupted: bool) -> str:
    """What the Job's podFailurePolicy does with a pod that exited `code`: its first rule
    that matches (FailJob, Ignore, Count), else Count."""
    for rule in spec.get("podFailurePolicy", {}).get("rules", []):
        codes = rule.get("onExitCodes")
        if codes is not None:
            listed = code in codes["values"]
            if listed == (codes["operator"] == "In"):
                return rule["action"]
        for condition in rule.get("onPodConditions", []):
            wanted = condition.get("status", "True") == "True"
            if condition["type"] == "DisruptionTarget" and disrupted == wanted:
                return rule["action"]
    return "Count"


def descendants(pid: int) -> list[int]:
    """Every process started from `pid`, by parent links (roles start sessions of their own,
    so the container's processes are found so, not by process group)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parts = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(parts[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_container(pod: Pod) -> None:
    """SIGKILL every process of the pod's container (its first process, not yet reaped, and
    all it started)."""
    for pid in [*descendants(pod.proc.pid), pod.proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        pod.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
