"""LoRA in the trainer: the model wrapped with PEFT before sharding, so that only the
adapter's A and B matrices train (B starts at zero: the wrapped model computes what the base
did); during the warm-up the base trains instead (`train_only`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rl.core.config import ModelConfig
from rl.core.lora import is_adapter_name, scale, targets


def wrap(model: Any, model_cfg: ModelConfig) -> Any:
    """`model` as a PEFT model whose only trainable parameters are the adapter's (B starts at
    zero: the wrapped model computes what `model` did)."""
    from peft import LoraConfig, get_peft_model

    lora = model_cfg.lora
    config = LoraConfig(
        r=int(lora.rank),
        lora_alpha=scale(model_cfg) * int(lora.rank),
        lora_dropout=float(lora.dropout),
        target_modules=targets(model_cfg),
        bias="none",
    )
    return get_peft_model(model, config)


def train_only(model: Any, adapter: bool) -> None:
    """Make the adapter's parameters the trainable ones (`adapter`), or the base's."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name) == adapter)


def nbytes(tensors: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
