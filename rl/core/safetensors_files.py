"""Where an HF checkpoint directory keeps its weights: the safetensors files its index names,
or its one file. Read by the model's loading and publishing (rl/core/model.py), the FP8 block
format (rl/core/fp8.py) and the trainer's sharded loading (rl/trainer/loading.py)."""

from __future__ import annotations

import json
from pathlib import Path

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


def safetensors_files(checkpoint: Path) -> list[str]:
    """The safetensors files of an HF checkpoint: those its index names, or its one file."""
    index = Path(checkpoint) / SAFETENSORS_INDEX
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (Path(checkpoint) / SAFETENSORS_SINGLE).is_file():
        return [SAFETENSORS_SINGLE]
    raise FileNotFoundError(f"{checkpoint}: neither {SAFETENSORS_INDEX} nor {SAFETENSORS_SINGLE}")
