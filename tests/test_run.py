"""End to end through the launcher: real processes, real sockets, a few real RL steps.

Checks the run directory, the staleness contract from recorded versions (async_level 0 and 1),
and that a dead role, or Ctrl-C, ends the whole run with no process left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.clusters.run_dir import group_alive
from rl.core.kinds import is_eval, is_train
from rl.core.rundir import RunDir
from rl.queue.store import Store
from tests.support.repro import differences, records_by_step
from tests.support.runs import (
    ROOT,
    SMALL,
    assert_no_process_left,
    child_env,
    rl_command,
    run_to_end,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("relay_cache")


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows in the run's offline wandb file, read as it stands (a log of 32 KiB
    blocks whose records are 7-byte headers and protobuf chunks; a torn tail is left out)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, block, pos, pending, rows = path.read_bytes(), 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if left < 7 or (length, kind) == (0, 0):  # the block's zero padding
            pos += left
            continue
        if pos + 7 + length > len(data):
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return rows


def logged_steps(run_dir: Path) -> list[int]:
    return [row["step"] for row in wandb_history(run_dir) if "reward/mean" in row]


def test_run_directory_and_metrics_logged_live(tmp_path: Path, cache: Path) -> None:
    """A whole run: its directory, its metrics, its console, and its wandb run, which grows
    while the run goes on (read mid-run) rather than being written at the end."""
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        rl_command(run_dir, "max_steps=20"),
        cwd=ROOT,
        env=child_env(cache, WANDB_MODE="offline"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        seen: list[int] = []
        while not seen:
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "no step logged to wandb within 300 s"
            time.sleep(0.2)
            if list(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
                seen = logged_steps(run_dir)
        assert launcher.poll() is None  # still running: logged as it went
        stdout, stderr = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert_no_process_left(run_dir)
    assert seen == list(range(1, len(seen) + 1)) and len(seen) < 20
    assert logged_steps(run_dir) == list(range(1, 21))

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if is_train(r)]
    evals = [r for r in records if is_eval(r)]
    rollouts = [r for r in records if r["kind"] == "rollout"]
    assert [r["step"] for r in train] == list(range(1, 21))
    keys = ("reward/mean", "loss", "entropy", "mismatch_kl", "off_policy/staleness_max",
            "time/step", "time/train", "time/weight_sync", "throughput/tokens_per_s", "lr",
            "memory/rss_gb")  # fmt: skip
    for record in train:
        assert all(key in record for key in keys), set(keys) - set(record)
        assert 0.0 <= record["reward/mean"] <= 1.0
        assert record["samples"] == 8 * 4
        assert record["lr"] == pytest.approx(3e-4)  # model=tiny's, algorithm.lr unset
        assert record["memory/rss_gb"] > 0.1
    assert [r["step"] for r in rollouts] == list(range(1, 21))
    for record, step in zip(rollouts, train, strict=True):
        assert 1 <= record["response/length_mean"] <= record["response/length_max"] <= 12
        assert 0.0 <= record["response/truncated"] <= 1.0 and record["time/generate"] > 0
        # every completion generated for the batch: trained (less the groups the batch before
        # carried in), dropped without signal, surplus carried on
        dropped = step["filter/zero_advantage_groups"] + record["filter/surplus_groups"]
        own = step["samples"] - 4 * record["filter/carried_groups"]
        assert record["samples/generated"] == own + 4 * dropped
    assert [r["step"] for r in records if r["kind"] == "warmup"] == [5]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 20
    assert all("eval/reward/mean" in r for r in evals)

    assert "\nrun reverse_text-tiny on cluster=local: 20 steps of 32 samples" in stdout
    lines = stdout.splitlines()
    assert any(x.startswith("warm-up   5/5  loss ") for x in lines)
    step_lines = [x for x in lines if x.startswith("step ")]
    assert len(step_lines) == 20 and all(" tok/s  gen " in x for x in step_lines)
    assert "ETA " in step_lines[-1] and " since version " in stdout
    assert all("  signal " in x and "  clipped " in x for x in step_lines)
    # The orchestrator says where the batch it makes stands: what a quiet console reports.
    # Each eval keeps its first completions, and wandb gets them as a table.
    kept = [json.loads(x) for x in (run_dir / "rollouts" / "eval_0.jsonl").read_text().splitlines()]
    assert len(kept) == 16 and {"prompt", "answer", "completion", "reward", "exact"} <= set(kept[0])
    assert list(run_dir.glob("wandb/offline-run-*/files/media/table/eval/completions_*.table.json"))
    generating = json.loads((run_dir / ".relay" / "generating.json").read_text())
    assert generating["batch"] == 19 and generating["want"] == 8, generating  # SMALL
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 20
    assert "max_steps=20" in summary["overrides"]
    assert 0.0 <= summary["reward/last"] <= 1.0
    assert summary["reward/last_steps"] == min(10, summary["steps"])  # the mean's span
    # The top level holds what a user reads; the processes' own files are in .relay/.
    assert {p.name for p in run_dir.iterdir()} == {
        "config.yaml", "plan.json", "api_key", "metrics.jsonl", "summary.json", "reward.png",
        "logs", "rollouts", "weights", "checkpoints", "wandb", ".relay",
    }  # fmt: skip
    run = RunDir(run_dir)
    for path in (
        run.token_file,
        run.pids,
        run.queue_store,
        run.wall_time,
        run.address_file("queue"),
    ):
        assert path.is_relative_to(run.internal) and path.exists(), path
    assert oct(run.token_file.stat().st_mode & 0o777) == "0o600"
    for role in ("queue", "orchestrator", "inference-0", "trainer"):
        assert (run_dir / "logs" / f"{role}.log").stat().st_size > 0
    assert "Warning" not in (run_dir / "logs" / "queue.log").read_text()
    assert (run_dir / "weights" / "step_20" / "COMPLETE").exists()
    assert (run_dir / "checkpoints" / "step_20" / "COMPLETE").exists()
    rollout_samples = (run_dir / "rollouts" / "samples.jsonl").read_text().splitlines()
    assert {"prompt", "completion", "reward"} <= set(json.loads(rollout_samples[0]))


@pytest.mark.parametrize(
    "layout",
    [
        (),
        ("model=tiny_qwen3_moe", "parallel.trainer.ep=2", "inference.weight_transport=broadcast"),
    ],
    ids=["fsdp2", "fsdp2-ep2-moe-broadcast"],
)
def test_fsdp_on_two_trainer_processes(tmp_path: Path, cache: Path, layout: tuple) -> None:
    """Two trainer ranks through the launcher: FSDP, whose versions are written block by
    block (rl/trainer/streaming.py), and expert parallelism on a MoE model whose versions are
    broadcast as they are gathered, block by block."""
    run_dir = tmp_path / "run"
    overrides = ("max_steps=6", "parallel=fsdp", "parallel.trainer.dp_shard=2", *layout)
    records = run_to_end(run_dir, cache, *overrides, WANDB_MODE="disabled")
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if "eval/exact_match" in r][-1] == 6
    log = (run_dir / "logs" / "trainer.log").read_text()
    ep = 2 if layout else 1
    for rank in (0, 1):
        assert (
            f"trainer-{rank} INFO mesh ParallelDims(dp_replicate=1, dp_shard=2, cp=1, ep={ep}"
            in log
        )
    assert (run_dir / "weights" / "step_6" / "model-00001.safetensors").exists()
    if layout:
        assert all(f"broadcast version {v} over gloo" in log for v in range(7))
    shards = list((run_dir / "checkpoints" / "step_6").glob("*.distcp"))
    assert len(shards) == 2  # one file per rank
    # Each step's numbers describe the whole batch the queue assembled, not rank 0's shard.
    store = Store(RunDir(run_dir).queue_store)
    for record in (r for r in records if is_train(r)):
        samples = [s for g in store.batch(record["step"] - 1) for s in g.samples]
        assert record["samples"] == len(samples)
        rewards = [s.reward for s in samples]
        assert record["reward/mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-9)
        staleness = [record["step"] - 1 - s.min_version for s in samples]
        assert record["off_policy/staleness_max"] == max(staleness)


def test_broadcast_weight_transport(tmp_path: Path, cache: Path) -> None:
    """Weights reach inference by broadcast from trainer rank 0: every version is served, and
    only version 0, checkpointed versions and the last are written to disk."""
    run_dir = tmp_path / "run"
    broadcast = ("inference.weight_transport=broadcast", "trainer.checkpoint_every=2")
    records = run_to_end(run_dir, cache, "max_steps=4", *broadcast, WANDB_MODE="disabled")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in train)
    assert all(min(r["versions"]) >= r["step"] - 2 for r in train)  # async_level 1
    assert [r["step"] for r in records if "eval/exact_match" in r][-1] == 4
    assert RunDir(run_dir).published_versions() == [0, 2, 4]
    assert (run_dir / "weights" / "BROADCAST").read_text() == "4"
    trainer = (run_dir / "logs" / "trainer.log").read_text()
    assert all(f"broadcast version {v} over gloo" in trainer for v in range(5))
    inference = (run_dir / "logs" / "inference-0.log").read_text()
    for version in range(5):
        assert f"loaded version {version} from the trainer's broadcast" in inference
    assert "loaded version 0 from /" not in inference


def test_async_level_0_trains_only_on_policy_at_the_scheduled_lr(
    tmp_path: Path, cache: Path
) -> None:
    """On-policy, with a learning-rate warm-up and schedule and two optimiser steps a batch."""
    schedule = ("algorithm.lr_schedule=linear", "algorithm.lr_warmup_steps=2",
                "algorithm.updates_per_batch=2", "eval.samples=4", "eval.temperature=1.0",
                "environment.eval_every=2")  # fmt: skip
    records = run_to_end(
        tmp_path / "run", cache, "max_steps=5", "algorithm.async_level=0", *schedule,
        WANDB_MODE="disabled",
    )  # fmt: skip
    train = [r for r in records if "loss" in r]
    # Record `step` s trains batch s-1, which must come from version s-1 only.
    assert all(r["versions"] == [r["step"] - 1] for r in train), [r["versions"] for r in train]
    assert all(r["off_policy/staleness_max"] == 0 for r in train)
    # model=tiny's lr 3e-4: half of it, all of it, then down by a third of it each step.
    lr = [r["lr"] / 3e-4 for r in train]
    assert lr == pytest.approx([0.5, 1.0, 1.0, 2 / 3, 1 / 3]), lr
    assert [r["optimizer/steps"] for r in train] == [2, 4, 6, 8, 10]  # AdamW's own count
    # Four sampled answers a held-out prompt: mean@4 as exact match, and pass@4 beside it.
    evals = [r for r in records if "eval/exact_match" in r]
    assert [r["step"] for r in evals] == [0, 2, 4, 5] and all(r["eval/k"] == 4 for r in evals)
    assert all(r["eval/pass_at_k"] >= r["eval/exact_match"] for r in evals)  # pass@4 >= mean@4
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    best = max(evals, key=lambda r: r["eval/exact_match"])
    assert summary["eval/best_version"] == best["step"]
    assert summary["eval/pass_at_k/last"] == evals[-1]["eval/pass_at_k"]


def test_async_level_1_overlaps_generation_with_training(tmp_path: Path, cache: Path) -> None:
    records = run_to_end(
        tmp_path / "run", cache, "max_steps=6", "algorithm.async_level=1", WANDB_MODE="disabled"
    )
    train = [r for r in records if "loss" in r]
    for r in train:
        # Batch s-1 was generated by version >= s-2: at most one step stale.
        assert min(r["versions"]) >= r["step"] - 2
    # Batch N+1 generated with version N was generated before step N's update existed,
    # i.e. while step N was training.
    overlapped = [r["step"] for r in train if r["versions"] == [r["step"] - 2]]
    assert len(overlapped) >= 3, [r["versions"] for r in train]


def start_long_run(run_dir: Path, cache: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        rl_command(run_dir, "max_steps=100000", "max_restarts=0"),
        cwd=ROOT,
        env=child_env(cache, WANDB_MODE="disabled"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_training(run_dir: Path, launcher: subprocess.Popen[str]) -> dict[str, int]:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and '"loss"' in metrics.read_text()):
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "no trainer step within 300 s"
        time.sleep(0.2)
    return RunDir(run_dir).read_pids()


def interrupt_training(run_dir: Path, cache: Path, target: str, sig: int) -> tuple[int, str]:
    """Start a long run, send `sig` to `target` (a role, or the launcher) once it trains,
    and return the launcher's exit status and stderr."""
    launcher = start_long_run(run_dir, cache)
    try:
        pids = wait_for_training(run_dir, launcher)
        os.kill(launcher.pid if target == "launcher" else pids[target], sig)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    return launcher.returncode, stderr


@pytest.mark.parametrize("role", ["queue", "trainer"])
def test_killing_a_role_without_restarts_ends_the_run(
    tmp_path: Path, cache: Path, role: str
) -> None:
    code, stderr = interrupt_training(tmp_path / "run", cache, role, signal.SIGKILL)
    assert code == 1
    assert f"role {role} exited with code -9" in stderr
    assert_no_process_left(tmp_path / "run")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


def test_a_launcher_killed_outright_takes_its_roles_with_it(tmp_path: Path, cache: Path) -> None:
    """SIGKILL leaves the launcher no chance to stop the roles: Linux sends each its
    parent-death SIGTERM, so none runs on as an orphan."""
    run_dir = tmp_path / "run"
    code, _ = interrupt_training(run_dir, cache, "launcher", signal.SIGKILL)
    assert code == -signal.SIGKILL
    pids = RunDir(run_dir).read_pids()
    deadline = time.monotonic() + 60  # each role's SIGTERM handling, on a loaded machine
    while any(map(group_alive, pids.values())) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert_no_process_left(run_dir)


def test_ctrl_c_while_the_trainer_waits_checkpoints_at_once_and_stops_every_role(
    tmp_path: Path, cache: Path
) -> None:
    """Ctrl-C keeps the steps trained, and where the trainer only waits for a batch (agents
    that hang: the batch may never come) it stops at once: the console said "the trainer
    checkpoints the step under way" though none was, and the trainer saw the request only at
    its next long poll. Then every role stops, with no traceback; a resume counts the
    checkpointed steps."""
    run_dir = tmp_path / "run"
    launcher = start_long_run(run_dir, cache)
    try:
        pids = wait_for_training(run_dir, launcher)
        os.killpg(pids["orchestrator"], signal.SIGSTOP)  # no batch comes: the trainer waits
        waiting = RunDir(run_dir).trainer_waiting
        deadline = time.monotonic() + 120
        while not waiting.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        batch = int(waiting.read_text())
        os.kill(launcher.pid, signal.SIGINT)
        _, stderr = launcher.communicate(timeout=60)
        code = launcher.returncode
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert f"interrupted: the trainer waits for batch {batch}, no step under way" in stderr
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert f"SIGTERM while waiting for batch {batch}: stopping here" in trainer_log
    assert code == 130
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert_no_process_left(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["status"] == "interrupted" and steps >= 1
    assert f"checkpointed at step {steps}; stopping every role" in stderr
    assert (run_dir / "checkpoints" / f"step_{steps}" / "COMPLETE").exists()
    resumes = f"to resume at step {steps + 1}, after checkpoint step_{steps}: uv run rl resume="
    assert f"{resumes}{run_dir}" in stderr
    # A resume keeps the checkpointed steps: it may not end before them.
    again = subprocess.run(
        [sys.executable, "-m", "launcher.cli", f"resume={run_dir}", f"max_steps={steps - 1}"],
        cwd=ROOT, env=child_env(cache), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 2
    assert again.stderr == (
        f"error: max_steps={steps - 1}: the run in {run_dir} has checkpointed {steps} steps "
        f"already (a resume continues at step {steps + 1})\n"
    )


def test_a_sweep_over_seeds_shares_its_base_and_groups_its_table(
    tmp_path: Path, cache: Path
) -> None:
    """`rl -m` over two learning rates and two seeds: point directories named after their
    overrides, one warm-up for all four (the base's seeds are its own), every point starting
    from it; the table has a row per point and one per learning rate over its seeds, and
    names the best one; the plot draws each learning rate's mean with a band."""
    sweep = tmp_path / "sweep"
    out = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "-m", *SMALL, "max_steps=2",
         f"hydra.sweep.dir={sweep}", "algorithm.lr=1e-3,3e-4", "seed=0,1"],
        cwd=ROOT, env=child_env(cache, WANDB_MODE="disabled"), capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    points = sorted(p.name for p in sweep.iterdir() if p.is_dir() and p.name[0].isdigit())
    assert [p.split(",")[0] for p in points] == [
        "0-algorithm.lr=0.001", "1-algorithm.lr=0.001", "2-algorithm.lr=0.0003",
        "3-algorithm.lr=0.0003",
    ]  # fmt: skip
    (base,) = (sweep / "bases").iterdir()  # one warm-up: one group of points shares it
    assert out.stdout.count("sweep base: warm-up, once for the points that share it") == 1
    for point in points:
        summary = json.loads((sweep / point / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["steps"] == 2
        assert summary["seed"] == int(re.search(r"(?:^|,)seed=(\d+)", point)[1])
        config = (sweep / point / "config.yaml").read_text()
        assert f"path: {base / 'weights' / 'step_0'}" in config
    # Seeds 0 and 1 of one learning rate: two runs from one start (the same policy at
    # version 0, the base's seeds being its own), sampling differently from the first batch.
    zero, one = (records_by_step(sweep / point) for point in points[:2])
    assert zero[("eval", 0)] == one[("eval", 0)]
    assert zero[("train", 1)]["reward/mean"] != one[("train", 1)]["reward/mean"]
    # A point is the run it would be alone: its base warmed up as its own trainer would.
    alone = run_to_end(tmp_path / "alone", cache, "max_steps=2", "algorithm.lr=1e-3", "seed=1",
                       WANDB_MODE="disabled")  # fmt: skip
    assert [r for r in alone if r["kind"] == "warmup"]  # warmed up itself
    assert differences(sweep / points[1], tmp_path / "alone", ignore=("warmup",)) == []
    table = (sweep / "sweep_summary.md").read_text()
    rows = [x for x in table.splitlines() if x[:3] in ("| 0", "| 1", "| 2", "| 3")]
    assert len(rows) == 4 and "`algorithm.lr=0.001 seed=0`" in rows[0]
    assert "| `algorithm.lr=0.001` | 2 |" in table and "| `algorithm.lr=0.0003` | 2 |" in table
    # Each group against the version-0 eval its runs started from, and two seeds are warned
    # of: their spread is a guess (a 40-step sweep's points all ended at or below version 0).
    assert "| eval exact (version 0) | eval exact (last) |" in table
    assert "| gain over version 0 |" in table
    assert "warning: fewer than 3 seeds in `algorithm.lr=0.001` (2), `algorithm.lr=0.0003`" in table
    assert "Best by eval/exact_match/last: `algorithm.lr=" in table
    assert "Welch's t-test over the seeds (n=2 vs 2): p=" in table
    assert (sweep / "sweep.png").stat().st_size > 10_000
    assert f"sweep summary: {sweep / 'sweep_summary.md'}" in out.stdout


def test_colocated_placement_takes_turns_on_policy(tmp_path: Path, cache: Path) -> None:
    """placement=colocated: every batch is generated by the version just published, and
    generation and training never overlap, by the wall-clock times each role records."""
    records = run_to_end(tmp_path / "run", cache, "placement=colocated", "max_steps=6",
                         WANDB_MODE="disabled")  # fmt: skip
    train = {r["step"]: r for r in records if is_train(r)}
    rollouts = {r["step"]: r for r in records if r["kind"] == "rollout"}
    assert sorted(train) == sorted(rollouts) == list(range(1, 7))
    for step, record in train.items():
        assert record["versions"] == [step - 1]  # generated by the policy just published
        assert rollouts[step]["at/generate_end"] <= record["at/train_start"]
        if step + 1 in rollouts:  # the next batch waits for this step's weights
            assert record["at/train_end"] <= rollouts[step + 1]["at/generate_start"]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    threads = {p["name"]: p["env"]["OMP_NUM_THREADS"] for p in plan["processes"] if p["env"]}
    assert threads == {"inference-0": "2", "trainer": "2"}  # every core, in turn


def test_a_run_directory_of_the_old_layout_is_refused_in_one_line(tmp_path: Path) -> None:
    """Run directories written before the internals moved into .relay/ cannot be resumed;
    the refusal says so and how to go on from their weights."""
    from launcher.errors import ConfigError
    from launcher.run import resume

    (tmp_path / "config.yaml").write_text("max_steps: 10\n")
    (tmp_path / "token").write_text("t0ken")
    with pytest.raises(ConfigError) as refused:
        resume(None, tmp_path)  # refused before the command line is read
    message = str(refused.value)
    assert (
        message.startswith(f"resume={tmp_path}: written by an earlier Relay")
        and "\n" not in message
    )
    assert f"model.path={tmp_path}/weights/step_N" in message
