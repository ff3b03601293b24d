"""`launch(cfg)`: plan the run, then print it (dry run) or start it on the chosen cluster."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from launcher.branch import branch, branch_hint
from launcher.clusters.base import cluster_of
from launcher.errors import ConfigError
from launcher.hydra_dirs import remove_made
from launcher.plan.checks import absolute_paths, check_this_machine, check_weights, disk_warning
from launcher.plan.planner import format_plan, plan
from launcher.sweeps.base import shares_a_base, start_from_base
from launcher.watch.report import override
from rl.core.config import Action, RunConfig
from rl.core.rundir import CONFIG, INTERNAL, TOKEN, RunDir, step_versions


def launch(cfg: DictConfig) -> None:
    """Plan the composed run and execute it; tests call this directly."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if cfg.resume:
        try:
            resume(cfg, Path(cfg.resume))
        finally:
            remove_made(run_dir)
        return
    if cfg.action == Action.eval:  # a run of no step from that run's weights: version 0 is
        try:  # evaluated
            cfg = eval_config(cfg, run_dir.parent.parent)
        except Exception:
            remove_made(run_dir)
            raise
    elif cfg.action not in (Action.run, Action.manifests):
        actions = {
            Action.status: status,
            Action.cancel: partial(cancel, force=cfg.force),
            Action.export: partial(export, step=cfg.step),
        }
        try:  # the runs are found under the outputs folder, two levels above this one's
            actions[cfg.action](cfg.run_dir, run_dir.parent.parent)
        finally:
            remove_made(run_dir)
        return
    if not cfg.dry_run and RunDir(run_dir).is_run():  # a run's directory given again
        raise ConfigError(
            f"hydra.run.dir={run_dir}: it holds a run already; continue it with "
            f"{override('resume', run_dir)}, or give another directory"
        )
    try:
        branched = branch(cfg)  # model.path naming a run: its weights, no warm-up
        absolute_paths(cfg)
        run_plan = plan(cfg)
        cfg = run_plan.config  # with what the plan decided
        run_plan.notes += branched + check_this_machine(cfg)
        base_pending = False  # on Slurm: built by a job this point's jobs start after
        if not cfg.dry_run and shares_a_base(cfg):  # a sweep point: warmed up once per group
            base_pending = start_from_base(cfg, Path(HydraConfig.get().sweep.dir))
            run_plan = plan(cfg)
            cfg = run_plan.config
        if not cfg.dry_run and not base_pending and cluster_of(cfg).sees_files:
            check_weights(cfg)
        if cfg.inference.shared:  # a point of a sweep sharing inference: started with the rest
            from launcher.sweeps import shared as shared_sweep

            if cfg.dry_run:
                shared_sweep.print_service_plan(cfg)
            shared_sweep.add_point(cfg)
    except Exception:
        remove_made(run_dir)
        raise
    if cfg.action == Action.manifests:  # the objects alone on stdout, for kubectl apply -f -
        try:
            print_manifests(cfg, run_plan)
        finally:
            remove_made(run_dir)
        return
    warn_of_disk(cfg, run_dir)
    if cfg.dry_run:
        print(format_plan(run_plan, cfg))
        remove_made(run_dir)
        return
    if cfg.inference.shared:
        return
    for note in branched:
        print(note, flush=True)
    try:
        cluster_of(cfg).start(run_plan)
    finally:
        remove_made(run_dir)  # where the run went elsewhere and left it empty


def print_manifests(cfg: DictConfig, run_plan: Any) -> None:
    """`action=manifests`: the run's objects as one YAML stream on stdout, nothing else."""
    given = [o for o in HydraConfig.get().overrides.task if not o.startswith("action=")]
    sys.stdout.write(cluster_of(cfg).manifests(run_plan, given))
    sys.stdout.flush()


def status(run_dir: str | None, outputs: Path) -> None:
    """`action=status`: the run's status (its cluster's, where it has more to say than the run
    directory); for a sweep directory, its comparison table."""
    from launcher.watch.status import find_run, format_status
    from launcher.watch.status import status as sweep_or_run

    if run_dir and not RunDir(Path(run_dir)).config.exists():
        sweep_or_run(run_dir, outputs)
        return
    run = find_run(run_dir, outputs)
    said = cluster_of(run.load_config()).status(run)
    print(said if said is not None else format_status(run))


def cancel(run_dir: str | None, outputs: Path, force: bool = False) -> None:
    """`action=cancel`: end the run on its cluster."""
    from launcher.watch.status import find_run

    run = find_run(run_dir, outputs)
    cluster_of(run.load_config()).cancel(run, force)


RESUMABLE = ("max_steps", "max_restarts", "environment.eval_every", "trainer.checkpoint_every")
"""Keys a resume may change (and every `wandb.*` and `timeouts.*`): how long the run goes on
and how it is watched, never what it trains or how."""
RESUMABLE_GROUPS = ("wandb.", "timeouts.", "sweep.", "console.")


def resume(cfg: DictConfig, target: Path) -> None:
    """Continue the run in `target` with the config it was started with, changed only by the
    overrides given that `resumable` allows (a larger `max_steps` extends a finished run)."""
    from launcher.watch.report import read_summary

    run = RunDir(target)
    if run.has_old_layout():
        raise ConfigError(
            f"resume={target}: written by an earlier Relay (its internals at the top level, not "
            f"in {INTERNAL}/), which cannot be resumed; start a new run from its weights: "
            f"model.path={target}/weights/step_N"
        )
    if not run.is_run():
        raise ConfigError(
            f"resume={target}: not a run directory (no {CONFIG} and {INTERNAL}/{TOKEN})"
        )
    changes = _resume_changes(cfg, target)
    if edited := run.edited_config():
        raise ConfigError(
            f"resume={target}: its {CONFIG} was changed since the launcher wrote it "
            f"({'; '.join(edited[:5])}); a resume continues with the config the run was started "
            f"with: restore it, change what a resume may change on the command line "
            f"({', '.join(RESUMABLE)}), or start a new run from its weights: "
            f"{branch_hint(target)}"
        )
    config = run.load_config()
    # What a resume keeps is what was checkpointed: later steps are trained again.
    kept = max(step_versions(run.checkpoints), default=0)
    steps = changes.get("max_steps", config.max_steps)
    if steps < kept:
        raise ConfigError(
            f"max_steps={steps}: the run in {target} has checkpointed {kept} steps already "
            f"(a resume continues at step {kept + 1})"
        )
    if read_summary(run).get("status") == "finished" and steps <= kept:
        raise ConfigError(
            f"resume={target}: the run has finished its {kept} steps; to train on, give a "
            f"larger max_steps ({override('resume', target)} max_steps={2 * kept})"
        )
    changed = []
    for key, value in changes.items():
        if OmegaConf.select(config, key) != value:
            changed.append(f"{key} {OmegaConf.select(config, key)} -> {value}")
            OmegaConf.update(config, key, value, merge=False)
    cfg_now = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), config))
    run_plan = plan(cfg_now)  # refuses a setting that cannot work, before anything changes
    cfg_now = run_plan.config
    check_this_machine(cfg_now)
    cluster = cluster_of(cfg_now)
    if cluster.sees_files:
        check_weights(cfg_now)
    cluster.check_ended(run)
    warn_of_disk(cfg_now, run.root, max(step_versions(run.checkpoints), default=0))
    if changed:
        run.write_config(OmegaConf.to_yaml(config))
        run.plan.write_text(run_plan.to_json())
        run.add_overrides([f"{key}={value}" for key, value in changes.items()])
    for marker in (run.summary, run.complete):  # an extended run is open again
        marker.unlink(missing_ok=True)
    _say_where_it_resumes(run, steps, changed, cluster.sees_files)
    cluster.resume(run_plan, run)


GROUPS = ("model", "parallel", "algorithm", "environment", "cluster", "placement", "experiment")
"""The config groups: a selection of one changes what `action=eval`'s run was trained with."""


def eval_config(cfg: DictConfig, outputs: Path) -> DictConfig:
    """`action=eval run_dir=R step=N`: R's config, with the settings this command line gives
    (`eval.*`, `environment.eval_size`, ...), as a run of no RL step (`max_steps=0`) from R's
    version N (its newest where no step is given) without a warm-up: the orchestrator
    evaluates that version (version 0 of this run) and the run ends."""
    from launcher.watch.status import find_run

    run = find_run(cfg.run_dir, outputs)
    config = OmegaConf.merge(OmegaConf.structured(RunConfig), run.load_config())
    if not cluster_of(config).sees_files:  # its weights are on the cluster's volume
        raise ConfigError(
            f"action=eval run_dir={run.root}: a run on cluster={config.cluster.name}, whose "
            f"weights this machine does not see; start a run from them there instead "
            f"(model.path=<its run directory on the volume>/weights/step_N max_steps=0)"
        )
    for requested in given_overrides(("action", "run_dir", "step", "hydra.")):
        key = requested.key_or_group
        if key in GROUPS or requested.is_delete():
            raise ConfigError(
                f"action=eval: {requested.input_line} would change what {run.root} trained; "
                f"the eval runs with its config, changed by settings such as eval.samples=4, "
                f"eval.environments=[...] or environment.eval_size=N"
            )
        OmegaConf.update(config, key, OmegaConf.select(cfg, key), merge=False, force_add=True)
    model_path = run.root / f"step_{cfg.step}" if cfg.step is not None else run.root
    for key, value in {"model.path": str(model_path), "max_steps": 0, "action": "run",
                       "run_dir": None, "step": None, "resume": None}.items():  # fmt: skip
        OmegaConf.update(config, key, value, merge=False)
    config.name = f"{config.name}-eval"
    return config


def warn_of_disk(cfg: Any, run_dir: Path, done: int = 0) -> None:
    """Say so (on stderr, before the run starts) when the run directory's filesystem has less
    free space than the run's checkpoints and weights will take (launcher/plan/checks.py)."""
    if not cluster_of(cfg).sees_files:  # the run's files are on the cluster's volume
        return
    if warning := disk_warning(cfg, run_dir, done):
        print(warning, file=sys.stderr, flush=True)


def resumable(key: str) -> bool:
    return key in RESUMABLE or key.startswith(RESUMABLE_GROUPS)


def given_overrides(skipped: tuple[str, ...]) -> list[Any]:
    """The command line's overrides, parsed, but those starting with one of `skipped`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given = [o for o in HydraConfig.get().overrides.task if not o.startswith(skipped)]
    return OverridesParser.create().parse_overrides(given)


def _resume_changes(cfg: DictConfig, target: Path) -> dict[str, Any]:
    """The settings the command line changes, read from the composed `cfg` (so typed and
    checked by the schema); ConfigError naming the first one a resume may not change."""
    changes = {}
    for requested in given_overrides(("resume=",)):
        key = requested.key_or_group
        if requested.is_delete() or requested.is_add() or not resumable(key):
            raise ConfigError(
                f"resume={target}: {requested.input_line} cannot change on resume (it would "
                f"change what the run trains); resume may change {', '.join(RESUMABLE)}, "
                f"wandb.*, timeouts.*, sweep.* and console.*. To train on with other "
                f"settings, start a new run from its weights: {branch_hint(target)}"
            )
        changes[key] = OmegaConf.select(cfg, key)
    return changes


def _say_where_it_resumes(run: RunDir, steps: int, changed: list[str], seen: bool) -> None:
    note = f"; {', '.join(changed)}" if changed else ""
    where = run.resume_point() if seen else "its newest checkpoint on the cluster's volume"
    print(f"resuming {run.root} at {where} (of {steps}){note}", flush=True)


def export(run_dir: str | None, outputs: Path, step: int | None = None) -> None:
    """Print where the run's newest published version (or step `step`'s version or kept
    checkpoint) is as full HF weights, written there first where it has to be (a LoRA run's
    adapter merged into its base, a checkpoint's master weights in the model's dtype)."""
    from launcher.errors import PlanError
    from launcher.watch.status import find_run
    from rl.trainer.export import export as export_weights

    run = find_run(run_dir, outputs)
    try:
        print(f"full weights: {export_weights(run, step)}")
    except ValueError as err:
        raise PlanError(str(err)) from None
