"""Fault tolerance through the real launcher: kill -9 each role once, then stop each one
(SIGSTOP: a hung process) once, in turn, during one short run.

The launcher restarts a dead role at once and a hung one once it has shown no sign of life for
`timeouts.hung_s` (the queue from its SQLite store, the orchestrator from the batches the queue
holds, the trainer from its last checkpoint, inference with the newest weights), and the run
completes with every step trained exactly once and a final eval in the range of an undisturbed
run. A role that dies while the run starts is restarted too. An interrupted run continues with
`rl resume=<run dir>`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl.core.rundir import RunDir
from tests.support.faults import KillAtStep, KillInTurn, Tamper, trained_steps
from tests.support.repro import differences
from tests.support.runs import ROOT, assert_no_process_left

pytestmark = pytest.mark.slow

STEPS = 60
HUNG_S = 10
# Checkpoints every 20 steps: a trainer killed after step 20 resumes from step 20 and trains
# steps 21.. again from the same batches.
RUN = [f"max_steps={STEPS}", "trainer.checkpoint_every=20", "environment.eval_every=30"]
ROLES = ["queue", "inference-0", "orchestrator", "trainer"]
# Each role is killed once, then stopped once, in turn, in one run; the trainer killed after
# step 22 resumes from its checkpoint at step 20, the one stopped after step 46 from step 40.
KILL, STOP = signal.SIGKILL, signal.SIGSTOP
KILLS = [
    ("queue", 5, KILL), ("inference-0", 10, KILL),
    ("orchestrator", 15, KILL), ("trainer", 22, KILL),
    ("queue", 28, STOP), ("inference-0", 34, STOP),
    ("orchestrator", 40, STOP), ("trainer", 46, STOP),
]  # fmt: skip


def rl(run_dir: Path, cache: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "launcher.cli", f"hydra.run.dir={run_dir}", *RUN, *args]


def env(cache: Path) -> dict[str, str]:
    return {**os.environ, "RELAY_CACHE": str(cache), "WANDB_MODE": "disabled"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("relay_cache")


def start(run_dir: Path, cache: Path, *args: str) -> subprocess.Popen[str]:
    """The run in the background, in its own process group."""
    return subprocess.Popen(
        rl(run_dir, cache, *args),
        cwd=ROOT,
        env=env(cache),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Path:
    run_dir = tmp_path_factory.mktemp("undisturbed") / "run"
    out = subprocess.run(
        rl(run_dir, cache), cwd=ROOT, env=env(cache), capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


def test_run_survives_kill_9_and_a_hang_of_each_role_in_turn(
    tmp_path: Path, cache: Path, undisturbed: Path
) -> None:
    """Each role killed, then stopped until the hang detector ends it, in turn: the run goes
    on and is the undisturbed run, record for record and byte for byte (the trainer retrains
    from its checkpoint onto the same weights, the orchestrator regenerates the batches it
    owes, a restarted server is told the version the schedule wants)."""
    run_dir = tmp_path / "run"
    killer = KillInTurn(run_dir, KILLS)
    killer.start()
    out = subprocess.run(
        rl(run_dir, cache, f"timeouts.hung_s={HUNG_S}"),
        cwd=ROOT, env=env(cache), capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    killer.stopped.set()
    done = [(role, sig) for role, sig, _ in killer.killed]
    assert done == [(role, sig) for role, _, sig in KILLS], (done, out.stderr[-3000:])
    assert out.returncode == 0, out.stderr[-3000:]
    for role in ROLES:
        assert f"role {role} exited with code -9: restarting it (1 of 3)" in out.stderr, role
        # The hang is named, with how long the role was silent: past the deadline, not long.
        hung = re.search(
            rf"role {role} hung: no sign of life for ([\d.]+) s \(timeouts.hung_s={HUNG_S}\)",
            out.stderr,
        )
        assert hung, (role, out.stderr[-3000:])
        assert HUNG_S <= float(hung.group(1)) < HUNG_S + 5, (role, hung.group(0))
        assert f"role {role} hung (no sign of life for" in out.stderr, role
        assert "restarting it (2 of 3)" in out.stderr
        log = (run_dir / "logs" / f"{role}.log").read_text()
        assert "--- exited with code -9; restarting ---" in log, role
        assert "--- hung (no sign of life for" in log, role
    trainer = (run_dir / "logs" / "trainer.log").read_text()
    assert "continuing at step 21" in trainer and "continuing at step 41" in trainer
    orchestrator = (run_dir / "logs" / "orchestrator.log").read_text()
    assert "resuming: the queue holds batches" in orchestrator
    assert trained_steps(run_dir) == list(range(1, STEPS + 1))
    assert differences(undisturbed, run_dir) == []
    assert_no_process_left(run_dir)


def test_a_run_whose_weights_and_queue_are_tampered_with_trains_on(
    tmp_path: Path, cache: Path
) -> None:
    """Every third published version rewritten in place as soon as the trainer records it,
    a planted complete `weights/step_777000`, and, with the push key, a batch numbered past
    the next and a group from a version 10**6 ahead: the rewritten versions are refused and
    skipped (inference never dies, the orchestrator never exits), the stray is warned of and
    neither loaded nor pruned, the pushes get 422, and the run finishes with every step
    recorded once and no restart spent."""
    run_dir = tmp_path / "run"
    tamper = Tamper(run_dir, every=3, push_at=8)
    tamper.start()
    command = [sys.executable, "-m", "launcher.cli", f"hydra.run.dir={run_dir}", "max_steps=24",
               "environment.eval_every=0"]  # fmt: skip
    out = subprocess.run(
        command, cwd=ROOT, env=env(cache), capture_output=True, text=True, timeout=900
    )
    tamper.stopped.set()
    assert out.returncode == 0, out.stderr[-3000:]
    assert trained_steps(run_dir) == list(range(1, 25))
    assert "restarting it" not in out.stderr
    assert len(tamper.rewritten) >= 4, tamper.rewritten
    orchestrator = (run_dir / "logs" / "orchestrator.log").read_text()
    refused = re.findall(r"version (\d+) refused by inference, skipped", orchestrator)
    assert refused and {int(v) for v in refused} <= set(tamper.rewritten), refused
    assert "does not match the SHA-256 the trainer recorded" in orchestrator
    run = RunDir(run_dir)
    assert run.weights_for(777000).exists() and 777000 not in run.published_versions()
    assert run.published_versions()[-1] == 24
    trainer = (run_dir / "logs" / "trainer.log").read_text()
    assert f"{run.weights_for(777000)} was not published by this run's trainer" in trainer
    assert [status for status, _ in tamper.pushes.values()] == [422, 422], tamper.pushes
    assert "ahead of the schedule" in tamper.pushes["batch ahead"][1]
    assert "newer than the newest the trainer published" in tamper.pushes["version ahead"][1]
    assert_no_process_left(run_dir)


def test_a_role_that_keeps_dying_stops_the_run(tmp_path: Path, cache: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = start(run_dir, cache, "max_restarts=1")
    try:
        first = KillAtStep(run_dir, "queue", 5)
        first.run()  # in this thread: returns once it has killed
        assert first.killed_pid is not None
        deadline = time.monotonic() + 120
        while (again := RunDir(run_dir).read_pids()["queue"]) == (first.killed_pid):
            assert time.monotonic() < deadline, "the queue was not restarted"
            time.sleep(0.1)
        os.killpg(again, signal.SIGKILL)  # its one restart is spent
        _, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 1
    assert "role queue exited with code -9 after 1 restart(s)" in stderr
    assert_no_process_left(run_dir)


def resume(run_dir: Path, cache: Path, *overrides: str, timeout: float = 120):
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", f"resume={run_dir}", *overrides],
        cwd=ROOT, env=env(cache), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_interrupted_run_resumes_with_continuous_history_and_extends(
    tmp_path: Path, cache: Path
) -> None:
    run_dir = tmp_path / "run"
    first = start(run_dir, cache)
    deadline = time.monotonic() + 600
    while not trained_steps(run_dir) or max(trained_steps(run_dir)) < 45:
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.1)
    first.send_signal(signal.SIGINT)  # Ctrl-C
    _, stderr = first.communicate(timeout=60)
    assert first.returncode == 130
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    # Ctrl-C says how to resume, and where the run will pick up.
    hint = re.search(r"to resume at step (\d+), after checkpoint step_(\d+): (.*)", stderr)
    assert hint, stderr[-2000:]
    # The step in flight at Ctrl-C was checkpointed, not only the last of every 20.
    assert int(hint.group(1)) == int(hint.group(2)) + 1 and int(hint.group(2)) >= 45
    assert f"checkpointed at step {hint.group(2)}; stopping every role" in stderr
    assert hint.group(3) == f"uv run rl resume={run_dir}"
    # A resume may change how long the run goes on, not what it trains; each refusal is one
    # line, and changes nothing.
    config = (run_dir / "config.yaml").read_text()
    for override, message in [
        ("algorithm.lr=0.1", "algorithm.lr=0.1 cannot change on resume"),
        ("+environment.args.maxlen=9", "+environment.args.maxlen=9 cannot change on resume"),
        ("+foo=1", "+foo=1: no such setting"),
        ("max_steps=5", "max_steps=5: the run in"),
    ]:
        refused = resume(run_dir, cache, override)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert (run_dir / "config.yaml").read_text() == config
    # The refusal's way on runs as printed: a new run from the newest weights, no warm-up.
    way_on = re.search(r"start a new run from its weights: (.*)$", refused_lr := resume(
        run_dir, cache, "algorithm.lr=0.1").stderr.strip())  # fmt: skip
    assert way_on, refused_lr
    branched = subprocess.run(
        [sys.executable, "-m", "launcher.cli", *way_on.group(1).split(), "algorithm.lr=0.1",
         "dry_run=true"], cwd=ROOT, env=env(cache), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert branched.returncode == 0, branched.stderr
    assert f"note: model.path={run_dir}: run {run_dir}'s version {hint.group(2)}" in (
        branched.stdout
    )
    assert "note: no supervised warm-up" in branched.stdout and ", no warm-up," in branched.stdout
    assert not (run_dir / "export").exists()  # a dry run writes nothing
    # Nor does config.yaml edited by hand: refused, naming the key.
    head, algorithm = config.split("\nalgorithm:\n", 1)
    edited = head + "\nalgorithm:\n" + algorithm.replace("  lr: 0.0003", "  lr: 0.5", 1)
    (run_dir / "config.yaml").write_text(edited)
    refused = resume(run_dir, cache)
    assert refused.returncode == 2, refused.stderr
    assert "config.yaml was changed since the launcher wrote it (algorithm.lr: 0.0003 -> 0.5" in (
        refused.stderr
    )
    (run_dir / "config.yaml").write_text(config)
    t0 = time.monotonic()
    out = resume(run_dir, cache, timeout=900)
    resumed_s = time.monotonic() - t0
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming {run_dir} at step {hint.group(1)}, after checkpoint" in out.stdout
    # The run's wall time counts both launches, not only the resumed one.
    assert json.loads((run_dir / "summary.json").read_text())["wall_s"] > resumed_s
    assert f"run directory: {run_dir}" in out.stdout
    assert trained_steps(run_dir) == list(range(1, STEPS + 1))
    evals = [
        r["step"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "eval/exact_match" in r
    ]
    assert evals == [0, 30, 60]  # each version evaluated once, across both launches
    assert (run_dir / "summary.json").exists()
    # A finished run goes on only with more steps: then it trains them, each once.
    done = resume(run_dir, cache)
    assert done.returncode == 2 and f"has finished its {STEPS} steps" in done.stderr
    more = resume(run_dir, cache, f"max_steps={STEPS + 4}", timeout=900)
    assert more.returncode == 0, more.stderr[-3000:]
    assert f"max_steps {STEPS} -> {STEPS + 4}" in more.stdout
    assert trained_steps(run_dir) == list(range(1, STEPS + 5))
    trainer = (run_dir / "logs" / "trainer.log").read_text()
    assert f"continuing at step {STEPS + 1}" in trainer
    assert (run_dir / "summary.json").exists()
    # A new run from one of its steps that only a checkpoint holds: exported, then trained
    # on; its version 0 is that step's policy.
    branch = tmp_path / "branch"
    out = subprocess.run(
        rl(branch, cache, f"model.path={run_dir}/step_{STEPS}", "max_steps=2"),
        cwd=ROOT, env=env(cache), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    exported = run_dir / "export" / f"step_{STEPS}"
    assert f"exporting {run_dir}'s step {STEPS} to {exported}" in out.stdout
    branch_log = (branch / "logs" / "trainer.log").read_text()
    assert f"weights read from {exported}" in branch_log and "warmup step" not in branch_log

    def exact(run: Path, version: int) -> float:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return next(r["eval/exact_match"] for r in map(json.loads, lines)
                    if "eval/exact_match" in r and r["step"] == version)  # fmt: skip

    assert exact(branch, 0) == exact(run_dir, STEPS)  # the same policy, scored alike
    assert_no_process_left(run_dir)


def test_a_role_that_dies_while_the_run_starts_is_restarted(tmp_path: Path, cache: Path) -> None:
    """Start-up is supervised like the rest of the run: inference killed before it listens is
    restarted (within max_restarts), and the run goes on to train."""
    run_dir = tmp_path / "run"
    launcher = start(run_dir, cache)
    try:
        deadline = time.monotonic() + 120
        while not RunDir(run_dir).pids.exists():
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.02)
        assert not RunDir(run_dir).address_file("inference-0").exists()
        os.killpg(RunDir(run_dir).read_pids()["inference-0"], signal.SIGKILL)
        deadline = time.monotonic() + 600
        while not trained_steps(run_dir):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.1)
        launcher.send_signal(signal.SIGINT)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert "role inference-0 exited with code -9: restarting it (1 of 3)" in stderr
    assert launcher.returncode == 130  # stopped by the test, not by the death
    assert_no_process_left(run_dir)
