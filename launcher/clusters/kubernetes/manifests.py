"""A planned run as Kubernetes objects: a pure function of the plan, its config and its
directory's name (`manifests`), written as one YAML stream (`to_yaml`).

Each of the plan's jobs (one `run` job; per_role a control, an inference and a trainer job)
becomes an Indexed Job whose pods are its nodes: `JOB_COMPLETION_INDEX` is the node's rank,
and a headless Service gives each pod a stable name, `<job>-<index>.<service>`, that the
trainer's rendezvous and a spanning replica's head are reached by. With `cluster.jobset=true`
the jobs are one JobSet's replicated jobs instead (its own Service, its pods
`<jobset>-<job>-0-<index>.<jobset>`), admitted and restarted as one.

Every pod runs the role supervisor (launcher/clusters/kubernetes/pod.py) on the run directory,
a folder of the ReadWriteMany claim mounted at `cluster.mount_path`; the run's config and plan
reach it in a ConfigMap, so that the stream applies on its own (`kubectl apply -f -`). The
first pod creates the run directory from them.

Preemption and failure: a pod's SIGTERM makes the trainer checkpoint the step under way
within `terminationGracePeriodSeconds`; the pod failure policy ignores pods ended by a
disruption (preemption, eviction, a node drained), so they are recreated without spending the
Job's `backoffLimit` (`max_restarts`); a supervisor that ends the run (a failure, the time
limit) exits with a code that fails the Job at once.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from launcher.clusters.base import Job, term_budget_s

LABEL = "relay.dev"
"""The prefix of Relay's labels: `relay.dev/run` (every object of a run) and `relay.dev/job`."""
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
NETWORKS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
"""The JobSet API version written (JobSet v0.8's; tests/kubernetes/jobset_schema.py)."""
CONTAINER = "supervisor"
CONFIG_PATH = "/etc/relay"
"""Where each pod mounts the run's ConfigMap (config.yaml, plan.json, overrides.json,
submission)."""
SHM_PATH = "/dev/shm"

EXIT_RUN_ENDED = 3
"""A supervisor's exit code when the run failed or was cancelled: the Job fails at once."""
EXIT_TIME_LIMIT = 4
"""A supervisor's exit code when it stopped the run at `cluster.time_min`, after the trainer's
checkpoint: the Job fails at once, and `rl action=resume` continues the run."""

EXIT_TERMINATED = 128 + 15
"""A supervisor's exit code after a SIGTERM (preemption, a drain, a cancel), the trainer having
checkpointed: a disrupted pod is recreated."""

START_ALLOWANCE_S = 600
"""What `activeDeadlineSeconds` allows beyond `cluster.time_min` for scheduling and pulling the
image: Kubernetes counts from the Job's start, the supervisors from their first pod's."""
STOP_ALLOWANCE_S = 30
"""What a pod's grace period allows beyond the trainer's checkpoint: the roles stopping."""
NODE_SHARE = 0.9
"""The share of a node's CPUs and memory a pod on a whole node asks for: the kubelet keeps
the rest for the system, and a request of all of it would never be scheduled."""

NAME_PART = 40


def run_id(run_name: str, run_dir: Path) -> str:
    """The run's name on the cluster: a DNS label from the run's name and its directory's last
    two parts (`<name>/<time>`, a sweep's `<time>/<point>`: two runs of one config differ, and
    the name does not depend on where the outputs folder is), short enough to prefix every
    object's name."""
    slug = re.sub(r"[^a-z0-9]+", "-", run_name.lower()).strip("-")[:NAME_PART].strip("-")
    where = f"{run_dir.parent.name}/{run_dir.name}"
    return f"{slug or 'run'}-{hashlib.sha256(where.encode()).hexdigest()[:8]}"


def job_object(rid: str, job: str) -> str:
    """The Kubernetes Job (and its Service) holding `job` of run `rid`."""
    return f"{rid}-{job}"


def run_folder(cfg: Any, rid: str) -> str:
    """The run directory as every pod sees it."""
    return f"{cfg.cluster.mount_path.rstrip('/')}/{rid}"


def manifests(cfg: Any, jobs: list[Job], rid: str, files: dict[str, str]) -> list[dict[str, Any]]:
    """The run's objects, in the order they are applied: its ConfigMap, then per job of the
    plan a Service and an Indexed Job, or one JobSet. `files` are the ConfigMap's
    (`config_files`)."""
    objects = [config_map(cfg, rid, files)]
    if cfg.cluster.jobset:
        return [*objects, job_set(cfg, jobs, rid)]
    for job in jobs:
        name = job_object(rid, job.name)
        objects.append(service(cfg, rid, job.name, name))
        objects.append(indexed_job(cfg, job, rid, name, name))
    return objects


def metadata(cfg: Any, name: str, rid: str, job: str | None = None) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "relay", f"{LABEL}/run": rid}
    if job is not None:
        labels[f"{LABEL}/job"] = job
    return {"name": name, "namespace": cfg.cluster.namespace, "labels": labels}


def config_map(cfg: Any, rid: str, files: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(cfg, f"{rid}-run", rid),
        "data": dict(files),
    }


def service(cfg: Any, rid: str, job: str, name: str) -> dict[str, Any]:
    """A headless Service naming each pod of `job` (`<pod hostname>.<name>`), ready or not:
    the trainer's first node is reached before it answers anything."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(cfg, name, rid, job),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {f"{LABEL}/run": rid, f"{LABEL}/job": job},
        },
    }


def indexed_job(
    cfg: Any,
    job: Job,
    rid: str,
    name: str,
    subdomain: str,
    queued: bool = True,
) -> dict[str, Any]:
    """One job of the plan: `job.nodes` pods, all at once, each its index's node."""
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": job.nodes,
        "parallelism": job.nodes,
        "backoffLimit": int(cfg.max_restarts),
        "activeDeadlineSeconds": int(cfg.cluster.time_min) * 60 + START_ALLOWANCE_S,
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {
                        "containerName": CONTAINER,
                        "operator": "In",
                        "values": [EXIT_RUN_ENDED, EXIT_TIME_LIMIT],
                    },
                },
                {
                    "action": "Ignore",
                    "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                },
            ]
        },
        "template": pod_template(cfg, job, rid, name, subdomain),
    }
    meta = metadata(cfg, name, rid, job.name)
    if queued and cfg.cluster.queue:  # Kueue starts it when the whole Job fits
        meta["labels"][QUEUE_LABEL] = cfg.cluster.queue
        spec["suspend"] = True
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": spec}


def job_set(cfg: Any, jobs: list[Job], rid: str) -> dict[str, Any]:
    """The run's jobs as one JobSet: admitted whole, and restarted whole (up to
    `max_restarts` times) when one of its Jobs fails for a reason other than the run's end."""
    replicated = []
    for job in jobs:
        pod_job = f"{rid}-{job.name}-0"  # JobSet names a replicated job's Job so
        spec = indexed_job(cfg, job, rid, pod_job, rid, queued=False)
        template = {"metadata": {"labels": spec["metadata"]["labels"]}, "spec": spec["spec"]}
        replicated.append({"name": job.name, "replicas": 1, "template": template})
    meta = metadata(cfg, rid, rid)
    spec: dict[str, Any] = {
        "network": {"enableDNSHostnames": True, "subdomain": rid, "publishNotReadyAddresses": True},
        "failurePolicy": {  # a Job failed by its pod failure policy: the run ended
            "maxRestarts": int(cfg.max_restarts),
            "rules": [
                {
                    "name": "RunEnded",
                    "action": "FailJobSet",
                    "onJobFailureReasons": ["PodFailurePolicy"],
                }
            ],
        },
        "replicatedJobs": replicated,
    }
    if cfg.cluster.queue:
        meta["labels"][QUEUE_LABEL] = cfg.cluster.queue
        spec["suspend"] = True
    return {"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": meta, "spec": spec}


def pod_template(cfg: Any, job: Job, rid: str, name: str, subdomain: str) -> dict[str, Any]:
    """A node of `job`: the supervisor, the run's volume, the config, a memory-backed /dev/shm."""
    c = cfg.cluster
    annotations = {NETWORKS_ANNOTATION: ",".join(c.networks)} if c.networks else {}
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "subdomain": subdomain,
        "terminationGracePeriodSeconds": int(term_budget_s(cfg)) + STOP_ALLOWANCE_S,
        "containers": [container(cfg, job, rid, name, subdomain)],
        "volumes": [
            {"name": "runs", "persistentVolumeClaim": {"claimName": c.volume_claim}},
            {"name": "config", "configMap": {"name": f"{rid}-run"}},
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    if c.node_selector:
        spec["nodeSelector"] = dict(c.node_selector)
    if c.tolerations:
        spec["tolerations"] = [dict(t) for t in c.tolerations]
    if c.priority_class:
        spec["priorityClassName"] = c.priority_class
    labels = {"app.kubernetes.io/name": "relay", f"{LABEL}/run": rid, f"{LABEL}/job": job.name}
    meta: dict[str, Any] = {"labels": labels}
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": spec}


def field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def secret_env(name: str, ref: str) -> dict[str, Any]:
    """A variable read from a Secret's key (`<secret>/<key>`)."""
    secret, key = ref.split("/", 1)
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def container(cfg: Any, job: Job, rid: str, name: str, subdomain: str) -> dict[str, Any]:
    """The supervisor's container: its pod's identity from the Downward API (the index comes
    as `JOB_COMPLETION_INDEX`), the pod's share of a node, GPUs and RDMA devices."""
    c = cfg.cluster
    env = [
        field_env("RELAY_POD_IP", "status.podIP"),
        field_env("RELAY_POD_NAME", "metadata.name"),
        {"name": "RELAY_JOB_NAME", "value": name},
        {"name": "RELAY_SUBDOMAIN", "value": subdomain},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        *({"name": key, "value": str(value)} for key, value in c.env.items()),
        *(secret_env(name, ref) for name, ref in c.secrets.items()),
    ]
    whole = job.mem_gb == 0
    cpus = max(1, int(job.cpus_per_task * (NODE_SHARE if whole else 1)))
    mem_gb = max(1, int((job.mem_gb or c.mem_gb_per_node) * (NODE_SHARE if whole else 1)))
    requests: dict[str, Any] = {"cpu": str(cpus), "memory": f"{mem_gb}Gi"}
    limits: dict[str, Any] = {"memory": f"{mem_gb}Gi"}
    if job.gpus_per_node:
        limits["nvidia.com/gpu"] = job.gpus_per_node
    if c.rdma_resource:
        limits[c.rdma_resource] = int(c.rdma_per_node)
    for key in ("nvidia.com/gpu", c.rdma_resource):
        if key in limits:  # extended resources: requests equal to limits
            requests[key] = limits[key]
    spec: dict[str, Any] = {
        "name": CONTAINER,
        "image": c.image,
        "command": ["python", "-m", "launcher.clusters.kubernetes.pod"],
        "args": ["--run-dir", run_folder(cfg, rid), "--config", CONFIG_PATH, "--job", job.name],
        "env": env,
        "resources": {"requests": requests, "limits": limits},
        "volumeMounts": [
            {"name": "runs", "mountPath": c.mount_path},
            {"name": "config", "mountPath": CONFIG_PATH, "readOnly": True},
            {"name": "shm", "mountPath": SHM_PATH},
        ],
    }
    if c.rdma_resource:  # registering memory with the NIC pins it
        spec["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    return spec


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """The objects as one multi-document YAML stream, keys in the order written, the
    ConfigMap's files as blocks of text."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    dump = [yaml.dump(obj, Dumper=Dumper, sort_keys=False, width=100) for obj in objects]
    return "---\n".join(dump)


def config_files(config_yaml: str, plan_json: str, overrides: list[str], submission: int) -> dict:
    """The ConfigMap's files: what the first pod writes the run directory from."""
    return {
        "config.yaml": config_yaml,
        "plan.json": plan_json,
        "overrides.json": json.dumps(overrides),
        "submission": str(submission),
    }
