"""cluster=kubernetes as a `Cluster`: the plan's jobs laid out on nodes as on Slurm
(launcher/clusters/layout.py), written as Kubernetes objects (manifests.py), applied, listed
and deleted through the API (submit.py), each pod's roles started by its supervisor
(pod.py)."""

from __future__ import annotations

import re
from typing import Any

from launcher.clusters.base import Cluster, Job, Process, term_budget_s
from launcher.clusters.kubernetes.manifests import (
    EXIT_RUN_ENDED,
    START_ALLOWANCE_S,
    STOP_ALLOWANCE_S,
    job_object,
    run_folder,
)
from launcher.clusters.layout import node_layout
from launcher.errors import ConfigError, refuse
from launcher.plan.costs.fit import Footprint
from launcher.plan.planner import RunPlan
from rl.core.rundir import RunDir

REQUIRED = ("image", "volume_claim")
"""What a run's objects cannot be written without."""


class Kubernetes(Cluster):
    spans_nodes = True
    sees_files = False  # the pods read model.path and write the run on the cluster's volume

    def place(self, size: Footprint, processes: list[Process]) -> tuple[list[Process], list[Job]]:
        check_settings(self.cfg.cluster)
        return node_layout(self.cfg, size, processes)

    where_label = "namespace/queue"

    def where(self, job: Job) -> str:
        return f"{self.cfg.cluster.namespace}/{self.cfg.cluster.queue or '-'}"

    def describe(self, run_plan: RunPlan) -> list[str]:
        from hydra.core.hydra_config import HydraConfig

        from launcher.clusters.kubernetes.submit import run_name_of

        c = self.cfg.cluster
        rid = run_name_of(run_plan) if HydraConfig.initialized() else "<run>"
        lines = [
            f"kubernetes: namespace {c.namespace}, image {c.image or '<cluster.image>'}, run "
            f"directory {run_folder(self.cfg, rid)} on claim "
            f"{c.volume_claim or '<cluster.volume_claim>'}; objects labelled relay.dev/run={rid}",
            f"ConfigMap {rid}-run: config.yaml, plan.json (the first pod writes the run "
            f"directory from it)",
        ]
        if c.jobset:
            jobs = ", ".join(f"{job.name} ({job.nodes} pods)" for job in run_plan.jobs)
            lines.append(f"JobSet {rid}: replicated jobs {jobs}")
        else:
            for job in run_plan.jobs:
                name = job_object(rid, job.name)
                lines.append(
                    f"Job {name}: Indexed, {job.nodes} pods at once; headless Service {name}"
                )
        grace = int(term_budget_s(self.cfg)) + STOP_ALLOWANCE_S
        lines.append(
            f"each pod: {job_gpus(run_plan)}terminationGracePeriodSeconds={grace}, "
            f"activeDeadlineSeconds={c.time_min * 60 + START_ALLOWANCE_S}, backoffLimit="
            f"{self.cfg.max_restarts}, disruptions ignored, exit {EXIT_RUN_ENDED} fails the Job"
        )
        if c.queue:
            lines.append(f"kueue: queue {c.queue}, created suspended until admitted whole")
        return lines

    def notes(self) -> list[str]:
        missing = [f"cluster.{key}" for key in REQUIRED if not getattr(self.cfg.cluster, key)]
        if missing:
            return [f"{' and '.join(missing)} not set: needed to write or apply the objects"]
        return []

    def time_limit_s(self) -> int | None:
        return self.cfg.cluster.time_min * 60

    def signal_limit(self) -> tuple[int, str] | None:
        time_min = self.cfg.cluster.time_min
        return time_min * 60 // 2, f"half of cluster.time_min={time_min}"

    def check_ready(self) -> None:
        """ConfigError naming what the objects need and the config lacks."""
        missing = [key for key in REQUIRED if not getattr(self.cfg.cluster, key)]
        if missing:
            raise ConfigError(
                f"cluster.{missing[0]}: not set; a Kubernetes run needs "
                + " and ".join(f"cluster.{key}" for key in REQUIRED)
                + " (the image every pod runs, and the ReadWriteMany claim its run directory "
                "is on; docs/kubernetes.md)"
            )

    def manifests(self, run_plan: RunPlan, overrides: list[str]) -> str:
        from launcher.clusters.kubernetes.manifests import to_yaml
        from launcher.clusters.kubernetes.submit import objects_of

        self.check_ready()
        return to_yaml(objects_of(self.cfg, run_plan, overrides, submission=1))

    def start(self, run_plan: RunPlan) -> None:
        from launcher.clusters.kubernetes.submit import submit

        self.check_ready()
        submit(self.cfg, run_plan)

    def resume(self, run_plan: RunPlan, run: RunDir) -> None:
        from launcher.clusters.kubernetes.submit import resubmit

        self.check_ready()
        resubmit(self.cfg, run_plan, run)

    def check_ended(self, run: RunDir) -> None:
        from launcher.clusters.kubernetes.submit import check_ended

        check_ended(run)

    def status(self, run: RunDir) -> str:
        from launcher.clusters.kubernetes.submit import format_status

        return format_status(run)

    def cancel(self, run: RunDir, force: bool) -> None:
        from launcher.clusters.kubernetes.submit import cancel

        cancel(run, force)

    def start_base(self, run: RunDir) -> str | None:
        raise ConfigError(
            "warmup.steps: on Kubernetes a sweep's points do not share one warm-up yet; give "
            "them a base (model.path, a run's weights/step_0 on the volume) or warmup.steps=0"
        )

    def run_shared(self, points: list[Any], sweep_dir: Any, token: str) -> int | None:
        raise ConfigError(
            "inference.shared=true: a sweep sharing inference runs on cluster=local or "
            "cluster=slurm, not yet on Kubernetes"
        )


def job_gpus(run_plan: RunPlan) -> str:
    gpus = {job.gpus_per_node for job in run_plan.jobs}
    return f"up to {max(gpus)} nvidia.com/gpu, " if any(gpus) else ""


DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
RESOURCE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
SECRET_KEY = re.compile(r"^[-._A-Za-z0-9]+$")
TOLERATION = {
    "key": None,
    "operator": ("Exists", "Equal"),
    "value": None,
    "effect": ("NoSchedule", "PreferNoSchedule", "NoExecute"),
    "tolerationSeconds": None,
}


def check_settings(c: Any) -> None:
    """Refuse, naming the setting, what the API server would refuse in the objects."""
    if not DNS_LABEL.match(c.namespace):
        refuse("cluster.namespace", f"{c.namespace!r} is not a DNS label (a-z, 0-9, '-')")
    if not c.mount_path.startswith("/"):
        refuse("cluster.mount_path", f"{c.mount_path!r}: give an absolute path")
    if c.queue is not None and not LABEL_VALUE.match(c.queue):
        refuse("cluster.queue", f"{c.queue!r} is not a label value (63 characters at most)")
    if c.rdma_resource is not None and not RESOURCE.match(c.rdma_resource):
        refuse(
            "cluster.rdma_resource",
            f"{c.rdma_resource!r} is not an extended resource name (`domain/name`, such as "
            f"rdma/ib or nvidia.com/hostdev)",
        )
    for network in c.networks:
        if not DNS_LABEL.match(network.split("/")[-1]):
            refuse("cluster.networks", f"{network!r} is not a network attachment's name")
    for name, ref in c.secrets.items():
        secret, _, key = ref.partition("/")
        if not DNS_SUBDOMAIN.match(secret) or not SECRET_KEY.match(key):
            refuse(f"cluster.secrets.{name}", f"{ref!r}: give <secret>/<key>, as wandb/api-key")
    for key, value in c.node_selector.items():
        if not LABEL_VALUE.match(str(value)):
            refuse(f"cluster.node_selector.{key}", f"{value!r} is not a label value")
    for toleration in c.tolerations:
        for key, value in toleration.items():
            if key not in TOLERATION:
                refuse("cluster.tolerations", f"{key!r} is not a toleration's field (it has: "
                       f"{', '.join(TOLERATION)})")  # fmt: skip
            allowed = TOLERATION[key]
            if allowed is not None and value not in allowed:
                refuse(f"cluster.tolerations {key}", f"{value!r}: one of {', '.join(allowed)}")
