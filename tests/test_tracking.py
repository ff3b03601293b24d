"""The wandb tracker when wandb's service is gone (killed with a Slurm job's processes)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import os, signal, sys
import psutil
from omegaconf import OmegaConf
from launcher.tracking import Tracker
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
