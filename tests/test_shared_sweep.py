"""A sweep of LoRA runs sharing one inference service (`rl -m ... inference.shared=true`).

What is refused before anything starts (one line each, nothing left behind), which weights a
shared service may load for which point, and a real three-point sweep on this CPU: one warm-up,
one inference service holding each point's adapter, the points side by side, and one point
that fails ending alone while the others train to the end.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from launcher.clusters.run_dir import group_alive
from rl.core.auth import token_auth
from rl.core.kinds import is_train
from rl.core.model import ensure_checkpoint, load_tokenizer
from rl.core.rundir import (
    BASE,
    SERVICE,
    RunDir,
    mark_complete,
    point_name,
    shared_point,
    write_checksums,
)
from rl.core.runtime import wait_for_address
from rl.inference.server import restored
from rl.weights.published import RefusedWeights, loading_from, published_dir
from tests.support.lora import adapted, check_shared_service
from tests.support.runs import ROOT, TOKEN, compose_run, start_role, stop_role, write_run_dir

SMALL = [
    "warmup.steps=5",
    "environment.eval_size=16",
    "environment.prompts_per_step=8",
    "environment.group_size=4",
    "environment.eval_every=0",
    "model.lora.rank=8",
]


def rl(tmp_path: Path, *overrides: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *overrides, f"hydra.sweep.dir={tmp_path / 'sw'}",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


def refused(out: subprocess.CompletedProcess, tmp_path: Path) -> str:
    """The one error line of a refused command that left no run or point directory."""
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out.stderr
    assert not (tmp_path / "run").exists()
    assert not any((tmp_path / "sw").glob("*/config.yaml"))
    assert not any(p.is_dir() for p in (tmp_path / "sw").glob("*"))
    return errors[0]


def test_shared_inference_outside_a_sweep_is_refused(tmp_path: Path) -> None:
    line = refused(rl(tmp_path, *SMALL, "inference.shared=true"), tmp_path)
    assert "inference.shared=true" in line and "rl -m" in line


def test_shared_inference_without_lora_is_refused(tmp_path: Path) -> None:
    out = rl(tmp_path, "-m", "inference.shared=true", "algorithm.lr=1e-3,3e-3", "dry_run=true")
    line = refused(out, tmp_path)
    assert "model.lora.rank" in line


def test_points_that_would_need_different_services_are_refused(tmp_path: Path) -> None:
    """One service serves one base: points differing in the warm-up cannot share it."""
    given = [o for o in SMALL if not o.startswith("warmup.")]
    out = rl(tmp_path, "-m", *given, "inference.shared=true", "warmup.steps=5,10")
    line = refused(out, tmp_path)
    assert "warmup.steps (5 and 10)" in line


def test_more_points_than_max_loras_are_refused(tmp_path: Path) -> None:
    out = rl(tmp_path, "-m", *SMALL, "inference.shared=true", "inference.max_loras=2",
             "algorithm.lr=1e-3,2e-3,3e-3", "dry_run=true")  # fmt: skip
    line = refused(out, tmp_path)
    assert "inference.max_loras=2" in line and "(3)" in line


def test_a_warm_up_in_a_shared_sweep_on_slurm_is_refused(tmp_path: Path) -> None:
    """On Slurm the points start from the base they are given: no warm-up on a login node."""
    out = rl(tmp_path, "-m", *SMALL, "inference.shared=true", "cluster=slurm_cpu",
             "algorithm.lr=1e-3,3e-3", "dry_run=true")  # fmt: skip
    line = refused(out, tmp_path)
    assert "warmup.steps=5" in line and "model.path" in line


def test_shared_inference_on_local_gpus_is_refused(tmp_path: Path) -> None:
    out = rl(tmp_path, "-m", *SMALL, "inference.shared=true", "cluster.gpus_per_node=1",
             "algorithm.lr=1e-3,3e-3", "dry_run=true")  # fmt: skip
    assert "not built yet" in refused(out, tmp_path)


def test_a_shared_sweep_on_slurm_plans_one_inference_job_and_each_points_own(
    tmp_path: Path,
) -> None:
    given = [o for o in SMALL if not o.startswith("warmup.")]
    out = rl(tmp_path, "-m", *given, "inference.shared=true", "cluster=slurm_cpu",
             "warmup.steps=0", "algorithm.lr=1e-3,3e-3", "dry_run=true")  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    jobs = [x.split()[1].rstrip(":") for x in out.stdout.splitlines() if x.startswith("sbatch ")]
    assert jobs == ["inference", "control", "trainer", "control", "trainer"], out.stdout


def test_dry_run_shows_one_service_and_points_without_inference(tmp_path: Path) -> None:
    out = rl(tmp_path, "-m", *SMALL, "inference.shared=true", "algorithm.lr=1e-3,3e-3",
             "dry_run=true")  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("python -m rl.inference") == 1
    assert out.stdout.count("python -m rl.orchestrator") == 2
    assert out.stdout.count("shared inference service") == 1
    assert not any(p.is_dir() for p in (tmp_path / "sw").glob("*"))  # a dry run leaves none


def hydra_value(command: str, key: str) -> str:
    """What Hydra reads for `key` from a command line as a shell would split it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = shlex.split(command.split("uv run rl ", 1)[1])
    parsed = OverridesParser.create().parse_overrides(args)
    return next(str(o.value()) for o in parsed if o.key_or_group == key)


def test_the_printed_resume_command_of_a_sweep_point_parses(tmp_path: Path) -> None:
    """A sweep point's directory holds `=` and `,` (Hydra's override_dirname): the resume and
    status commands printed for it must reach Hydra as that one path."""
    from launcher.clusters.local.launch import resume_command

    point = tmp_path / "0-algorithm.lr=0.001,max_steps=3,model.lora.rank=8"
    point.mkdir()
    assert hydra_value(resume_command(RunDir(point)), "resume") == str(point)
    from launcher.watch.report import override

    status = f"uv run rl action=status {override('run_dir', point)}"
    assert hydra_value(status, "run_dir") == str(point)
    assert override("resume", "/plain/path") == "resume=/plain/path"


def _published(run: RunDir, version: int, adapter: bool) -> None:
    folder = run.weights_for(version)
    folder.mkdir(parents=True)
    if adapter:
        (folder / "adapter_config.json").write_text("{}")
    write_checksums(folder)
    mark_complete(folder)


def test_a_shared_service_loads_only_the_named_points_own_weights(tmp_path: Path) -> None:
    """A load names the point (its adapter); the weights must be that point's own published
    version: not another point's, not without a name, not a point the sweep lacks."""
    service, zero, one = (RunDir(tmp_path / n) for n in (SERVICE, "0-lr=1", "1-lr=2"))
    for run in (service, zero, one):
        run.root.mkdir()
        run.config.write_text("{}")
    _published(zero, 0, adapter=False)
    _published(zero, 3, adapter=True)
    _published(one, 0, adapter=False)
    assert point_name(zero.root) == "point-0" and shared_point(service.root, "point-1") == one.root
    source = loading_from(service.root, True, "point-0")
    assert published_dir(source, 3, zero.weights_for(3)) == zero.weights_for(3).resolve()
    with pytest.raises(RefusedWeights, match="not version 3"):
        published_dir(loading_from(service.root, True, "point-1"), 3, zero.weights_for(3))
    with pytest.raises(RefusedWeights, match="names the point"):
        loading_from(service.root, True, None)
    with pytest.raises(RefusedWeights, match="no point of this sweep"):
        loading_from(service.root, True, "point-7")
    # A restarted service takes each point's newest version back, under the point's name.
    assert restored(service.root, True) == [
        ("point-0", zero.weights_for(3), 3),
        ("point-1", one.weights_for(0), 0),
    ]


@pytest.fixture(scope="module")
def shared_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """An embedded inference role as a sweep's shared service (`<sweep>/inference`)."""
    cfg = compose_run("model.lora.rank=8", "inference.shared=true", "inference.max_loras=2")
    run_dir = write_run_dir(tmp_path_factory.mktemp("sweep") / SERVICE, cfg, TOKEN)
    tokenizer = load_tokenizer(ensure_checkpoint(cfg.model))
    proc = start_role("inference", run_dir, "--replica", "0")
    try:
        url = wait_for_address(run_dir, "inference-0", timeout=120)
        with httpx.Client(base_url=url, auth=token_auth(TOKEN), timeout=60) as client:
            yield SimpleNamespace(
                cfg=cfg, run_dir=run_dir, client=client, tokenizer=tokenizer,
                first=adapted(cfg, seed=1), second=adapted(cfg, seed=2),
            )  # fmt: skip
    finally:
        stop_role(proc)


@pytest.mark.slow
def test_the_engine_as_a_shared_service_serves_each_point_by_name(
    shared_service: SimpleNamespace,
) -> None:
    check_shared_service(shared_service, shared_service.first, shared_service.second)


@pytest.mark.slow
def test_a_shared_sweep_runs_its_points_together_and_a_failed_point_ends_alone(
    tmp_path: Path,
) -> None:
    """Three LoRA points on one inference service. Point 1's trainer is killed as soon as it
    starts (max_restarts=0): point 1 ends `failed`, points 0 and 2 train every step, each
    served its own adapter by name, and nothing is left running."""
    sweep, steps = tmp_path / "sw", 8
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "-m", *SMALL, "inference.shared=true",
         "max_restarts=0", f"max_steps={steps}", f"hydra.sweep.dir={sweep}",
         "algorithm.lr=1e-3,2e-3,3e-3"],
        cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            victim = next(
                (p for p in (RunDir(d).pids for d in sweep.glob("1-*")) if p.exists()), None
            )
            if victim is not None and "trainer" in json.loads(victim.read_text()):
                break
            time.sleep(0.2)
        assert victim is not None, "point 1 never started"
        trained = {
            p.name[0]: sum(map(is_train, RunDir(p).read_metrics())) for p in sweep.glob("[02]-*")
        }
        os.killpg(json.loads(victim.read_text())["trainer"], signal.SIGKILL)
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, output[-4000:]
    assert "point-1" in output and "1 point(s) of the sweep did not finish" in output
    resume = next(x for x in output.splitlines() if x.startswith("point-1: to resume at"))
    assert hydra_value(resume, "resume") == str(next(sweep.glob("1-*")))
    assert len(trained) == 2 and max(trained.values()) < steps  # both still had steps to go
    base = sweep / BASE / "weights" / "step_0"
    points = sorted(p for p in sweep.iterdir() if p.name[0].isdigit())
    assert [p.name[0] for p in points] == ["0", "1", "2"]
    statuses = []
    for point in points:
        run = RunDir(point)
        summary = json.loads(run.summary.read_text())
        statuses.append(summary["status"])
        config = run.load_config()
        assert config.model.path == str(base) and config.warmup.steps == 0
        assert config.inference.shared
        if summary["status"] == "finished":
            assert summary["steps"] == steps
            assert sorted(r["step"] for r in run.read_metrics() if is_train(r)) == list(
                range(1, steps + 1)
            )
        for pgid in run.read_pids().values():
            assert not group_alive(pgid)
    assert statuses == ["finished", "failed", "finished"]
    service = RunDir(sweep / SERVICE)
    assert [p.name for p in service.logs.glob("*.log")] == ["inference-0.log"]
    log = (service.logs / "inference-0.log").read_text()
    for point, name in ((points[0], "point-0"), (points[2], "point-2")):  # each by its name
        assert f"{point}/weights/step_{steps} as {name}" in log
        assert f"{point}/weights/step_0 as {name}" in log  # the base, its first version
    for pgid in service.read_pids().values():
        assert not group_alive(pgid)
    table = (sweep / "sweep_summary.md").read_text()
    assert table.count("| finished |") == 2 and table.count("| failed |") == 1
