"""launcher/clusters/base.py: a cluster is a class registered by `cluster.kind`; the planner
asks it where the processes go (and nothing reads `cluster.kind` but the registry), so a new
cluster is a folder with its class plus one registration."""

from __future__ import annotations

import subprocess

import pytest

from launcher.clusters.base import CLUSTERS, Cluster, Job, Process, cluster_of, register
from launcher.errors import PlanError
from launcher.plan.planner import format_plan, plan
from rl.core.paths import ROOT
from tests.support.runs import compose_run


class Elsewhere(Cluster):
    """A do-nothing cluster whose processes run on nodes of their own, all in one job."""

    spans_nodes = True

    def place(self, size: object, processes: list[Process]) -> tuple[list[Process], list[Job]]:
        job = Job("all", nodes=2, gpus_per_node=0, cpus_per_task=4, mem_gb=8, time_min=60,
                  partition=None, account=None, qos=None, constraint=None)  # fmt: skip
        return [Process(p.role, p.name, p.argv, p.env, job="all") for p in processes], [job]

    def describe(self, run_plan: object) -> list[str]:
        return ["elsewhere: nothing is submitted"]


@pytest.fixture
def elsewhere() -> object:
    register("elsewhere", Elsewhere)
    yield
    del CLUSTERS["elsewhere"]


def test_a_registered_cluster_plans_a_run(elsewhere: object) -> None:
    cfg = compose_run("cluster.kind=elsewhere", "cluster.nodes=2", "max_steps=2")
    assert isinstance(cluster_of(cfg), Elsewhere)
    p = plan(cfg)
    assert [j.name for j in p.jobs] == ["all"]
    assert {proc.job for proc in p.processes} == {"all"}
    # spans_nodes: its processes get no device of this machine, and its CPU roles every core
    # of their node, as on Slurm.
    assert all("CUDA_VISIBLE_DEVICES" not in proc.env for proc in p.processes)
    assert "elsewhere: nothing is submitted" in format_plan(p, cfg)


def test_an_unknown_cluster_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(
        PlanError, match=r"cluster.kind=nowhere: no such cluster; known: kubernetes, local, slurm"
    ):
        plan(compose_run("cluster.kind=nowhere"))


def test_only_the_registry_reads_cluster_kind() -> None:
    """Outside launcher/clusters/, nothing asks which cluster a run is on."""
    found = subprocess.run(
        ["grep", "-rn", "--include=*.py", r"cluster\.kind\|ClusterKind\.", "rl", "launcher"],
        cwd=ROOT, capture_output=True, text=True,
    ).stdout.splitlines()  # fmt: skip
    outside = [line for line in found if not line.startswith("launcher/clusters/")]
    assert outside == [], outside
