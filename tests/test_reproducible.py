"""A run is a function of its config: the same config, seed and layout twice give the same
records (every field but timing, throughput and memory) and the same last weights, byte for
byte.

The runs of a comparison go side by side, each beside the others (CPU-heavy processes with
timing of their own), in two layouts that together hold what could make a run depend on its
timing: staleness 2, two inference replicas, a trainer world of two (FSDP over gloo) and a
LoRA adapter in one; a multi-turn environment (wordle) in the other. Kills, hangs and
restarts are tests/test_faults.py's: its disturbed run must equal its undisturbed one too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rl.core.paths import ROOT
from tests.support.repro import differences
from tests.support.runs import assert_no_process_left, child_env, rl_command

pytestmark = pytest.mark.slow

LAYOUTS = {
    "async 2, two replicas, trainer world 2, LoRA": [
        "max_steps=6", "environment.eval_every=3", "algorithm.async_level=2",
        "parallel.inference.replicas=2", "parallel=fsdp", "parallel.trainer.dp_shard=2",
        "model.lora.rank=8", "algorithm.lr=3e-3",
    ],
    "wordle": [
        "environment=wordle", "model.inference.max_model_len=512", "max_steps=2",
        "environment.eval_every=2",
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("relay_cache")


def side_by_side(runs: dict[Path, list[str]], cache: Path) -> None:
    """Every run at once, each beside the others; all must finish and leave nothing behind."""
    env = child_env(cache, WANDB_MODE="disabled")
    started = {
        run_dir: subprocess.Popen(
            rl_command(run_dir, *overrides),
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for run_dir, overrides in runs.items()
    }
    for run_dir, proc in started.items():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
        assert_no_process_left(run_dir)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_same_config_gives_the_same_run(tmp_path: Path, cache: Path, layout: str) -> None:
    """Two runs of one config, side by side, are the same run. (Another seed gives another
    run from the same base: tests/test_run.py's sweep over seeds.)"""
    overrides = LAYOUTS[layout]
    side_by_side({tmp_path / "first": overrides, tmp_path / "second": overrides}, cache)
    assert differences(tmp_path / "first", tmp_path / "second") == []
    summary = json.loads((tmp_path / "first" / "summary.json").read_text())
    assert summary["reproducible"] and summary["seed"] == 0 and summary["inexact"] == []


def test_the_plan_says_what_makes_a_run_inexact(cache: Path) -> None:
    def header(*overrides: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "launcher.cli", "dry_run=true", *overrides],
            cwd=ROOT, env=child_env(cache), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()[0]

    assert header().endswith("seed 0, reproducible")
    newest = header("algorithm.schedule=newest", "seed=3")
    assert "seed 3, not reproducible (algorithm.schedule=newest" in newest
