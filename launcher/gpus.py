"""This machine's GPUs, found without importing torch: `nvidia-smi`'s CSV query, which every
NVIDIA driver ships. No `nvidia-smi`, or one that fails (no driver loaded): no GPUs."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

QUERY = ["--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"]
QUERY_TIMEOUT_S = 20


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_gb: float
    """Total memory in GiB (what `gpu_memory_gb` means throughout)."""


def parse(text: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits` output
    (memory in MiB), one GPU per line."""
    found = []
    for line in text.splitlines():
        if not line.strip():
            continue
        index, name, memory = (part.strip() for part in line.split(","))
        found.append(Gpu(int(index), name, round(int(memory) / 1024, 1)))
    return found


def detect() -> list[Gpu]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        done = subprocess.run(
            [smi, *QUERY], capture_output=True, text=True, timeout=QUERY_TIMEOUT_S, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return parse(done.stdout)


def describe(gpus: list[Gpu]) -> str:
    if not gpus:
        return "no GPU found (nvidia-smi): running on CPU"
    names = ", ".join(sorted({g.name for g in gpus}))
    return f"found {len(gpus)} GPU(s): {names}, {min(g.memory_gb for g in gpus):g} GB each"
