"""One GPU is enough to start: GPUs found on this machine (not declared), and the shared
placement the planner makes when inference and trainer must use the same GPU."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.errors import PlanError
from launcher.plan import gpus
from launcher.plan.planner import format_plan, plan
from tests.support.runs import ROOT, compose_run

FIXTURES = ROOT / "tests" / "fixtures"


def test_nvidia_smi_output_parses() -> None:
    (rtx,) = gpus.parse((FIXTURES / "nvidia-smi-rtx4090.csv").read_text())
    assert rtx == gpus.Gpu(0, "NVIDIA GeForce RTX 4090", 24.0)
    node = gpus.parse((FIXTURES / "nvidia-smi-8xh100.csv").read_text())
    assert [g.index for g in node] == list(range(8))
    assert {g.memory_gb for g in node} == {79.6}


@pytest.fixture
def fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An `nvidia-smi` on PATH that prints a fixture, as the real one would."""

    def install(fixture: str | None) -> None:
        smi = tmp_path / "nvidia-smi"
        body = (
            f"cat {FIXTURES / fixture}" if fixture else "echo 'NVIDIA-SMI has failed' >&2; exit 9"
        )
        smi.write_text(f"#!/bin/sh\n{body}\n")
        smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    return install


def test_local_gpus_are_found_not_declared(fake_nvidia_smi) -> None:
    fake_nvidia_smi("nvidia-smi-rtx4090.csv")
    p = plan(compose_run("model=qwen3_0_6b"))
    cfg = p.config
    assert cfg.cluster.gpus_per_node == 1 and cfg.cluster.gpu_memory_gb == 24.0
    assert "found 1 GPU(s): NVIDIA GeForce RTX 4090, 24 GB each" in p.notes
    # Declared values win over what is found.
    cfg = compose_run("model=qwen3_0_6b", "cluster.gpus_per_node=0")
    assert plan(cfg).role("trainer")[0].gpus_per_node == 0


def test_a_failing_or_missing_nvidia_smi_means_cpu(fake_nvidia_smi) -> None:
    fake_nvidia_smi(None)
    p = plan(compose_run())
    assert "no GPU found (nvidia-smi): running on CPU" in p.notes
    assert p.config.cluster.gpus_per_node == 0


# One 24 GB GPU, serving samples of 16,384 tokens (not the smoke test's 256; Qwen3-0.6B's own
# 32,768 do not fit beside its float32 master state: the refusal below).
ONE_24GB_GPU = (
    "cluster.gpus_per_node=1",
    "cluster.gpu_memory_gb=24",
    "environment.max_context_tokens=16384",
)


@pytest.mark.parametrize(
    ("model", "utilization", "checkpointing"),
    [("qwen3_0_6b", "0.17", True), ("smollm2_135m", "0.06", False)],
)
def test_one_24gb_gpu_is_shared_by_inference_and_trainer(
    model: str, utilization: str, checkpointing: bool
) -> None:
    p = plan(compose_run(f"model={model}", *ONE_24GB_GPU))
    cfg = p.config
    (server,) = p.role("inference")
    (trainer,) = p.role("trainer")
    vllm = server.argv[server.argv.index("--") + 1 :]
    assert vllm[vllm.index("--gpu-memory-utilization") + 1] == utilization
    assert vllm[vllm.index("--max-model-len") + 1] == str(p.max_model_len)
    assert server.env["CUDA_VISIBLE_DEVICES"] == trainer.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert server.gpus_per_node == trainer.gpus_per_node == 1
    split = next(n for n in p.notes if n.startswith("one GPU (24 GB) shared"))
    assert f"--gpu-memory-utilization {utilization}" in split
    # Without activation checkpointing and the LM head in chunks qwen3_0_6b's trainer does not
    # fit beside inference: the planner turns them on and says so; smollm2_135m fits as it is.
    assert cfg.trainer.activation_checkpointing is checkpointing
    assert (cfg.trainer.lm_head_chunk == 2048) is checkpointing
    turned_on = "trainer.activation_checkpointing=true and trainer.lm_head_chunk=2048 turned on"
    assert any(n.startswith(turned_on) for n in p.notes) is checkpointing
    assert split in format_plan(p, cfg)


def test_a_model_that_cannot_share_the_gpu_is_refused_with_its_numbers() -> None:
    cfg = compose_run(
        "model=qwen3_0_6b",
        "cluster.gpus_per_node=1",
        "cluster.gpu_memory_gb=12",
        "environment.max_context_tokens=null",  # served at the model's own length
    )
    with pytest.raises(PlanError) as refused:
        plan(cfg)
    message = str(refused.value)
    assert message.startswith("cluster.gpus_per_node=1: model=qwen3_0_6b does not fit one 12 GB")
    assert "inference (5.6 GB: weights 1.1, KV cache 3.5)" in message
    # launcher/plan/costs/memory.py's count for one process: 0.596B parameters x 18 bytes (float32
    # weights, gradients and two AdamW moments, autocast's bf16 copy) = 10.0 GiB; for the
    # longest sample, 32,768 tokens: logits 46.4 (x 151,936 x (2 + 8) bytes), the packed rows'
    # mask 0.2 (8192^2 x 3 bytes), every block's activations 36.7 = 83.3 GiB.
    assert "trainer (94.3 GB: state 10.0, activations 83.3), 99.9 GB in all" in message
    assert "18.4 GB for the trainer with activation checkpointing and the LM head in chunks"
    for remedy in ("micro_batch_tokens", "max_model_len"):
        assert remedy in message
    assert "one process offloads nothing" in message  # cpu_offload is no remedy here
    # nothing half-changed
    assert cfg.trainer.activation_checkpointing is False and cfg.trainer.lm_head_chunk == 0


def test_two_gpus_give_each_role_its_own() -> None:
    p = plan(compose_run("model=qwen3_0_6b", "cluster.gpus_per_node=2", "cluster.gpu_memory_gb=24"))
    assert not any("shared" in n for n in p.notes)
    (server,) = p.role("inference")
    (trainer,) = p.role("trainer")
    assert server.env["CUDA_VISIBLE_DEVICES"] == "0" and trainer.env["CUDA_VISIBLE_DEVICES"] == "1"


def run_on_the_gpu(tmp_path: Path, *overrides: str) -> dict:
    """A short reverse-text run with embedded inference on this machine's one GPU (found by
    nvidia-smi); its summary."""
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "max_steps=20", "warmup.steps=20",
         "inference.backend=embedded", "environment.eval_size=64", f"hydra.run.dir={run_dir}",
         *overrides],
        cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled", "CUDA_VISIBLE_DEVICES": "0"},
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert " on cuda:0: " in trainer_log, trainer_log[-2000:]  # the trainer's device
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.gpu
@pytest.mark.slow
def test_shared_placement_trains_on_one_gpu(tmp_path: Path) -> None:
    summary = run_on_the_gpu(tmp_path, "cluster.gpus_per_node=1")
    assert summary["status"] == "finished" and summary["steps"] == 20
    plan = (tmp_path / "run" / "plan.json").read_text()
    assert "shared by inference and trainer, side by side" in plan


@pytest.mark.gpu
@pytest.mark.slow
def test_colocated_placement_trains_on_one_gpu(tmp_path: Path) -> None:
    summary = run_on_the_gpu(tmp_path, "cluster.gpus_per_node=1", "placement=colocated")
    assert summary["status"] == "finished" and summary["steps"] == 20
    log = (tmp_path / "run" / "logs" / "orchestrator.log").read_text()
    assert "Traceback" not in log


@pytest.mark.gpu
@pytest.mark.slow
def test_lora_trains_on_one_gpu(tmp_path: Path) -> None:
    """A LoRA run on the GPU (shared placement): adapters published and served."""
    summary = run_on_the_gpu(tmp_path, "cluster.gpus_per_node=1", "model.lora.rank=16")
    assert summary["status"] == "finished" and summary["steps"] == 20
    assert summary["weights/update_bytes"] * 10 < summary["weights/full_bytes"]
    adapter = tmp_path / "run" / "weights" / "step_20" / "adapter_model.safetensors"
    assert adapter.is_file()
    log = (tmp_path / "run" / "logs" / "inference-0.log").read_text()
    assert "loaded version 20 from " in log


@pytest.mark.slow
def test_gpu_check_skips_without_a_gpu_and_runs_its_steps_with_one(
    tmp_path: Path, fake_nvidia_smi
) -> None:
    """.ci/gpu-check as far as a CPU machine takes it: without nvidia-smi it skips; with one
    that answers (a fake, reporting one RTX 4090) it saves the query, runs the gpu tests (which
    skip here, torch seeing no CUDA device) and two of its short runs, and prints their
    samples/s."""
    script = ROOT / ".ci" / "gpu-check"
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    bare = subprocess.run([script, tmp_path / "bare"], env=env, capture_output=True, text=True)
    assert bare.returncode == 0 and bare.stdout.strip() == "no GPU: skipped"
    fake_nvidia_smi("nvidia-smi-rtx4090.csv")
    figures = "--model tiny --tokens 32 --batch 4 --prompt 8 --new 4 --steps 1 --no-compile"
    quick = {**os.environ, "GPU_CHECK_STEPS": "4", "GPU_CHECK_RUN_S": "600",
             "GPU_CHECK_RUNS": "gpu cpu", "GPU_CHECK_FIGURES": figures}  # fmt: skip
    out = subprocess.run([script, tmp_path / "out"], env=quick, capture_output=True, text=True)
    log = (tmp_path / "out" / "gpu-check.log").read_text()
    assert out.returncode == 0, log[-3000:]
    saved = (tmp_path / "out" / "nvidia-smi.csv").read_text()
    assert saved == (FIXTURES / "nvidia-smi-rtx4090.csv").read_text()
    assert "== gpu tests" in log and "skipped" in log
    report = json.loads((tmp_path / "out" / "gpu-figures.json").read_text())
    assert report["device"] == "cpu" and report["decode"]["tokens_per_s"] > 0
    rates = [x for x in log.splitlines() if x.split()[:1] in (["gpu"], ["cpu"], ["lora-gpu"])]
    assert [x.split()[0] for x in rates] == ["gpu", "cpu"], log[-3000:]
    assert all(" samples/s " in x for x in rates), log[-3000:]
    assert log.rstrip().splitlines()[-1].startswith("gpu-check: passed")
