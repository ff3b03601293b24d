"""Checkpoints kept as `trainer.keep_checkpoints` and `keep_checkpoint_steps` say, pruned only
once a newer one is complete, and `rl action=export step=N` from any kept one: its float32
master weights written as full HF weights in the model's dtype (a LoRA run's adapter merged
into its version 0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from rl.core.model import load_model
from rl.core.paths import ROOT
from rl.core.rundir import RunDir, mark_complete, step_versions
from tests.support import dist_workers, parallel
from tests.support.parallel import prepare

cache = parallel.cache  # the module's model cache (a fixture)

STEPS = 5
KEPT = ("trainer.keep_checkpoints=2", "trainer.keep_checkpoint_steps=[2]")
RUNS = {  # id -> (world, overrides)
    "fsdp2-bf16": (2, ["parallel=fsdp", "model.dtype=bfloat16", *KEPT]),
    "lora": (1, ["parallel=single", "model.lora.rank=8", *KEPT]),
}


@pytest.fixture(scope="module")
def runs(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each run's 5 steps with a checkpoint after each (dist_workers.checkpointed_steps)."""
    tmp = tmp_path_factory.mktemp("kept")
    found = {}
    for name, (world, overrides) in RUNS.items():
        run_dir, init = prepare(tmp, name, *overrides)
        out = tmp / f"{name}.pt"
        job = (dist_workers.checkpointed_steps, str(init), str(run_dir), (str(out), STEPS))
        mp.spawn(dist_workers.in_sequence, args=(world, [job]), nprocs=world, join=True)
        found[name] = {"run_dir": run_dir, "saved": torch.load(out)}
    return found


def export(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", "action=export", f"run_dir={run_dir}", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("name", list(RUNS))
def test_the_newest_two_and_the_named_step_are_kept(runs: dict[str, Any], name: str) -> None:
    assert step_versions(RunDir(runs[name]["run_dir"]).checkpoints) == [2, 4, 5]


def test_pruning_spares_what_is_being_written(tmp_path: Path) -> None:
    """Only complete checkpoints count: one still being written (no COMPLETE) is neither kept
    in place of a complete one nor deleted."""
    run = RunDir(tmp_path)
    for step in range(1, 6):
        run.checkpoint_for(step).mkdir(parents=True)
        if step < 5:
            mark_complete(run.checkpoint_for(step))
    assert run.prune_checkpoints(2, [1]) == [2]
    assert step_versions(run.checkpoints) == [1, 3, 4] and run.checkpoint_for(5).is_dir()


def test_a_kept_checkpoint_exports_its_master_weights_in_the_models_dtype(
    runs: dict[str, Any],
) -> None:
    run_dir = runs["fsdp2-bf16"]["run_dir"]
    done = export(run_dir, "step=4")
    assert done.returncode == 0, done.stderr[-3000:]
    target = run_dir / "export" / "step_4"
    assert done.stdout.strip().endswith(f"full weights: {target}")
    tensors = {}
    for file in target.glob("*.safetensors"):
        tensors.update(load_file(file))
    master = runs["fsdp2-bf16"]["saved"][4]["weights"]
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    for name, tensor in tensors.items():
        assert torch.equal(tensor, master[name].to(torch.bfloat16)), name
    assert json.loads((target / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_lora_checkpoint_exports_merged_into_version_0(runs: dict[str, Any]) -> None:
    run = runs["lora"]
    done = export(run["run_dir"], "step=2")
    assert done.returncode == 0, done.stderr[-3000:]
    model = load_model(run["run_dir"] / "export" / "step_2").eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 10, 11, 12, 13, 14]])).logits
    torch.testing.assert_close(logits, run["saved"][2]["logits"], rtol=0, atol=1e-5)


def test_a_step_with_nothing_kept_is_refused_naming_what_is(runs: dict[str, Any]) -> None:
    done = export(runs["fsdp2-bf16"]["run_dir"], "step=3")
    assert done.returncode != 0 and done.stdout == ""
    assert "step=3: " in done.stderr and "checkpoints: [2, 4, 5]" in done.stderr
    assert not (runs["fsdp2-bf16"]["run_dir"] / "export" / "step_3").exists()
