"""A new run's directory, and whether the roles a run directory records are still running.

The local launcher and Slurm submission both start a run by writing its directory (the
resolved config, the plan and a fresh token, through rl/core/rundir.py); resuming a local run first
asks whether the process groups it recorded in the pid file are gone.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from rl.core.rundir import RunDir

if TYPE_CHECKING:  # `rl action=status` asks `running_roles` without Hydra's imports
    from omegaconf import DictConfig

    from launcher.plan.planner import RunPlan


def prepare_run_dir(cfg: DictConfig, run_plan: RunPlan) -> tuple[RunDir, str]:
    """Write the run directory Hydra chose for this run; returns it and the run's token."""
    from hydra.core.hydra_config import HydraConfig

    run = RunDir(Path(HydraConfig.get().runtime.output_dir).resolve())
    token = secrets.token_hex(16)
    run.create(cfg, token, run_plan.to_json())
    run.add_overrides(list(HydraConfig.get().overrides.task))
    return run, token


def group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is in process group `pgid`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def running_roles(run: RunDir) -> list[str]:
    """The processes of a local run whose recorded process group still has a live member."""
    return [name for name, pgid in run.read_pids().items() if group_alive(pgid)]
