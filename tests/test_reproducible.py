"""A run is a function of its config: the same config, seed and layout twice give the same
records (every field but timing, throughput and memory) and the same last weights, byte for
byte; another seed gives another run, from the same base.

Each layout runs twice, the second time beside a CPU-heavy process (another run of Relay's),
so the two see different timing. Kills, hangs and restarts are tests/test_faults.py's: its
disturbed run must equal its undisturbed one in the same way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl.core.paths import ROOT
from tests.support.repro import differences, records_by_step
from tests.support.runs import child_env, rl_command, run_to_end

pytestmark = pytest.mark.slow

STEPS = ["max_steps=8", "environment.eval_every=4"]
LAYOUTS = {
    "async_level=2": ["algorithm.async_level=2"],
    "two replicas": ["parallel.inference.replicas=2"],
    "trainer world 2": ["parallel=fsdp", "parallel.trainer.dp_shard=2"],
    "wordle": ["environment=wordle", "model.inference.max_model_len=512", "max_steps=4"],
    "lora": ["model.lora.rank=8", "algorithm.lr=3e-3"],
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("relay_cache")


def busy(run_dir: Path, cache: Path) -> subprocess.Popen[bytes]:
    """Another run of Relay's, in the background: CPU-heavy, with timing of its own."""
    return subprocess.Popen(
        rl_command(run_dir, "max_steps=100000"),
        cwd=ROOT,
        env=child_env(cache, WANDB_MODE="disabled"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def twice(tmp: Path, cache: Path, *overrides: str) -> tuple[Path, Path]:
    """The same run twice: alone, then beside a busy one."""
    first, second = tmp / "alone", tmp / "beside"
    run_to_end(first, cache, *STEPS, *overrides, WANDB_MODE="disabled")
    other = busy(tmp / "busy", cache)
    try:
        run_to_end(second, cache, *STEPS, *overrides, WANDB_MODE="disabled")
    finally:
        os.killpg(other.pid, 9)
        other.wait()
    return first, second


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_same_config_gives_the_same_run(tmp_path: Path, cache: Path, layout: str) -> None:
    first, second = twice(tmp_path, cache, *LAYOUTS[layout])
    assert differences(first, second) == []
    summary = json.loads((first / "summary.json").read_text())
    assert summary["reproducible"] and summary["seed"] == 0 and summary["inexact"] == []


def test_another_seed_gives_another_run_from_the_same_base(tmp_path: Path, cache: Path) -> None:
    seeds = [tmp_path / f"seed{seed}" for seed in (0, 1)]
    for seed, run_dir in enumerate(seeds):
        run_to_end(run_dir, cache, *STEPS, f"seed={seed}", WANDB_MODE="disabled")
    assert differences(*seeds), "seeds 0 and 1 ran the same run"
    zero, one = (records_by_step(run_dir) for run_dir in seeds)
    # The warm-up and the base have seeds of their own: both seeds start from the same policy.
    assert zero[("eval", 0)] == one[("eval", 0)]
    assert zero[("train", 1)]["reward/mean"] != one[("train", 1)]["reward/mean"]
    assert json.loads((seeds[1] / "summary.json").read_text())["seed"] == 1


def test_the_plan_says_what_makes_a_run_inexact(cache: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "dry_run=true", "algorithm.schedule=newest"],
        cwd=ROOT, env=child_env(cache), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    header = out.stdout.splitlines()[0]
    assert "seed 0, not reproducible (algorithm.schedule=newest" in header
    plain = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "dry_run=true"],
        cwd=ROOT, env=child_env(cache), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert plain.stdout.splitlines()[0].endswith("seed 0, reproducible")
