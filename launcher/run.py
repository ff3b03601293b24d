"""`launch(cfg)`: plan the run, then print it (dry run) or start it on the chosen cluster."""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from launcher.plan import format_plan, plan
from rl.config import Action, ClusterKind


def launch(cfg: DictConfig) -> None:
    """Plan the composed run and execute it; tests call this directly."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if cfg.action != Action.run:
        from launcher import slurm

        try:
            (slurm.status if cfg.action == Action.status else slurm.cancel)(cfg, run_dir)
        finally:
            _remove_if_empty(run_dir)
        return
    try:
        run_plan = plan(cfg)
    except Exception:
        _remove_if_empty(run_dir)
        raise
    if cfg.dry_run:
        print(format_plan(run_plan, cfg))
        _remove_if_empty(run_dir)
        return
    if cfg.cluster.kind == ClusterKind.slurm:
        from launcher.slurm import submit

        try:
            submit(cfg, run_plan)
        finally:
            _remove_if_empty(run_dir)
        return
    from launcher.local import run_local

    run_local(cfg, run_plan)


def _remove_if_empty(run_dir: Path) -> None:
    """A dry run leaves nothing behind: drop the run directory Hydra made, and empty parents."""
    for path in (run_dir, run_dir.parent, run_dir.parent.parent):
        try:
            path.rmdir()
        except OSError:
            return
