"""Evaluation beyond the run's own held-out set: `eval.environments` evaluates more held-out
sets at every eval, and `rl action=eval run_dir=R step=N` evaluates a version of a finished
run without training (a run of no step from its weights), as the run itself did."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.runs import ROOT, SMALL, child_env, run_to_end

EXTRA = "eval.environments=[{option: arithmetic, eval_size: 8}]"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict]]:
    """A 3-step run evaluating arithmetic's held-out set beside its own."""
    root = tmp_path_factory.mktemp("eval")
    records = run_to_end(root / "run", root / "cache", "max_steps=3", EXTRA,
                         WANDB_MODE="disabled")  # fmt: skip
    return root / "run", root / "cache", records


def rl(run: Path, cache: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", "action=eval", f"run_dir={run}",
         f"hydra.run.dir={out}", *overrides],
        cwd=ROOT, env=child_env(cache, WANDB_MODE="disabled"), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def evals(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "eval"]


def test_each_eval_environment_is_logged_summarised_and_shown(
    trained: tuple[Path, Path, list[dict]],
) -> None:
    run, _, records = trained
    found = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in found] == [0, 3]
    for r in found:
        assert r["eval/arithmetic/samples"] == 8 and "eval/arithmetic/reward/mean" in r
        assert r["eval/samples"] == 16  # the run's own held-out set, as without
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval/arithmetic/exact_match/last"] == found[-1]["eval/arithmetic/exact_match"]


def test_action_eval_evaluates_a_step_as_the_run_did(
    trained: tuple[Path, Path, list[dict]], tmp_path: Path
) -> None:
    """The researcher's "evaluate a checkpoint without training": greedy, the eval of step 3
    is the run's own eval of version 3, record for record; sampled, it adds pass@k."""
    run, cache, _ = trained
    out = rl(run, cache, tmp_path / "greedy", "step=3")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "no RL step, an eval of version 0" in out.stdout
    assert "done in" in out.stdout and f"eval of {run}/weights/step_3: exact_match" in out.stdout
    (again,) = evals(tmp_path / "greedy")
    (own,) = [r for r in evals(run) if r["step"] == 3]
    assert again["step"] == 0 and not (tmp_path / "greedy" / "checkpoints" / "step_1").exists()
    for key in ("eval/exact_match", "eval/reward/mean", "eval/arithmetic/reward/mean"):
        assert again[key] == own[key], key
    sampled = rl(run, cache, tmp_path / "sampled", "step=3", "eval.samples=4",
                 "eval.temperature=1.0")  # fmt: skip
    assert sampled.returncode == 0, sampled.stdout[-3000:] + sampled.stderr[-3000:]
    (record,) = evals(tmp_path / "sampled")
    assert record["eval/k"] == 4 and 0 <= record["eval/pass_at_k"] <= 1


def test_action_eval_refuses_what_would_change_the_trained_run(
    trained: tuple[Path, Path, list[dict]], tmp_path: Path
) -> None:
    run, cache, _ = trained
    out = rl(run, cache, tmp_path / "other", "algorithm=grpo")
    assert out.returncode == 2 and "action=eval: algorithm=grpo would change what" in out.stderr
    assert not (tmp_path / "other").exists()  # nothing half-written


def test_an_eval_environment_that_cannot_be_evaluated_is_refused_at_plan_time() -> None:
    from launcher.errors import PlanError
    from launcher.plan.planner import plan
    from tests.support.runs import compose_run

    for spec, said in [("[{option: wordle}]", "wordle is multi-turn"),
                       ("[{option: nope}]", "no environment option 'nope'")]:  # fmt: skip
        with pytest.raises(PlanError, match=said):
            plan(compose_run(*SMALL, f"eval.environments={spec}"))
