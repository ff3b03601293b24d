"""LoRA (`model.lora.rank > 0`): the trainer trains a low-rank adapter and inference applies it.

The trainer wraps its model with PEFT before sharding, so only the adapter's A and B matrices
train. Version 0 is the base in full (the model after the supervised warm-up, which trains every
weight when the run has one); every later version is an adapter directory in the layout PEFT and
vLLM read (`adapter_config.json`, `adapter_model.safetensors`, PEFT's tensor names), and only
its tensors travel by broadcast. The KL reference, where a loss has one, is the same model with
the adapter switched off.

The embedded engine applies an adapter without merging it (`Adapters`): a forward hook on each
adapted Linear adds `scale * B @ A @ x`, so loading a version replaces a few small matrices and
the base weights stay as version 0 left them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl.config import ModelConfig

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


def is_wrapped(model: Any) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def is_adapter_name(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def train_only(model: Any, adapter: bool) -> None:
    """Make the adapter's parameters the trainable ones (`adapter`), or the base's."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name) == adapter)


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


def nbytes(tensors: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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
    from rl.model import publish_dir, publish_weights

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


def is_adapter_dir(path: Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


@dataclass
class Adapter:
    """One loaded adapter: per module name, (A [rank, in], B [out, rank]), and its scale."""

    weights: dict[str, tuple[Any, Any]]
    scale: float
    version: int


class Adapters:
    """LoRA applied by the embedded engine without merging: a forward hook on each target
    Linear adds `scale * B @ (A @ x)` of each row's adapter. Several adapters are held by name
    and served side by side, rows of one batch taking different ones (`route`). Parsing checks
    every tensor against the module it adapts before anything changes."""

    def __init__(self, model: Any, target_names: list[str]) -> None:
        import torch

        wanted = set(target_names)
        self.modules = {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in wanted
        }
        if not self.modules:
            raise ValueError(f"model.lora: the served model has no Linear named {target_names}")
        self.device = next(model.parameters()).device
        self.loaded: dict[str, Adapter] = {}
        # The forward pass under way: one adapter for every row, or (adapter, row indices).
        self.whole: Adapter | None = None
        self.groups: list[tuple[Adapter, Any]] = []
        for name, module in self.modules.items():
            module.register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Any:
        def add(module: Any, inputs: tuple[Any, ...], output: Any) -> Any:
            x = inputs[0]
            if self.whole is not None:
                return output + _delta(self.whole, name, x, output)
            if not self.groups:
                return output
            output = output.clone()
            for adapter, rows in self.groups:
                output[rows] += _delta(adapter, name, x[rows], output[rows])
            return output

        return add

    def route(self, names: list[str]) -> None:
        """The adapter of each row of the next forward passes, by name ("" or an unknown name:
        the base alone)."""
        import torch

        rows: dict[str, list[int]] = {}
        for row, name in enumerate(names):
            if name in self.loaded:
                rows.setdefault(name, []).append(row)
        self.whole, self.groups = None, []
        if len(rows) == 1 and len(next(iter(rows.values()))) == len(names):
            self.whole = self.loaded[next(iter(rows))]
            return
        for name, indices in rows.items():
            index = torch.tensor(indices, device=self.device)
            self.groups.append((self.loaded[name], index))

    def parse(self, tensors: dict[str, Any], scale_: float, version: int, source: str) -> Adapter:
        """An `Adapter` from PEFT-named tensors, or ValueError naming what does not fit."""
        pairs: dict[str, dict[str, Any]] = {}
        for key, tensor in tensors.items():
            module, _, rest = key.removeprefix(PREFIX).rpartition(".lora_")
            if rest not in ("A.weight", "B.weight") or module not in self.modules:
                raise ValueError(f"{source}: tensor {key} adapts no target module of this model")
            pairs.setdefault(module, {})[rest[0]] = tensor
        weights = {}
        for module, pair in pairs.items():
            linear = self.modules[module]
            a, b = pair.get("A"), pair.get("B")
            if a is None or b is None:
                raise ValueError(f"{source}: {module} has lora_A or lora_B missing")
            fits = a.dim() == b.dim() == 2 and a.shape[0] == b.shape[1]
            if not fits or a.shape[1] != linear.in_features or b.shape[0] != linear.out_features:
                raise ValueError(
                    f"{source}: {module}'s A {tuple(a.shape)} and B {tuple(b.shape)} do not fit "
                    f"its {linear.in_features} -> {linear.out_features} Linear"
                )
            device = linear.weight.device
            weights[module] = (a.to(device), b.to(device))
        return Adapter(weights, scale_, version)

    def put(self, name: str, adapter: Adapter | None) -> None:
        """Serve `adapter` under `name` from the next batch on (None: `name` serves the base)."""
        if adapter is None:
            self.loaded.pop(name, None)
        else:
            self.loaded[name] = adapter


def _delta(adapter: Adapter, module: str, x: Any, like: Any) -> Any:
    """One adapter's addition to a module's output for inputs `x` (0 where it adapts not)."""
    if module not in adapter.weights:
        return 0
    a, b = adapter.weights[module]
    return (x.to(a.dtype) @ a.T @ b.T * adapter.scale).to(like.dtype)


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
    from rl.model import load_model, load_tokenizer, publish_weights
    from rl.rundir import is_complete

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
