"""A run's weights at a step, as full Hugging Face weights: `rl action=export [step=N]`.

Three sources, by what the run directory holds for that step:
- a published version of the whole model (`weights/step_N/`) is already that: its path;
- a LoRA run's published adapter is merged into its base (version 0);
- a kept trainer checkpoint (`checkpoints/step_N/`, `trainer.keep_checkpoints`): its float32
  master weights (for LoRA, the adapter, merged into version 0) written in the model's dtype.
A merged or converted version is written once into `export/step_N/` (COMPLETE last). This runs
in one process, on the host: it holds the whole model once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rl.core.lora import enabled as lora_enabled
from rl.core.lora import is_adapter_dir
from rl.core.rundir import RunDir, is_complete, step_versions


def export(run: RunDir, step: int | None = None) -> Path:
    """Step `step`'s weights (None: the newest published version) as a full HF checkpoint."""
    step, target = export_target(run, step)
    if not is_complete(target):
        published = run.weights_for(step)
        model, tokenizer = (
            _merged(run, published) if step in run.published_versions() else _restored(run, step)
        )
        from rl.core.model import publish_weights

        target.parent.mkdir(exist_ok=True)
        publish_weights(model, tokenizer, target)
    return target


def export_target(run: RunDir, step: int | None = None) -> tuple[int, Path]:
    """The step `export` takes (None: the newest published version) and where its full HF
    weights are or will be, writing nothing; a ValueError naming what the run holds when it
    has no such step."""
    versions, kept = run.published_versions(), step_versions(run.checkpoints)
    if step is None:
        if not versions:
            raise ValueError(f"{run.root}: no published weights to export")
        step = versions[-1]
    published = run.weights_for(step)
    if step in versions and not is_adapter_dir(published):
        return step, published
    if step not in versions and step not in kept:
        raise ValueError(
            f"step={step}: {run.root} holds neither a published version nor a checkpoint of "
            f"that step (published: {versions or 'none'}; checkpoints: {kept or 'none'})"
        )
    return step, run.root / "export" / published.name


def _merged(run: RunDir, adapter: Path) -> tuple[Any, Any]:
    """A published adapter merged into its base, the run's version 0."""
    from peft import PeftModel

    from rl.core.model import load_model, load_tokenizer

    base = run.weights_for(0)
    model = PeftModel.from_pretrained(load_model(base), adapter).merge_and_unload()
    return model, load_tokenizer(base)


def _restored(run: RunDir, step: int) -> tuple[Any, Any]:
    """The model a trainer checkpoint holds, in the model's dtype: the base checkpoint (a
    LoRA run's version 0, with the adapter wrapped on) in the master dtype, with the
    checkpoint's weights read into it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from rl.core.derive import precision
    from rl.core.model import ensure_checkpoint, load_model, load_tokenizer
    from rl.trainer.lora import wrap

    cfg = run.load_config()
    adapted = lora_enabled(cfg.model)
    base = run.weights_for(0) if adapted else ensure_checkpoint(cfg.model)
    dtypes = precision(cfg)
    model = load_model(base, dtype=dtypes.master)
    if adapted:
        model = wrap(model, cfg.model, cfg.seed)
    options = StateDictOptions(ignore_frozen_params=adapted, strict=not adapted)
    state = get_model_state_dict(model, options=options)
    if adapted:  # the checkpoint holds the adapter's matrices only
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        state = {k: v for k, v in state.items() if k in trained}
    holder = {"model": state}
    dcp.load(holder, checkpoint_id=run.checkpoint_for(step))
    set_model_state_dict(model, holder["model"], options=options)
    if adapted:
        model = model.merge_and_unload()
    return model.to(getattr(torch, dtypes.published)), load_tokenizer(base)
