"""LoRA applied by the embedded engine without merging: a forward hook on each adapted Linear
adds `scale * B @ A @ x` of each row's adapter, so loading a version replaces a few small
matrices and the base weights stay as version 0 left them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl.core.lora import PREFIX


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
