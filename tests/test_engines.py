"""rl/inference/engines.py: an inference engine is a class registered by `inference.backend`;
the planner, the checks and the roles ask it what it serves and how it starts (nothing outside
rl/inference/ compares the backend's name), so a new engine is a folder with its class plus
one registration."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from launcher.errors import PlanError
from launcher.plan.planner import plan
from rl.core.paths import ROOT
from rl.inference.engines import ENGINES, Engine, engine_of
from tests.support.runs import compose_run


class Echo(Engine):
    """A do-nothing engine with a command line of its own, that serves no quantization."""

    name = "echo"
    label = "echo"

    def server_args(
        self, replica_nodes: int, kv_role: str | None, instance: str, gpu_share: float | None
    ) -> list[str]:
        return ["--echo", instance]

    def inexact(self) -> list[str]:
        return ["inference.backend=echo: it answers at random"]

    def serve(self, run_dir: Path, name: str, args: Any, log: Any) -> None:
        raise NotImplementedError


@pytest.fixture
def echo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ENGINES, "echo", Echo)


def test_a_registered_engine_plans_a_run(echo: None) -> None:
    cfg = compose_run("max_steps=2", "inference.backend=echo")
    assert isinstance(engine_of(cfg), Echo)
    p = plan(cfg)
    (server,) = [proc for proc in p.processes if proc.role == "inference"]
    assert server.argv[-3:] == ["--", "--echo", "inference-0"]
    assert p.backend == "echo" and "inference.backend=echo: it answers at random" in p.inexact


def test_an_unknown_engine_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(PlanError, match=r"^inference.backend=sglang: no such engine; known: "
                       r"embedded, vllm$"):  # fmt: skip
        plan(compose_run("inference.backend=sglang"))


def test_what_an_engine_does_not_serve_is_refused_by_what_it_says() -> None:
    """The embedded engine serves no FP8 checkpoint; the refusal comes from its answer."""
    assert engine_of(compose_run()).quantizations == ()
    with pytest.raises(PlanError, match="served in FP8, which the embedded engine"):
        plan(compose_run("model=tiny_qwen3_moe", "model.inference.quantization=fp8",
                         "inference.backend=embedded"))  # fmt: skip


def test_only_the_registry_reads_the_backend() -> None:
    """Outside rl/inference/, nothing asks which engine serves the run."""
    found = subprocess.run(
        ["grep", "-rn", "--include=*.py",
         r"inference_backend\|inference\.backend ==\|== \"vllm\"\|== \"embedded\"",
         "rl", "launcher"],
        cwd=ROOT, capture_output=True, text=True,
    ).stdout.splitlines()  # fmt: skip
    outside = [line for line in found if not line.startswith("rl/inference/")]
    assert outside == [], outside
