"""A full disk ends a run in one line that names the file and the space left, not a traceback:
in the run directory's writers, in a role (which exits with rl/core/disk.py's EXIT_CODE and is
not restarted), in the local launcher's own writes (roles stopped, summary.json where there is
room for it, the resume command), and in a whole run whose checkpoints and weights fill the
disk. The plan warns first when the disk is too small for them.

Each test mounts a small tmpfs as the run directory (a real ENOSPC; root only, as on CI).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from launcher.clusters.base import Process
from launcher.clusters.local.launch import run_local
from launcher.clusters.processes import RoleDiskFull, check_children, spawn, stop_children
from launcher.plan.checks import disk_warning
from launcher.plan.costs.fit import disk_need
from launcher.plan.planner import plan
from rl.core import disk, wire
from rl.core.auth import token_auth
from rl.core.disk import DiskFull, writing
from rl.core.model import publish_dir
from rl.core.records import Group
from rl.core.rundir import RunDir, append_jsonl, is_complete, read_jsonl, write_atomic
from rl.core.runtime import wait_for_address
from rl.queue.store import Store
from tests.support.disk import MB, fill, small_disk
from tests.support.faults import trained_steps
from tests.support.runs import (
    ROOT,
    SMALL,
    TOKEN,
    assert_no_process_left,
    child_env,
    compose_run,
    declare_run_state,
    processes_of,
    rl_command,
)

FREE = re.compile(r"\(No space left on device; [\d.]+ [KMG]?B free on its filesystem\)")
ROOM = re.compile(  # a write that failed, or one not started for want of room
    r"\((No space left on device|it needs ~[\d.]+ [KMG]?B); [\d.]+ [KMG]?B free on its filesystem\)"
)


def test_writers_name_the_file_and_leave_nothing_half_written(tmp_path: Path) -> None:
    """On a full disk each writer of the run directory raises DiskFull naming its file and the
    space left: a published directory leaves no partial copy (its space is free again), an
    atomic write no temporary file, an append no part of a line, torch.save (whose error loses
    the errno) no partial file, and the queue's store keeps nothing of the push."""
    with small_disk(tmp_path / "disk", 2 * MB) as root:
        metrics = root / "metrics.jsonl"
        append_jsonl(metrics, {"kind": "train", "step": 1})
        store = Store(root / "queue.sqlite")
        (root / "ballast").write_bytes(b"\0" * (disk.free_bytes(root) - 50_000))
        target = root / "weights" / "step_1"
        target.parent.mkdir()

        def write(tmp: Path) -> None:  # fails part way: 100 KB into the 50 KB left
            tmp.mkdir()
            (tmp / "model.safetensors").write_bytes(b"\0" * 100_000)

        with pytest.raises(DiskFull) as published:
            publish_dir(target, write)
        assert str(published.value).startswith(f"disk full writing {target} (")
        assert FREE.search(str(published.value)), str(published.value)
        assert list(target.parent.iterdir()) == []  # neither the target nor its .tmp
        assert disk.free_bytes(root) >= 40_000  # the partial copy's space is free again
        fill(root)
        with pytest.raises(DiskFull, match=re.escape(f"disk full writing {root / 'plan.json'} (")):
            write_atomic(root / "plan.json", "x" * 100_000)
        assert not (root / "plan.json").exists()
        assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []
        before = metrics.read_bytes()
        with pytest.raises(DiskFull, match=re.escape(f"disk full writing {metrics} (")):
            append_jsonl(metrics, {"kind": "train", "step": 2, "pad": "x" * 100_000})
        assert metrics.read_bytes() == before
        reference = root / "checkpoints" / "reference.pt"
        reference.parent.mkdir()
        with pytest.raises(DiskFull, match=re.escape(f"disk full writing {reference} (")):
            with writing(reference, partial=reference):  # its error has no errno: no room does
                torch.save({"w": torch.zeros(100_000)}, reference)
        assert not reference.exists()
        groups = [Group([], 0, 0)] * 3
        with pytest.raises(DiskFull, match=re.escape(f"disk full writing {store.path} (")):
            store.push(groups, batch=0, body=b"\0" * 500_000)
        assert store.next_batch() == 0 and store.count("ready") == 0


# A role that lives until it is stopped, beating as roles do.
SLEEPER = """
import sys, time
from pathlib import Path
from rl.core.runtime import start_heartbeat
start_heartbeat(Path(sys.argv[1]), 120.0)
time.sleep(300)
"""


def test_the_launcher_ends_on_a_full_disk_in_its_own_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The local launcher starts a run whose disk is full: its first write of its own (the
    roles' process groups, pids.json) ends the run in one line naming that file and the space
    left; it stops the role, says that summary.json found no room, and prints the command that
    resumes the run. No traceback."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    cfg = compose_run(*SMALL)
    run_plan = plan(cfg)
    with small_disk(tmp_path / "disk", MB) as root:
        run = RunDir(root)
        run.create(cfg, TOKEN, run_plan.to_json())
        run.append_metrics({"kind": "rollout", "step": 1})  # left to follow at the end
        argv = [sys.executable, "-c", SLEEPER, str(root)]
        run_plan.processes = [Process("trainer", "trainer", argv, {"PYTHONPATH": str(ROOT)})]
        fill(root)
        with pytest.raises(SystemExit) as ended:
            run_local(cfg, run_plan, resume=run)
        assert ended.value.code == 1
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        lines = err.strip().splitlines()
        assert len(lines) == 3, err
        assert lines[0].startswith(f"error: disk full writing {run.pids} (")
        assert FREE.search(lines[0]), lines[0]
        assert lines[1].startswith(f"error: no summary.json: disk full writing {run.summary} (")
        assert lines[2] == (
            "to resume at step 1: no checkpoint yet, so the warm-up runs again: "
            f"uv run rl resume={root}"
        )
        assert processes_of(root) == []  # the role was stopped


SAMPLE = {
    "prompt_ids": [1, 2],
    "completion_ids": [3] * 50,
    "logprobs": [-0.5] * 50,
    "reward": 0.5,
    "advantage": 0.1,
    "min_version": 0,
    "max_version": 0,
}
GROUP = {"samples": [SAMPLE] * 4, "min_version": 0, "max_version": 0}


@pytest.mark.slow
def test_a_role_on_a_full_disk_ends_the_run_in_one_line(tmp_path: Path) -> None:
    """The queue role (started as the launcher starts it) on a disk that fills: it answers the
    push it has no room for 507 with the reason and exits with the full-disk code and one line
    naming its store, with no traceback (its heartbeat, rewritten in place, beats on); the
    launcher does not spend a restart on it but ends the run with that line."""
    cfg = compose_run()
    log = tmp_path / "queue.log"  # beside the full disk: what the role says is all kept
    with small_disk(tmp_path / "disk", 2 * MB) as root:
        RunDir(root).create(cfg, TOKEN)
        declare_run_state(root, newest_version=0)
        argv = [sys.executable, "-m", "rl.queue", "--run-dir", str(root)]
        env = {**os.environ, "RELAY_TOKEN": TOKEN, "RELAY_RUN_DIR": str(root)}
        children = [spawn("queue", "queue", argv, env, log)]
        try:
            url = wait_for_address(root, "queue", timeout=120)
            fill(root)
            time.sleep(1.0)  # heartbeats go on (the beat interval is 1 s at most)
            pushed = httpx.post(
                f"{url}/push?batch=0",
                content=wire.encode([GROUP] * 3),
                headers={**token_auth(TOKEN).header("/push"), "Content-Type": wire.CONTENT_TYPE},
                timeout=60,
            )
            assert children[0].proc.wait(timeout=120) == disk.EXIT_CODE, log.read_text()
            with pytest.raises(RoleDiskFull) as ended:
                check_children(children, set(), max_restarts=3)
        finally:
            stop_children(children)
    said = log.read_text()
    assert "Traceback" not in said, said
    line = said.strip().splitlines()[-1]
    store = RunDir(root).queue_store
    assert re.fullmatch(rf"queue: disk full writing {store} {FREE.pattern}", line), said
    assert pushed.status_code == 507 and pushed.json()["detail"] == line.removeprefix("queue: ")
    assert str(ended.value) == (
        f"role queue ended on a full disk: {line.removeprefix('queue: ')}; not restarted (a "
        "restart meets the same disk): free space there, then resume"
    )
    assert children[0].restarts == 0


def test_the_plan_warns_when_the_disk_is_too_small_for_checkpoints_and_weights(
    tmp_path: Path,
) -> None:
    """The estimate, by hand for the tiny model (0.0003B float32 parameters: 1.2 MB of
    weights): 10 steps checkpointed every 4 write 3 checkpoints (steps 4, 8, 10) of float32
    master weights and AdamW's two moments, 3.6 MB each, and the two kept and the one being
    written are all 3 on disk at once; version 0, the 3 kept and the one being written are 5
    versions of 1.2 MB; 16.8 MB in all. A resume after step 8 needs the last checkpoint and
    one more version. A dry run on a 4 MB disk says so, before its plan. Over 30 steps the
    checkpoints kept bound it: 3 at once, not 8."""
    cfg = compose_run("max_steps=10", "trainer.checkpoint_every=4")
    assert disk_need(compose_run("max_steps=30", "trainer.checkpoint_every=4")).checkpoints == 3
    need = disk_need(cfg)
    assert (need.checkpoints, need.checkpoint_bytes) == (3, pytest.approx(3.6 * MB))
    assert (need.versions, need.version_bytes) == (5, pytest.approx(1.2 * MB))
    assert need.total == pytest.approx(16.8 * MB) and disk_need(cfg, done=8).total == (
        pytest.approx(4.8 * MB)
    )
    with small_disk(tmp_path / "disk", 4 * MB) as root:
        assert disk_warning(cfg, tmp_path) is None  # the machine's own disk has room
        run_dir = root / "run"
        out = subprocess.run(
            [*rl_command(run_dir, "max_steps=10", "trainer.checkpoint_every=4"), "dry_run=true"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [
        f"warning: {run_dir} has 4.0 MB free, and this run's checkpoints and published weights "
        "need ~16.8 MB: 3 checkpoint(s) at once of ~3.6 MB (master weights and AdamW's two "
        "moments in float32; trainer.keep_checkpoints=2, checkpoint_every=4, max_steps=10), 5 "
        "published version(s) of ~1.2 MB at once (trainer.keep_weights=3), for model=tiny "
        "(0.0003B parameters); a full disk ends the run"
    ]
    assert out.stdout.startswith("run reverse_text-tiny on cluster=local")


@pytest.mark.slow
def test_a_run_whose_disk_fills_ends_in_one_line_with_its_summary_and_resume_command(
    tmp_path: Path,
) -> None:
    """A whole run on a 14 MB disk that its checkpoints (3.6 MB each) and weights (1.2 MB a
    version) fill: the plan warns of it before the run starts. By step 4 there is no room for
    the trainer's next checkpoint (or, had the queue's store grown more, its next weights):
    the trainer says so in one line in its log and ends with the full-disk code through
    torchrun, and the launcher ends the run with that line, no role restarted and no
    traceback on the console. Every role stops, summary.json is written (the console says
    where) with the reason, metrics.jsonl holds whole records, nothing is left half-written,
    and the last line is the command that resumes the run."""
    with small_disk(tmp_path / "disk", 14 * MB) as root:
        run_dir = root / "run"
        out = subprocess.run(
            rl_command(run_dir, "max_steps=12", "trainer.checkpoint_every=2"),
            cwd=ROOT,
            env=child_env(tmp_path / "cache", WANDB_MODE="disabled"),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 1, out.stderr[-3000:]
        err = out.stderr
        assert "Traceback" not in err and "restarting it" not in err, err
        lines = err.strip().splitlines()
        assert lines[0].startswith(
            f"warning: {run_dir} has 14.0 MB free, and this run's checkpoints and published "
            "weights need ~16.8 MB: 3 checkpoint(s) at once of ~3.6 MB"
        ), lines[0]
        (error,) = [line for line in lines if line.startswith("error: ")]
        said = re.fullmatch(
            "error: role trainer ended on a full disk: (disk full writing "
            rf"{run_dir}/(checkpoints|weights)/step_\d+ {ROOM.pattern}); not restarted \(a "
            r"restart meets the same disk\): free space there, then resume",
            error,
        )
        assert said, error
        trainer_log = (run_dir / "logs" / "trainer.log").read_text()
        assert f"trainer: {said.group(1)}" in trainer_log.splitlines()
        assert "Traceback" not in trainer_log
        assert f"summary: {run_dir / 'summary.json'}" in lines, err
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "failed" and summary["reason"] == error.removeprefix("error: ")
        assert 1 <= len(trained_steps(run_dir)) < 12
        run = RunDir(run_dir)
        assert lines[-1] == f"to resume at {run.resume_point()}: uv run rl resume={run_dir}"
        assert all(map(is_complete, run.checkpoints.glob("step_*")))
        assert not list(run.weights.glob("*.tmp"))
        read_jsonl(run.metrics)  # every line whole
        assert_no_process_left(run_dir)
