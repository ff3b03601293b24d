"""vLLM as an `Engine` (rl/inference/engines.py): its command line (args.py), what it serves,
and whether this machine's (or `inference.vllm_python`'s) interpreter can import it."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from rl.inference.engines import Engine
from rl.inference.vllm.args import VLLM_LORA_RANKS, spanning_args, vllm_args


class Vllm(Engine):
    name = "vllm"
    label = "vLLM"
    spans_nodes = True
    checkpoint_layout = True  # it loads checkpoint-format tensors
    quantizations = ("fp8",)  # FP8 block checkpoints, its CPU build included
    adapters_from_directories = True
    lora_ranks = VLLM_LORA_RANKS

    def server_args(
        self, replica_nodes: int, kv_role: str | None, instance: str, gpu_share: float | None
    ) -> list[str]:
        return vllm_args(self.cfg, replica_nodes, kv_role, instance, gpu_share)

    def node_args(self, replica_nodes: int, rank: int) -> list[str]:
        return spanning_args(self.cfg, replica_nodes, rank)

    def inexact(self) -> list[str]:
        if not self.cfg.cluster.gpus_per_node:
            return []
        return ["inference.backend=vllm on GPUs: vLLM's GPU kernels depend on how it batches "
                "the requests as they arrive"]  # fmt: skip

    def machine_problem(self) -> tuple[str, str] | None:
        if self.cfg.inference.shared:  # the sweep's service checks it once
            return None
        python = self.cfg.inference.vllm_python or sys.executable
        if problem := import_problem(python):
            return (
                f"inference.backend=vllm: {python} cannot import vLLM ({problem})",
                "install vLLM there, name a python that has it (inference.vllm_python=...), "
                "or use inference.backend=embedded",
            )
        return None

    def serve(self, run_dir: Path, name: str, args: Any, log: logging.Logger) -> None:
        from rl.inference.vllm.front import serve, serve_headless

        if not args.rest:
            sys.exit("inference.backend=vllm: no vLLM arguments after '--' (start it from a plan)")
        if args.node:
            serve_headless(self.cfg, run_dir, name, args.node, args.nodes, args.rest, log)
        else:
            serve(self.cfg, run_dir, name, args.rest, log, args.nodes)


def import_problem(python: str) -> str | None:
    """Why `python` cannot import vllm (found without importing it), or None."""
    if not shutil.which(python) and not Path(python).is_file():
        return "no such interpreter"
    find = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        done = subprocess.run([python, "-c", find], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        return f"running it failed: {err}"
    if done.returncode == 1:
        return "No module named 'vllm'"
    if done.returncode:
        last = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return f"it exited with code {done.returncode}: {last[0]}"
    return None
