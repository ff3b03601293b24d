"""A LoRA run's versions on disk and on the wire: version 0 is the base in full, every later
version the adapter alone, as a directory PEFT's `PeftModel.from_pretrained` and vLLM's LoRA
loader read (`adapter_config.json`, `adapter_model.safetensors`, PEFT's tensor names)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rl.core.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PREFIX, is_adapter_name


def is_wrapped(model: Any) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def _clean(key: str) -> str:
    """A PEFT model's parameter name without the activation-checkpointing wrapper's part."""
    return key.replace("._checkpoint_wrapped_module", "")


def adapter_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """The adapter's tensors of a PEFT model's state dict, under PEFT's saved names
    (`base_model.model.<module>.lora_A.weight`: the adapter's own name dropped)."""
    out = {}
    for key, tensor in state.items():
        if is_adapter_name(key):
            out[_clean(key).replace(".default.weight", ".weight")] = tensor
    return out


def base_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """The base model's tensors of a PEFT model's state dict, under the base model's names."""
    out = {}
    for key, tensor in state.items():
        if is_adapter_name(key):
            continue
        name = _clean(key).removeprefix(PREFIX).replace(".base_layer.", ".")
        out[name] = tensor
    return out


def write_adapter(out: Path, model: Any, tensors: dict[str, Any], base: str) -> None:
    """An adapter directory of the PEFT `model`'s adapter, holding `tensors` (PEFT's saved
    names), that PEFT's `PeftModel.from_pretrained` and vLLM's LoRA loader read."""
    from safetensors.torch import save_file

    peft = model.peft_config["default"]
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": int(peft.r),
        "lora_alpha": float(peft.lora_alpha),
        "lora_dropout": float(peft.lora_dropout),
        "target_modules": sorted(peft.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / ADAPTER_WEIGHTS))


def select(version: int) -> Any:
    """Which tensors of a PEFT model's state dict version `version` holds, under the names it
    is published by: the base for version 0, the adapter after."""
    return base_tensors if version == 0 else adapter_tensors


def publish(version: int, model: Any, tokenizer: Any, state: Any, run_dir: Any) -> None:
    """Version `version` of a LoRA run into `weights/step_N`: the base in full for version 0,
    the adapter after (its base named as the run's version 0). `state`: the model's state
    dict (None: the module's own), or its blocks (`BlockSource`) holding just this version's
    tensors, gathered layer by layer from a sharded trainer and cast to the published dtype."""
    from rl.core.model import publish_blocks, publish_dir, publish_weights
    from rl.weights.base import BlockSource

    target = run_dir.weights_for(version)
    if version == 0 and isinstance(state, BlockSource):
        publish_blocks(model.get_base_model(), tokenizer, target, state)
        return
    tensors = published_tensors(version, model, state)
    if version == 0:
        publish_weights(model.get_base_model(), tokenizer, target, tensors)
        return
    base = str(run_dir.weights_for(0))
    publish_dir(target, lambda tmp: write_adapter(tmp, model, tensors, base))


def published_tensors(version: int, model: Any, state: Any) -> dict[str, Any]:
    """What version `version` holds (the base for version 0, the adapter after), from the
    model's state dict (None: the module's own) or from blocks that hold just that."""
    from rl.weights.base import BlockSource

    if isinstance(state, BlockSource):
        return {name: t for block in state.blocks() for name, t in block.items()}
    return select(version)(model.state_dict() if state is None else state)


def read_adapter(path: Path) -> tuple[dict[str, Any], float]:
    """A published adapter directory's tensors (each checked finite) and its scale, from its
    files as the trainer recorded them (rl/weights/published.py)."""
    from rl.weights.published import RefusedWeights, tensors_of, verified_files

    files = dict(verified_files(Path(path)))
    try:
        config = json.loads(files[ADAPTER_CONFIG])
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (KeyError, ValueError, TypeError, ZeroDivisionError) as exc:
        raise RefusedWeights(f"{path}: no readable {ADAPTER_CONFIG} ({exc!r})") from None
    if ADAPTER_WEIGHTS not in files:
        raise RefusedWeights(f"{path} holds no {ADAPTER_WEIGHTS}")
    return dict(tensors_of(files[ADAPTER_WEIGHTS], Path(path) / ADAPTER_WEIGHTS)), alpha / rank
