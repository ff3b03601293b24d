"""GPUs: the figures the planner sizes and times a run with, per kind of GPU (`SPECS`), and
this machine's GPUs, found without importing torch: `nvidia-smi`'s CSV query, which every
NVIDIA driver ships. No `nvidia-smi`, or one that fails (no driver loaded): no GPUs.

A kind's memory is what `nvidia-smi` reports as `memory.total` (the card's real capacity: an
"80 GB" H100 shows 81559 MiB, 79.6 GiB), its TFLOP/s the dense bf16 tensor-core peak of its
datasheet, its bandwidth the HBM's, and its network the NIC bandwidth per GPU its clusters are
usually built with (a site with another fabric sets `cluster.link_gbs`).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from rl.core.config import Gpu


@dataclass(frozen=True)
class GpuSpec:
    """What the planner knows of a kind of GPU."""

    memory_gb: float
    """Total memory in GiB, as `nvidia-smi` reports it."""
    tflops: float
    """Dense bf16 tensor-core peak, TFLOP/s."""
    bandwidth_gbs: float
    """Memory (HBM or GDDR) bandwidth, GB/s."""
    link_gbs: float
    """Network bandwidth per GPU between nodes, GB/s."""
    names: tuple[str, ...]
    """What `nvidia-smi` names it (a part of the name that no other kind's holds)."""


SPECS: dict[Gpu, GpuSpec] = {
    # 81559 MiB; 400 Gb/s ConnectX-7 per GPU.
    Gpu.h100: GpuSpec(79.6, 989.0, 3350.0, 50.0, ("H100",)),
    # 143771 MiB; HBM3e at 4.8 TB/s, the H100's compute.
    Gpu.h200: GpuSpec(140.4, 989.0, 4800.0, 50.0, ("H200",)),
    # 183359 MiB; 2.25 PFLOP/s dense bf16, 8 TB/s.
    Gpu.b200: GpuSpec(179.1, 2250.0, 8000.0, 50.0, ("B200",)),
    # 81920 MiB; 200 Gb/s HDR per GPU.
    Gpu.a100: GpuSpec(80.0, 312.0, 2039.0, 25.0, ("A100-SXM4-80GB", "A100 80GB")),
    Gpu.a100_40gb: GpuSpec(40.0, 312.0, 1555.0, 25.0, ("A100-SXM4-40GB", "A100-PCIE-40GB")),
    # 46068 MiB; 362 TFLOP/s dense bf16, GDDR6 at 864 GB/s.
    Gpu.l40s: GpuSpec(45.0, 362.0, 864.0, 25.0, ("L40S",)),
    # 24564 MiB; 165 TFLOP/s dense bf16 with float32 accumulation; 100 Gb/s Ethernet.
    Gpu.rtx4090: GpuSpec(24.0, 165.0, 1008.0, 12.5, ("4090",)),
}


def kind_of(name: str) -> Gpu | None:
    """The kind an `nvidia-smi` name is (`NVIDIA H100 80GB HBM3` -> h100), or None."""
    for kind, spec in SPECS.items():
        if any(part in name for part in spec.names):
            return kind
    return None


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
