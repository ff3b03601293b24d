"""`rl action=status` on local runs: the state, the step with its ETA, the last eval, the
logs, and the newest run whatever its name. Run directories are written here by hand, with a
real process standing in for a live role."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from omegaconf import OmegaConf

from launcher.slurm import find_run, format_status
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
        status = format_status(run)
    finally:
        role.kill()
        role.wait()
    assert status.splitlines()[0] == f"run {run.root}: running"
    assert "latest step 4/10: reward 0.400, ETA 12s" in status  # 6 steps left at 2 s each
    assert "latest eval at version 0: exact_match 0.250" in status
    assert f"logs: {run.logs}/" in status


def test_an_ended_run_says_how(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", "ended", steps=3)
    run.write_pids({"trainer": 2**22 + 1})  # no such process group: nothing is alive
    status = format_status(run)
    assert status.splitlines()[0].endswith(": interrupted") and "ETA" not in status
    assert f"uv run rl resume={run.root}" in status
    for how in ("finished", "failed"):
        run.summary.write_text(json.dumps({"status": how}))
        assert format_status(run).splitlines()[0].endswith(f": {how}")


def test_status_finds_the_newest_run_of_any_name(tmp_path: Path) -> None:
    outputs = tmp_path / "outputs"
    older = make_run(outputs / "reverse_text-tiny" / "2026-01-01_00-00-00", "reverse_text-tiny", 2)
    newer = make_run(outputs / "wordle-tiny" / "2026-01-02_00-00-00", "wordle-tiny", 2)
    os.utime(older.config, (1, 1))
    here = outputs / "reverse_text-tiny" / "2026-01-03_00-00-00"  # this command's own dir
    cfg = OmegaConf.create({"run_dir": None, "name": "reverse_text-tiny"})
    assert find_run(cfg, here).root == newer.root


def test_a_groups_lead_is_judged_against_the_spread_across_seeds() -> None:
    from launcher.sweep_summary import verdict

    clear = verdict({"lr=a": [0.70, 0.72, 0.71], "lr=b": [0.50, 0.52, 0.49]})
    assert clear.startswith("Best: `lr=a` (last eval 0.710); its lead over `lr=b` is 0.207")
    assert "larger than the spread across seeds (sd 0.015): a real lead" in clear
    noisy = verdict({"lr=a": [0.80, 0.60, 0.70], "lr=b": [0.65, 0.66, 0.64]})
    assert "Best: `lr=a`" in noisy and "within the spread across seeds (sd 0.100)" in noisy
    assert "one seed a side" in verdict({"a": [0.7], "b": [0.6]})
    assert verdict({"a": [0.7]}).startswith("One group")
