"""The FP8 block format DeepSeek-V3 and GLM-5 publish their checkpoints in: each 2-D weight
stored as float8_e4m3fn next to a float32 `<name>_scale_inv` holding one scale per
`weight_block_size` block (128 x 128), so that a weight's value is its FP8 value times its
block's scale; `config.json`'s `quantization_config` names the format and the block size.

The trainer reads such a checkpoint slice by slice, each slice dequantized to the training
dtype as it is read (rl/trainer/loading.py): a slice needs only the scales of the blocks it
touches, and rows or columns that start inside a block take that block's scale.

A version of a model whose base is in this format is published in it too: the weights the
base quantized are quantized again, each block scaled so that its largest magnitude is FP8's
largest finite value (448), into the base's files, names, dtypes and config (`write_like`),
or, broadcast, as the same tensors under the same names (`quantized_like`), so that a server
loads each version as it loads the base.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rl.core.safetensors_files import SAFETENSORS_INDEX, safetensors_files

SCALE_SUFFIX = "_scale_inv"
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SMALLEST_SCALE = 1e-12  # the scale of a block of zeros
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
Region = tuple[slice, ...]


def block_size(checkpoint: Path) -> tuple[int, int] | None:
    """The checkpoint's FP8 block size (rows, columns) from its `config.json`, or None when
    its weights are not in the FP8 block format."""
    config_file = Path(checkpoint) / "config.json"
    config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") != "fp8":
        return None
    block = quantization.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError(
            f"{config_file}: quantization_config.weight_block_size is {block!r}; the FP8 block "
            "format needs [rows, columns] (DeepSeek-V3 and GLM-5 publish [128, 128])"
        )
    return int(block[0]), int(block[1])


def scale_name(weight: str) -> str:
    """The name of a weight's block scales (`...weight` -> `...weight_scale_inv`)."""
    return weight + SCALE_SUFFIX


def scale_region(region: Region, block: tuple[int, int]) -> Region:
    """The blocks a 2-D slice of a weight touches, as a slice of its scales."""
    return tuple(slice(s.start // b, -(-s.stop // b)) for s, b in zip(region, block, strict=True))


def dequantize(
    values: torch.Tensor, scales: torch.Tensor, region: Region, block: tuple[int, int]
) -> torch.Tensor:
    """`values` (the FP8 slice `region` of a weight) times the scale of each element's block
    (`scales`: the slice `scale_region(region, block)` of its scales), in float32."""
    return values.float() * _per_element(scales, region, block)


def _per_element(scales: torch.Tensor, region: Region, block: tuple[int, int]) -> torch.Tensor:
    """Each element's block scale, over the 2-D slice `region` whose blocks `scales` holds."""
    index = [
        torch.arange(s.start, s.stop, device=scales.device) // b - s.start // b
        for s, b in zip(region, block, strict=True)
    ]
    return scales.float()[index[0][:, None], index[1][None, :]]


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight as FP8 values and float32 block scales: each block's largest magnitude
    over 448 (edge blocks partial)."""
    rows, columns = weight.shape
    grid = (-(-rows // block[0]), -(-columns // block[1]))
    if weight.is_meta:  # shapes and dtypes only (a broadcast's header)
        values = torch.empty(rows, columns, dtype=torch.float8_e4m3fn, device="meta")
        return values, torch.empty(grid, dtype=torch.float32, device="meta")
    padded = weight.new_zeros(grid[0] * block[0], grid[1] * block[1], dtype=torch.float32)
    padded[:rows, :columns] = weight
    largest = padded.view(grid[0], block[0], grid[1], block[1]).abs().amax(dim=(1, 3))
    scales = (largest / FP8_MAX).clamp(min=SMALLEST_SCALE)
    whole = (slice(0, rows), slice(0, columns))
    values = weight.float() / _per_element(scales, whole, block)
    return values.to(torch.float8_e4m3fn), scales


def _layout(base: Path) -> dict[str, dict[str, torch.dtype]]:
    """The base checkpoint's files, each with its tensors' names and dtypes."""
    layout: dict[str, dict[str, torch.dtype]] = {}
    for file in safetensors_files(base):
        with safe_open(base / file, "pt") as f:
            keys = list(f.keys())
            layout[file] = {k: _dtype(f.get_slice(k).get_dtype()) for k in keys}
    return layout


def _dtype(name: str) -> torch.dtype:
    return DTYPES.get(name, torch.float8_e4m3fn if name == "F8_E4M3" else torch.float32)


class BaseLayout:
    """An FP8 base checkpoint's names and dtypes, to put any part of a version in its format
    (a sharded trainer's version, block by block: `quantized`)."""

    def __init__(self, base: Path) -> None:
        block = block_size(base)
        if block is None:
            raise ValueError(f"{base}: its config.json names no FP8 block format")
        self.base, self.block = base, block
        self.files = _layout(base)
        """Each of the base's files, with its tensors' names and dtypes."""
        self.dtypes = {k: d for tensors in self.files.values() for k, d in tensors.items()}

    def quantized(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` (under the checkpoint's names) in the base's dtypes: a weight the base
        holds in FP8 as its values and block scales (`quantize`), the others cast."""
        out = {}
        for key, tensor in tensors.items():
            if key not in self.dtypes:
                raise KeyError(f"{self.base}: not the layout of these weights: it holds no {key}")
            if scale_name(key) in self.dtypes:
                out[key], out[scale_name(key)] = quantize(tensor, self.block)
            else:
                out[key] = tensor.to(self.dtypes[key])
        return out

    def check_complete(self, names: Iterable[str]) -> None:
        """Raise unless `names` are every tensor of the base."""
        absent = sorted(set(self.dtypes) - set(names))
        if absent:
            raise KeyError(f"{self.base}: these weights have no {absent[:5]}")


def quantized_like(base: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` as the FP8 base holds its weights (`BaseLayout`), every file's tensors in one
    dict: what a weight broadcast sends a server that loads the base."""
    layout = BaseLayout(base)
    quantized = layout.quantized(state)
    layout.check_complete(quantized)
    return quantized


def write_like(base: Path, state: dict[str, torch.Tensor], target: Path) -> None:
    """Write `state` (whole tensors under the checkpoint's names) into `target` in the FP8 base
    checkpoint's layout (`BaseLayout`): its files, names and dtypes, its index and its config
    files; quantized file by file."""
    layout = BaseLayout(base)
    unknown = sorted(set(state) - set(layout.dtypes))
    if unknown:
        raise KeyError(f"{base}: not the layout of these weights: it holds no {unknown[:5]}")
    layout.check_complete(
        list(state) + [scale_name(k) for k in state if scale_name(k) in layout.dtypes]
    )
    target.mkdir(parents=True, exist_ok=True)
    for file, names in layout.files.items():
        weights = {name.removesuffix(SCALE_SUFFIX) for name in names}
        quantized = layout.quantized({w: state[w] for w in weights})
        tensors = {name: quantized[name].contiguous() for name in names}
        save_file(tensors, target / file, metadata={"format": "pt"})
    for extra in (SAFETENSORS_INDEX, "config.json", "generation_config.json"):
        if (base / extra).is_file():
            shutil.copyfile(base / extra, target / extra)
