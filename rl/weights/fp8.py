"""The FP8 block format DeepSeek-V3 and GLM-5 publish their checkpoints in: each 2-D weight
stored as float8_e4m3fn next to a float32 `<name>_scale_inv` holding one scale per
`weight_block_size` block (128 x 128), so that a weight's value is its FP8 value times its
block's scale; `config.json`'s `quantization_config` names the format and the block size.

The trainer reads such a checkpoint slice by slice, each slice dequantized to the training
dtype as it is read (rl/trainer/loading.py): a slice needs only the scales of the blocks it
touches, and rows or columns that start inside a block take that block's scale.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"
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
    index = [
        torch.arange(s.start, s.stop) // b - s.start // b
        for s, b in zip(region, block, strict=True)
    ]
    per_element = scales.float()[index[0][:, None], index[1][None, :]]
    return values.float() * per_element
