"""`rl action=status` on local runs: the state, the step with its ETA, the last eval, the wall
time, where the logs, plot and summary are, and the newest run whatever its name; answered
without Hydra, numpy or torch. Run directories are written here by hand, with a real process
standing in for a live role."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.watch.status import fast_status, find_run, format_status
from rl.core.paths import ROOT
from rl.core.rundir import RunDir
from tests.support.runs import compose_run


def make_run(root: Path, name: str, steps: int, max_steps: int = 10) -> RunDir:
    run = RunDir(root)
    run.create(compose_run(f"name={name}", f"max_steps={max_steps}"), "t0ken")
    now = time.time()
    for step in range(1, steps + 1):  # a step every 2 s, the last one now
        record = {"kind": "train", "step": step, "reward/mean": 0.1 * step}
        run.append_metrics({**record, "timestamp": now - 2.0 * (steps - step)})
    run.append_metrics(
        {"kind": "eval", "step": 0, "eval/exact_match": 0.25, "eval/reward/mean": 0.5}
    )
    return run


def test_a_live_run_says_running_with_its_eta(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", "live", steps=4)
    role = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        run.write_pids({"trainer": role.pid})
        run.wall_time.write_text("75.0")
        status = format_status(run)
    finally:
        role.kill()
        role.wait()
    assert status.splitlines()[0] == f"run {run.root}: running"
    # The step's reward, then the mean summary.json's reward/last holds (it was the step's
    # alone, unlike the summary's); 6 steps left at 2 s each.
    assert "latest step 4/10: reward 0.400 (mean of the last 4 steps 0.250), ETA 12s" in status
    assert "latest eval at version 0: exact_match 0.250" in status
    assert "wall time 1m15s so far" in status
    assert f"logs: {run.logs}/" in status
    assert "plot:" not in status and "summary:" not in status  # neither is written yet


def test_an_ended_run_says_how(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", "ended", steps=3)
    run.write_pids({"trainer": 2**22 + 1})  # no such process group: nothing is alive
    status = format_status(run)
    assert status.splitlines()[0].endswith(": interrupted") and "ETA" not in status
    assert f"uv run rl resume={run.root}" in status
    for how in ("finished", "failed"):
        run.summary.write_text(json.dumps({"status": how, "wall_s": 61.4}))
        assert format_status(run).splitlines()[0].endswith(f": {how}")
    run.reward_plot.write_bytes(b"")
    status = format_status(run).splitlines()
    assert "  wall time 1m01s" in status
    assert status[-2:] == [f"  plot: {run.reward_plot}", f"  summary: {run.summary}"]


def test_status_finds_the_newest_run_of_any_name(tmp_path: Path) -> None:
    outputs = tmp_path / "outputs"
    older = make_run(outputs / "reverse_text-tiny" / "2026-01-01_00-00-00", "reverse_text-tiny", 2)
    newer = make_run(outputs / "wordle-tiny" / "2026-01-02_00-00-00", "wordle-tiny", 2)
    os.utime(older.config, (1, 1))
    assert find_run(None, outputs).root == newer.root


def test_status_answers_without_hydra_numpy_or_torch(tmp_path: Path) -> None:
    """`rl action=status` is answered before anything heavy is imported (composing the config
    alone takes seconds); a command line it does not know is left to Hydra."""
    run = make_run(tmp_path / "run", "quick", steps=2)
    heavy = ("torch", "transformers", "hydra", "omegaconf", "numpy", "submitit", "matplotlib")
    code = (
        "import sys; from launcher.cli import main; "
        f"sys.argv = ['rl', 'action=status', 'run_dir={run.root}']; main(); "
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"run {run.root}: interrupted")
    assert out.stdout.splitlines()[-1] == "[]"
    assert not fast_status(["action=status", f"hydra.run.dir={tmp_path}"])
    assert not fast_status(["action=cancel", f"run_dir={run.root}"])


def test_a_groups_lead_is_judged_by_welchs_t_test_over_the_seeds() -> None:
    from launcher.sweeps.summary import incomplete_beta, verdict

    clear = verdict({"lr=a": [0.70, 0.72, 0.71], "lr=b": [0.50, 0.52, 0.49]})
    assert clear.startswith(
        "Best by eval/exact_match/last: `lr=a` (0.710); its lead over `lr=b` is 0.207; "
        "Welch's t-test over the seeds (n=3 vs 3): p=0.000"
    )
    assert clear.endswith("a real lead at p < 0.05.")
    noisy = verdict({"lr=a": [0.80, 0.60, 0.70], "lr=b": [0.65, 0.66, 0.64]}, "reward/last")
    assert noisy.startswith("Best by reward/last: `lr=a`") and "p=0.478" in noisy
    assert noisy.endswith("not told apart from noise at p < 0.05.")
    assert "one seed a side" in verdict({"a": [0.7], "b": [0.6]})
    assert verdict({"a": [0.7]}).startswith("One group")
    # Student's t at its tabled two-sided 5% points: 12.706 (1 df), 2.776 (4), 2.228 (10).
    for df, t in ((1, 12.706), (4, 2.776), (10, 2.228)):
        assert incomplete_beta(df / (df + t * t), df / 2, 0.5) == pytest.approx(0.05, abs=2e-4)


def test_the_plot_is_titled_by_the_run_and_shows_each_evals_standard_error(tmp_path: Path) -> None:
    from launcher.watch.report import figure, plot_title

    run = make_run(tmp_path / "reverse_text-tiny" / "2026-01-01_00-00-00", "reverse_text-tiny", 3)
    last = {"kind": "eval", "step": 3, "eval/exact_match": 0.5, "eval/reward/mean": 0.6}
    fig = figure([*run.read_metrics(), {**last, "eval/samples": 100}], plot_title("rt", run))
    ax = fig.axes[0]
    assert ax.get_title() == "rt  2026-01-01_00-00-00"
    (bars,) = ax.containers
    assert bars.get_label() == "eval exact match (± SE)"
    (segments,) = bars.lines[2]
    low, high = segments.get_segments()[1][:, 1]  # version 3: 0.5 ± sqrt(0.5 * 0.5 / 100)
    assert (low, high) == pytest.approx((0.45, 0.55))
