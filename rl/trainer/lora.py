"""LoRA in the trainer: the model wrapped with PEFT before sharding, so that only the
adapter's A and B matrices train (B starts at zero: the wrapped model computes what the base
did); during the warm-up the base trains instead (`train_only`).

The adapter's start is a function of the run's seed and each matrix's name (`adapter_start`),
not of the order in which a process draws random numbers: a rank that builds the model on the
meta device and fills its shards later (rl/trainer/loading.py) starts from the same adapter
as one process does."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from typing import Any

import torch

from rl.core.config import ModelConfig
from rl.core.lora import is_adapter_name, scale, targets


def wrap(model: Any, model_cfg: ModelConfig, seed: int = 0) -> Any:
    """`model` as a PEFT model whose only trainable parameters are the adapter's, which start
    from `adapter_start(seed)` (B at zero: the wrapped model computes what `model` did). On
    the meta device the adapter stays empty until its shards are filled."""
    from peft import LoraConfig, get_peft_model

    lora = model_cfg.lora
    config = LoraConfig(
        r=int(lora.rank),
        lora_alpha=scale(model_cfg) * int(lora.rank),
        lora_dropout=float(lora.dropout),
        target_modules=targets(model_cfg),
        bias="none",
    )
    wrapped = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in adapter_parameters(wrapped):
            if not param.is_meta:
                param.copy_(adapter_start(name, tuple(param.shape), seed))
    return wrapped


def adapter_parameters(model: Any) -> list[tuple[str, Any]]:
    """The adapter's matrices under PEFT's saved names (what `adapter_start` is keyed by)."""
    from rl.weights.lora import adapter_tensors

    return list(adapter_tensors(dict(model.named_parameters())).items())


def adapter_start(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """An adapter matrix's starting value, drawn from `seed` and its name (PEFT's saved
    one): A uniform in +-1/sqrt(fan_in) (PEFT's default, Kaiming-uniform with a = sqrt(5)),
    B zero."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed((seed * 2**32 + zlib.crc32(name.encode())) % 2**63)
    bound = 1 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=gen) * 2 - 1) * bound


def train_only(model: Any, adapter: bool) -> None:
    """Make the adapter's parameters the trainable ones (`adapter`), or the base's."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name) == adapter)


def numel(tensors: Iterable[Any]) -> int:
    return sum(t.numel() for t in tensors)
