"""Trainer checkpoints and whole weights under any sharding.

Checkpoints go through torch.distributed.checkpoint (DCP): every rank writes its own shards,
and a checkpoint written by one world size loads into another. A stopped job's checkpoint may
leave out the optimiser state (`trainer.stop_checkpoint_optimizer=false`): a third of the bytes,
and the resumed run's AdamW moments start from zero. `full_state_dict` gathers the
weights for an HF-layout export on rank 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)


def full_state_dict(model: torch.nn.Module, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """Whole, unsharded weights (a collective under FSDP: every rank calls it). Rank 0 gets
    them on the host; with `every_rank`, every rank gets them, on its device."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank)
    return get_model_state_dict(model, options=options)


def _checkpointed(
    model: Any, optimizer: Any, trainable_only: bool
) -> tuple[dict[str, Any], dict[str, Any], StateDictOptions]:
    """The model's and optimiser's state dicts a checkpoint holds: every parameter, or (a LoRA
    run, whose base is its published version 0) only those that train. A tied weight (the LM
    head that is the embedding) is not a parameter of its own and would slip past DCP's
    `ignore_frozen_params`: only names of trainable parameters are kept."""
    options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    if trainable_only:
        trained = {
            name.replace("._checkpoint_wrapped_module", "")
            for name, p in model.named_parameters()
            if p.requires_grad
        }
        model_state = {k: v for k, v in model_state.items() if k in trained}
    return model_state, optim_state, options


def save_checkpoint(
    model: Any,
    optimizer: Any,
    step: int,
    target: Path,
    trainable_only: bool = False,
    with_optimizer: bool = True,
) -> None:
    """Model, optimiser and step with DCP, each rank writing its shards (a collective);
    without `with_optimizer` (a stopped job's checkpoint, `trainer.stop_checkpoint_optimizer`)
    the weights and step only."""
    model_state, optim_state, _ = _checkpointed(model, optimizer, trainable_only)
    state: dict[str, Any] = {"model": model_state, "step": step}
    if with_optimizer:
        state["optim"] = optim_state
    dcp.save(state, checkpoint_id=target)


def has_optimizer(source: Path) -> bool:
    """Whether a DCP checkpoint holds the optimiser's state."""
    keys = dcp.FileSystemReader(str(source)).read_metadata().state_dict_metadata
    return any(key.startswith("optim.") for key in keys)


def load_checkpoint(model: Any, optimizer: Any, source: Path, trainable_only: bool = False) -> int:
    """Load a DCP checkpoint into the model and optimiser as they are sharded now (any world
    size); returns its step."""
    model_state, optim_state, options = _checkpointed(model, optimizer, trainable_only)
    state: dict[str, Any] = {"model": model_state, "step": 0}
    if has_optimizer(source):  # else AdamW's moments start again from zero
        state["optim"] = optim_state
    dcp.load(state, checkpoint_id=source)
    if "optim" not in state:
        set_model_state_dict(model, state["model"], options=options)
        return int(state["step"])
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=options,
    )
    return int(state["step"])


def save_model_state(model: Any, target: Path) -> None:
    """A model's weights alone with DCP, each rank writing its shards (a collective)."""
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=target)


def load_model_state(model: Any, source: Path) -> None:
    """Weights `save_model_state` wrote, into the model as it is sharded now (a collective)."""
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=source)
    set_model_state_dict(model, state["model"])
