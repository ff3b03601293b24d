"""A new run from another run's weights: `model.path=<run dir>` (its newest published version),
`<run dir>/step_N` (version N, or the checkpoint of step N), or one of its version folders.

The path is replaced by full HF weights of that step (rl/trainer/export.py: a LoRA run's
adapter merged into its base, a checkpoint's master weights; written into the source run's
`export/` before the run starts, never by a dry run), and the supervised warm-up is turned off,
since those weights are already trained, unless `warmup.steps` was given. The plan says both.
"""

from __future__ import annotations

import re
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from launcher.errors import refuse
from rl.core.rundir import RunDir

STEP = re.compile(r"^step_(\d+)$")
VERSION_FOLDERS = ("weights", "checkpoints", "export")


def source_run(path: Path) -> tuple[RunDir, int | None] | None:
    """The run and step `path` names (None: its newest version), or None when it names none."""
    if RunDir(path).is_run():
        return RunDir(path), None
    found = STEP.match(path.name)
    if found is None:
        return None
    parent = path.parent
    if parent.name in VERSION_FOLDERS:
        parent = parent.parent
    return (RunDir(parent), int(found[1])) if RunDir(parent).is_run() else None


def branch(cfg: DictConfig) -> list[str]:
    """Where `model.path` names a run, point it at that step's full weights (exporting them
    first, unless this is a dry run) and turn the warm-up off unless it was given; returns
    what the plan should say about it."""
    given = cfg.model.path
    found = source_run(Path(given)) if given else None
    if found is None:
        return []
    run, step = found
    from rl.trainer.export import export, export_target

    trained = run.load_config().model.name
    if trained != cfg.model.name:
        refuse(
            f"model.path={given}",
            f"that run trained model={trained}; add model={trained} to start from its weights",
        )
    try:
        step, target = export_target(run, step)
    except ValueError as err:
        refuse(f"model.path={given}", str(err))
    notes = [f"model.path={given}: run {run.root}'s version {step}, as full weights in {target}"]
    if not target.exists():
        if cfg.dry_run:
            notes.append(f"the run would first write them there (action=export step={step})")
        else:
            print(f"exporting {run.root}'s step {step} to {target}", flush=True)
            export(run, step)
    cfg.model.path = str(target)
    if cfg.warmup.steps and not _given("warmup.steps"):
        cfg.warmup.steps = 0
        notes.append(
            "no supervised warm-up: those weights are already trained (warmup.steps=N asks for one)"
        )
    return notes


def _given(key: str) -> bool:
    """Whether `key` was set on the command line."""
    return any(o.split("=", 1)[0].lstrip("+~") == key for o in HydraConfig.get().overrides.task)


def branch_hint(run: Path) -> str:
    """The overrides that start a new run from `run`'s newest weights, as the user types them."""
    model = RunDir(run).load_config().model.name
    return f"model={model} model.path={run}"
