"""`launch(cfg)`: plan the run, then print it (dry run) or start it on the chosen cluster."""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from launcher.errors import ConfigError
from launcher.plan import format_plan, plan
from rl.config import Action, ClusterKind
from rl.rundir import CONFIG, TOKEN, RunDir


def launch(cfg: DictConfig) -> None:
    """Plan the composed run and execute it; tests call this directly."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if cfg.resume:
        try:
            resume(Path(cfg.resume))
        finally:
            _remove_if_empty(run_dir)
        return
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
    from rl.model import ensure_checkpoint

    # Build or convert the model once here, not concurrently in every role (SmolLM2's GGUF
    # conversion takes about a minute); later calls find it in the cache.
    if not cfg.model.path:
        print(f"model: {ensure_checkpoint(cfg.model, seed=cfg.seed)}", flush=True)
    run_local(cfg, run_plan)


def resume(target: Path) -> None:
    """Continue the run in `target` with the config it was started with."""
    from rl.runtime import load_run_config

    run = RunDir(target)
    others = [o for o in HydraConfig.get().overrides.task if not o.startswith("resume=")]
    if others:
        raise ConfigError(
            f"resume={target}: takes no other overrides (got {' '.join(others)}); the run "
            f"continues with the config in its directory"
        )
    if not run.is_run():
        raise ConfigError(f"resume={target}: not a run directory (no {CONFIG} and {TOKEN})")
    if run.summary.exists():
        raise ConfigError(f"resume={target}: the run has finished ({run.summary.name} is there)")
    cfg = load_run_config(target)
    run_plan = plan(cfg)
    if cfg.cluster.kind == ClusterKind.slurm:
        from launcher.slurm import resubmit

        resubmit(cfg, run_plan, run)
        return
    from launcher.local import run_local
    from launcher.setup import running_roles

    alive = running_roles(run)
    if alive:
        raise ConfigError(f"resume={target}: the run is still running ({', '.join(alive)})")
    run_local(cfg, run_plan, resume=run)


def _remove_if_empty(run_dir: Path) -> None:
    """A dry run leaves nothing behind: drop the run directory Hydra made, and empty parents."""
    for path in (run_dir, run_dir.parent, run_dir.parent.parent):
        try:
            path.rmdir()
        except OSError:
            return
