"""The console and the wandb tracker: a run that cannot learn says so on the console, and a
tracker whose wandb service is gone (killed with a Slurm job's processes) stops quietly."""

import subprocess
import sys
from pathlib import Path

from launcher.watch.tracking import Console


def step_records(
    step: int, reward: float, signal: float, cut: float, clipped: float = 0.0
) -> list[dict]:
    rollout = {"kind": "rollout", "step": step, "time/generate": 0.5, "time/weight_load": 0.0,
               "filter/first_round_signal": signal}  # fmt: skip
    train = {"kind": "train", "step": step, "reward/mean": reward, "loss": 0.0,
             "masked_fraction": cut, "clipped_fraction": clipped, "mismatch_kl": 0.01,
             "throughput/tokens_per_s": 100.0, "time/step": 1.0, "time/train": 0.5,
             "off_policy/staleness_max": 1}  # fmt: skip
    return [rollout, train]


def console_lines(rows: list[tuple[float, ...]]) -> list[str]:
    console = Console(max_steps=len(rows))
    said = []
    for step, row in enumerate(rows, 1):
        for record in step_records(step, *row):
            said.extend((console.line(record) or "").splitlines())
    return said


def test_a_run_without_signal_or_with_a_flat_reward_is_warned_of_once() -> None:
    """temperature 0, a reward that never varies, a multi-turn task cut after one turn: every
    group ties, the orchestrator refills it, and the steps' reward stays put."""
    lines = console_lines([(0.0, 0.0, 0.0)] * 12)
    steps = [x for x in lines if x.startswith("step ")]
    assert all("signal 0%  clipped 0%" in x for x in steps), steps[0]
    warned = [x for x in lines if x.startswith("warning: ")]
    assert len(warned) == 2, warned  # once each, not every step
    assert "no group had signal" in warned[0] and "for 3 steps in a row" in warned[0]
    assert lines.index(warned[0]) == lines.index(steps[2]) + 1  # after the third step
    assert warned[1].startswith("warning: the mean reward has been 0.000 for 10 steps")


def test_a_loss_that_cuts_most_tokens_is_warned_of() -> None:
    """GSPO at lr 3e-4 clipped half of every batch with no word."""
    learning = [(0.1 * k, 0.8, 0.5) for k in range(5)]
    warned = [x for x in console_lines(learning) if x.startswith("warning: ")]
    assert len(warned) == 1 and "clipped or masked 50% of the tokens" in warned[0], warned
    assert not [x for x in console_lines([(0.1 * k, 0.8, 0.1) for k in range(5)])
                if x.startswith("warning: ")]  # fmt: skip
    short = Console(max_steps=5, fields=["reward", "eta"])
    said = [short.line(r) for r in step_records(1, 0.5, 0.8, 0.5)]
    assert said == [None, "step   1/5  reward 0.500  ETA ?"]  # console.fields=[reward,eta]
    # GSPO's loss masks the tokens it clips: a token counts once (it read 100%, not 50%).
    both = console_lines([(0.1 * k, 0.8, 0.5, 0.5) for k in range(5)])
    assert all("clipped 50%" in x for x in both if x.startswith("step ")), both[0]


SCRIPT = """
import os, signal, sys
import psutil
from omegaconf import OmegaConf
from launcher.watch.tracking import Tracker
from rl.core.rundir import RunDir

cfg = OmegaConf.create({
    "name": "t", "max_steps": 1,
    "wandb": {"mode": "offline", "project": "relay", "group": None, "flush_s": 1.0},
})
run = RunDir(sys.argv[1])
run.internal.mkdir(parents=True, exist_ok=True)
tracker = Tracker(cfg, run)
tracker.log({"step": 1, "reward/mean": 0.5})
for child in psutil.Process().children(recursive=True):  # as Slurm's SIGTERM does
    child.send_signal(signal.SIGKILL)
    child.wait(30)
for step in range(2, 50):
    tracker.log({"step": step, "reward/mean": 0.5})
tracker.finish()
print("mode:", tracker.mode)
"""


def test_a_tracker_whose_wandb_service_died_stops_with_a_warning_and_no_traceback(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[1],
    )
    assert done.returncode == 0, done.stderr
    assert "warning: wandb stopped logging" in done.stdout, done.stdout
    assert "mode: offline (stopped:" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr + done.stdout, done.stderr


def test_a_quiet_run_says_what_it_waits_for(tmp_path: Path) -> None:
    """Agents that hang or score 0: after the version-0 eval the console printed nothing for
    over 5 minutes while every group tied and was refilled; only the orchestrator's log said
    why. After QUIET_S seconds without a line, the console says it in one."""
    import json
    import time

    from launcher.watch.tracking import waiting_line
    from rl.core.rundir import RunDir

    run = RunDir(tmp_path)
    run.internal.mkdir(parents=True)
    assert waiting_line(run, 61) == "nothing new for 61 s: no batch is being generated yet"
    progress = {"batch": 0, "round": 3, "with_signal": 2, "want": 8, "tied": 21,
                "episodes": 64, "failed": 6, "since": time.time() - 120}  # fmt: skip
    run.generating.write_text(json.dumps(progress))
    said = waiting_line(run, 300)
    assert said.startswith("nothing new for 300 s: batch 0 is in fill round 3 (for 12")
    assert "2 of 8 groups with signal so far, 21 dropped without signal" in said
    assert "6 episodes that failed or timed out" in said and "\n" not in said
    assert "trainer" not in said
    run.trainer_waiting.write_text("0")
    assert waiting_line(run, 300).endswith("; the trainer waits for batch 0")
