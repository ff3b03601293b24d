"""LoRA's facts (`model.lora.rank > 0`): whether a run trains an adapter, which modules it
adapts, its scale, and how an adapter is named and laid out on disk. Torch-free: the planner
reads them, and every role that touches adapters builds on them:

- the trainer wraps its model with PEFT before sharding, so only the adapter's A and B matrices
  train (rl/trainer/lora.py);
- version 0 is the base in full (the model after the supervised warm-up, which trains every
  weight when the run has one); every later version is an adapter directory in the layout PEFT
  and vLLM read (`adapter_config.json`, `adapter_model.safetensors`, PEFT's tensor names), and
  only its tensors travel by broadcast (rl/weights/lora.py);
- the embedded engine applies an adapter without merging it (rl/inference/adapters.py);
- the KL reference, where a loss has one, is the same model with the adapter switched off.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# A name an adapter is served under (a request's `model`).
ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's saved names: <module path>.lora_A.weight under this prefix.
PREFIX = "base_model.model."

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# The modules adapted by default, per transformers model_type: the attention projections (GLM-5's
# multi-head latent attention has its own names). Add MLP projections with
# model.lora.target_modules; routed experts (fused 3-D parameters) cannot be adapted.
TARGETS: dict[str, tuple[str, ...]] = {
    "qwen3": ATTENTION,
    "qwen2": ATTENTION,
    "llama": ATTENTION,
    "mistral": ATTENTION,
    "qwen3_moe": ATTENTION,
    "minimax_m2": ATTENTION,
    "glm_moe_dsa": ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
}


def enabled(model_cfg: Any) -> bool:
    return int(model_cfg.lora.rank) > 0


def targets(model_cfg: Any) -> list[str]:
    """The names of the Linear modules the adapter covers; ValueError, in one line, for a family
    whose targets are unknown (and none were given) or a target among the routed experts."""
    given = [str(t) for t in model_cfg.lora.target_modules]
    chosen = given or list(TARGETS.get(str(model_cfg.model_type), ()))
    if not chosen:
        raise ValueError(
            f"model.lora: no default LoRA targets for model_type {model_cfg.model_type} "
            f"(known: {', '.join(sorted(TARGETS))}); name them with "
            "model.lora.target_modules=[q_proj,v_proj] (its Linear modules' names)"
        )
    experts = [t for t in chosen if "expert" in t]
    if experts:
        raise ValueError(
            f"model.lora.target_modules={experts}: LoRA on routed experts is not built; adapt "
            "the attention or dense projections instead"
        )
    return chosen


def scale(model_cfg: Any) -> float:
    """alpha / rank: the factor on B @ A."""
    lora = model_cfg.lora
    alpha = lora.alpha if lora.alpha is not None else 2 * lora.rank
    return float(alpha) / float(lora.rank)


def is_adapter_name(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def is_adapter_dir(path: Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()
