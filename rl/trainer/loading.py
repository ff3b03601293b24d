"""Sharded loading: each trainer rank reads from the checkpoint's safetensors files only the
slices of each tensor that its own shards hold.

Every rank builds the model on the meta device (shapes, no memory) and applies its parallelism
(rl/trainer/parallel.py); a parameter is then a DTensor whose placements say which part of the
whole tensor this rank keeps. `load_shards` gives each parameter storage on the rank's device
and fills it from the files: `safe_open(file).get_slice(name)[rows, columns]` reads those bytes
only (FSDP's and EP's shards are rows, contiguous in the file), converted to the training dtype
and, for a checkpoint in the FP8 block format, dequantized as they are read (rl/core/fp8.py).
A rank's memory grows by its shards plus the slice in flight, never by a whole model
(tests/test_sharded_load.py measures it). One process takes the same path, every tensor whole.

Names follow transformers' own loading: its conversion mapping renames checkpoint keys, and
stacks the per-expert matrices of a MoE block (`experts.<e>.gate_proj.weight`, `up_proj`) into
the module's `[experts, rows, columns]` parameter, parts concatenated along the rows. A tied
weight (the LM head that is the embedding) is read once, under whichever of its names the
checkpoint holds.

What the checkpoint does not hold: a LoRA adapter's matrices start from `adapter_start`
(rl/trainer/lora.py), the same in any layout; non-persistent buffers (rotary frequencies) are
recomputed as transformers recomputes them after its own meta-device load.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from rl.core import fp8
from rl.core.lora import is_adapter_name
from rl.core.safetensors_files import safetensors_files
from rl.weights.lora import adapter_tensors, base_tensors

Region = tuple[slice, ...]


class SafetensorsFiles:
    """A checkpoint directory's tensors: which file holds each and its shape (headers only are
    read here), and slices of them, FP8 blocks dequantized."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        files = safetensors_files(self.path)
        self.file_of: dict[str, str] = {}
        self.shape_of: dict[str, tuple[int, ...]] = {}
        for file in files:
            with safe_open(self.path / file, "pt") as f:
                for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    self.file_of[key] = file
                    self.shape_of[key] = tuple(f.get_slice(key).get_shape())
        self.block = fp8.block_size(self.path)

    def names(self) -> list[str]:
        """The tensors that are weights (FP8 block scales belong to their weight)."""
        return [k for k in self.file_of if not k.endswith(fp8.SCALE_SUFFIX)]

    def _slice(self, key: str, region: Region) -> torch.Tensor:
        # One file opened per read: its pages are mapped only while the slice is copied out.
        with safe_open(self.path / self.file_of[key], "pt") as f:
            return f.get_slice(key)[region]

    def read(self, key: str, region: Region, dtype: torch.dtype) -> torch.Tensor:
        """The slice `region` of tensor `key`, in `dtype` (an FP8 weight dequantized first)."""
        values = self._slice(key, region)
        scales = fp8.scale_name(key)
        if self.block is not None and scales in self.file_of:
            kept = fp8.scale_region(region, self.block)
            values = fp8.dequantize(values, self._slice(scales, kept), region, self.block)
        return values.to(dtype)


@dataclass(frozen=True)
class Whole:
    """A parameter stored under one name, as it is."""

    key: str

    def read(self, files: SafetensorsFiles, region: Region, dtype: torch.dtype) -> torch.Tensor:
        return files.read(self.key, region, dtype)


@dataclass(frozen=True)
class Stacked:
    """A MoE block's stacked experts `[experts, rows, columns]`: expert e's matrix is its parts
    (`keys[e]`: gate then up, say) concatenated along the rows."""

    keys: tuple[tuple[str, ...], ...]
    part_rows: tuple[int, ...]

    def read(self, files: SafetensorsFiles, region: Region, dtype: torch.dtype) -> torch.Tensor:
        experts, rows, columns = region
        out = torch.empty(tuple(s.stop - s.start for s in region), dtype=dtype)
        for e in range(experts.start, experts.stop):
            start = 0
            for key, count in zip(self.keys[e], self.part_rows, strict=True):
                low, high = max(rows.start, start), min(rows.stop, start + count)
                if low < high:
                    part = (slice(low - start, high - start), columns)
                    out[e - experts.start, low - rows.start : high - rows.start] = files.read(
                        key, part, dtype
                    )
                start += count
        return out


def checkpoint_sources(model: nn.Module, files: SafetensorsFiles) -> dict[str, Whole | Stacked]:
    """Where each of the model's tensors is in the checkpoint, by its name in the (unwrapped)
    model: keys renamed, and experts stacked, by transformers' conversion mapping for it."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    transforms = get_model_conversion_mapping(base)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    sources: dict[str, Whole | Stacked] = {}
    stacks: dict[str, dict[tuple[int, int], str]] = {}
    for key in files.names():
        name, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            sources[name] = Whole(key)
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        _check_stacking(converter, name)
        expert = re.escape(pattern).replace(r"\*", r"(\d+)")
        found = re.search(expert, key)
        assert found is not None  # the converter matched this key
        part = converter.source_patterns.index(pattern)
        stacks.setdefault(name, {})[(int(found.group(1)), part)] = key
    for name, keys in stacks.items():
        experts = 1 + max(e for e, _ in keys)
        parts = 1 + max(p for _, p in keys)
        grid = tuple(tuple(keys[(e, p)] for p in range(parts)) for e in range(experts))
        sources[name] = Stacked(grid, tuple(files.shape_of[k][0] for k in grid[0]))
    return sources


def _check_stacking(converter: Any, name: str) -> None:
    """Only stacking experts (MergeModulelist on dim 0), then concatenating parts along the
    rows (Concatenate on dim 1), is read slice by slice."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    if ops not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
        raise NotImplementedError(
            f"{name}: transformers converts its checkpoint tensors with {ops}; sharded loading "
            "reads experts stacked on dim 0 and parts concatenated on dim 1 only"
        )


def local_region(param: torch.Tensor) -> Region:
    """The part of the whole tensor this rank holds: all of it, or a DTensor's local shard."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, attribute) places of each parameter that has several (a tied weight)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for leaf, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, leaf))
    return [where for where in places.values() if len(where) > 1]


def _names_of_each_parameter(model: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    """Every parameter once, with all the names it has (a tied weight has two): HF names for
    the base model's, PEFT's saved names for an adapter's."""
    groups: dict[int, tuple[list[str], nn.Parameter]] = {}
    named = dict(model.named_parameters(remove_duplicate=False))
    base = base_tensors(named)
    for name, param in {**base, **adapter_tensors(named)}.items():
        groups.setdefault(id(param), ([], param))[0].append(name)
    return list(groups.values())


def load_shards(
    model: nn.Module,
    checkpoint: Path,
    device: torch.device,
    start: Callable[[str, tuple[int, ...]], torch.Tensor],
    offload: bool = False,
) -> None:
    """Give the meta-device `model` (sharded or not) storage on `device` (the host with FSDP's
    CPU offload) and fill each parameter's local part from `checkpoint`; a LoRA adapter's
    matrices, which no checkpoint holds, from `start(name, shape)`."""
    files = SafetensorsFiles(checkpoint)
    sources = checkpoint_sources(model, files)
    materialize(model, device, offload)
    with torch.no_grad():
        for names, param in _names_of_each_parameter(model):
            local = param.to_local() if isinstance(param, DTensor) else param
            region = local_region(param)
            local.copy_(_read(names, param, region, files, sources, start))
        _fill_buffers(model, files, sources, device)


def materialize(model: nn.Module, device: torch.device, offload: bool = False) -> None:
    """Give the meta-device `model`'s parameters and buffers storage (uninitialized) on
    `device` (the host with FSDP's CPU offload), a tied weight still one tensor."""
    tied = _shared_parameters(model)
    model.to_empty(device="cpu" if offload else device)
    for places in tied:  # to_empty gives every module a new tensor of its own
        first = getattr(*places[0])
        for module, leaf in places[1:]:
            setattr(module, leaf, first)


def _read(
    names: list[str],
    param: torch.Tensor,
    region: Region,
    files: SafetensorsFiles,
    sources: dict[str, Whole | Stacked],
    start: Callable[[str, tuple[int, ...]], torch.Tensor],
) -> torch.Tensor:
    """A parameter's `region`, from the checkpoint (or the adapter's start)."""
    held = [n for n in names if n in sources]
    if held:
        return sources[held[0]].read(files, region, param.dtype)
    if all(is_adapter_name(n) for n in names):
        return start(names[0], tuple(param.shape))[region].to(param.dtype)
    raise KeyError(f"{files.path} holds no tensor for parameter {' / '.join(names)}")


def _fill_buffers(
    model: nn.Module,
    files: SafetensorsFiles,
    sources: dict[str, Whole | Stacked],
    device: torch.device,
) -> None:
    """Persistent buffers (a MoE router's bias) from the checkpoint, whole; non-persistent
    ones (rotary frequencies) recomputed by transformers' own initialisation of their
    module; all on `device`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    named = base_tensors(dict(model.named_buffers(remove_duplicate=False)))
    owners = {id(b): n for n, b in named.items()}
    for module in model.modules():
        recompute = False
        for leaf, buffer in module._buffers.items():
            if buffer is None:
                continue
            if leaf in module._non_persistent_buffers_set:
                recompute = True
            else:
                name = owners[id(buffer)]
                if name not in sources:
                    raise KeyError(f"{files.path} holds no tensor for buffer {name}")
                buffer.copy_(sources[name].read(files, local_region(buffer), buffer.dtype))
        if recompute:
            if next(module.parameters(recurse=False), None) is not None:
                raise NotImplementedError(
                    f"{type(module).__name__} holds parameters and non-persistent buffers; "
                    "sharded loading recomputes buffers of parameter-free modules only"
                )
            base._init_weights(module)
        for leaf, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[leaf] = buffer.to(device)
