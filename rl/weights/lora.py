"""A LoRA run's versions on disk and on the wire: version 0 is the base in full, every later
version the adapter alone, as a directory PEFT's `PeftModel.from_pretrained` and vLLM's LoRA
loader read (`adapter_config.json`, `adapter_model.safetensors`, PEFT's tensor names)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rl.core.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PREFIX, is_adapter_dir, is_adapter_name


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


def publish(version: int, model: Any, tokenizer: Any, state: dict | None, run_dir: Any) -> None:
    """Version `version` of a LoRA run into `weights/step_N`: the base in full for version 0,
    the adapter after (its base named as the run's version 0)."""
    from rl.core.model import publish_dir, publish_weights

    state = model.state_dict() if state is None else state
    target = run_dir.weights_for(version)
    if version == 0:
        publish_weights(model.get_base_model(), tokenizer, target, base_tensors(state))
        return
    base = str(run_dir.weights_for(0))
    publish_dir(target, lambda tmp: write_adapter(tmp, model, adapter_tensors(state), base))


def published_tensors(version: int, model: Any, state: dict | None) -> dict[str, Any]:
    """What a broadcast of `version` sends: the base for version 0, the adapter after."""
    state = model.state_dict() if state is None else state
    return base_tensors(state) if version == 0 else adapter_tensors(state)


def read_adapter(path: Path) -> tuple[dict[str, Any], float]:
    """An adapter directory's tensors (each checked finite) and its scale."""
    from rl.weights.published import checked_tensors

    config = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    return dict(checked_tensors(Path(path))), alpha / rank


def export(run: Any, version: int | None = None) -> Path:
    """Version `version` (the newest published) of a run as full HF weights: an adapter merged
    into its base (version 0) into `export/step_N/` of the run (written once, COMPLETE last),
    or the version's own directory where it holds full weights."""
    from rl.core.model import load_model, load_tokenizer, publish_weights
    from rl.core.rundir import is_complete

    versions = run.published_versions()
    if not versions:
        raise ValueError(f"{run.root}: no published weights to export")
    version = versions[-1] if version is None else version
    source = run.weights_for(version)
    if not is_adapter_dir(source):
        return source
    target = run.root / "export" / source.name
    if not is_complete(target):
        from peft import PeftModel

        base = run.weights_for(0)
        model = PeftModel.from_pretrained(load_model(base), source).merge_and_unload()
        target.parent.mkdir(exist_ok=True)
        publish_weights(model, load_tokenizer(base), target)
    return target
