"""The `Engine` interface: what the planner, the checks and the roles ask of an inference
engine, and the registry that picks one, `engine_of` (the one reader of `inference.backend`).

An engine answers for itself: what it serves (replicas spanning nodes, prefill/decode
instances, quantizations, adapters), the command line of a replica's processes, what makes
its answers depend on more than the config, what this machine must have to run it, the layout
it takes broadcast weights in, and how its server starts. Every server mounts the same admin
routes (rl/inference/admin.py). The embedded engine is here; each other engine is a folder of
rl/inference/ (`vllm/`) with its class, registered in `ENGINES` by name and imported when
first asked for. This module imports neither engine's code, so that the planner may read it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

from rl.envs import load_callable


class Engine:
    """An inference engine for one run (`cfg`); the defaults are the embedded engine's."""

    name: ClassVar[str]
    label: ClassVar[str]
    """How messages name it."""
    spans_nodes: ClassVar[bool] = False
    """Whether a replica may span nodes, or split into prefill and decode instances."""
    checkpoint_layout: ClassVar[bool] = False
    """Whether it takes broadcast weights in the checkpoint's names and layout (else in the
    trainer module's own)."""
    quantizations: ClassVar[tuple[str, ...]] = ()
    """The weight quantizations it serves (`model.inference.quantization`)."""
    bounded_batch: ClassVar[bool] = False
    """Whether it runs at most `inference.max_batch_size` sequences at once (a prompt's
    group must then fit in one batch)."""
    adapters_from_directories: ClassVar[bool] = False
    """Whether it loads LoRA adapters only from their directories (not by broadcast)."""
    lora_ranks: ClassVar[tuple[int, ...] | None] = None
    """The adapter ranks it serves (None: any)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def server_args(
        self, replica_nodes: int, kv_role: str | None, instance: str, gpu_share: float | None
    ) -> list[str]:
        """The engine's own arguments for a replica's (or prefill/decode `instance`'s) server,
        after the role's `--`; `gpu_share`: the share of a GPU the plan leaves it beside the
        trainer (None: the model's `gpu_memory_utilization`)."""
        return []

    def node_args(self, replica_nodes: int, rank: int) -> list[str]:
        """What the process on a spanning replica's `rank`-th node adds to `server_args`."""
        return []

    def inexact(self) -> list[str]:
        """What makes its answers depend on more than the config and the seed."""
        return []

    def machine_problem(self) -> tuple[str, str] | None:
        """What this machine lacks to run it and how to fix that, or None."""
        return None

    def serve(self, run_dir: Path, name: str, args: Any, log: logging.Logger) -> None:
        """Run the server of the replica (instance, node) that `args` names until it is
        stopped (rl/inference/__main__.py)."""
        raise NotImplementedError


class Embedded(Engine):
    """Relay's own engine (rl/inference/engine.py): continuous batching in one process, on CPU
    or one GPU, bit-reproducible."""

    name = "embedded"
    label = "the embedded engine"
    bounded_batch = True

    def serve(self, run_dir: Path, name: str, args: Any, log: logging.Logger) -> None:
        from rl.inference.server import serve

        serve(self.cfg, run_dir, name, log)


ENGINES: dict[str, str | type[Engine]] = {
    "embedded": Embedded,
    "vllm": "rl.inference.vllm.engine:Vllm",
}
"""Every engine by `inference.backend`: its class, or where to import it from."""


def engine_name(cfg: Any) -> str:
    """`inference.backend`, or vLLM where the cluster has GPUs and the embedded engine on
    CPU."""
    if cfg.inference.backend is not None:
        return str(cfg.inference.backend)
    return "vllm" if cfg.cluster.gpus_per_node else "embedded"


def engine_of(cfg: Any) -> Engine:
    """The engine that serves this run; ValueError for a name no engine is registered by."""
    name = engine_name(cfg)
    if name not in ENGINES:
        raise ValueError(
            f"inference.backend={name}: no such engine; known: {', '.join(sorted(ENGINES))}"
        )
    found = ENGINES[name]
    if isinstance(found, str):  # imported once, when first asked for
        found = ENGINES[name] = load_callable(found, f"inference.backend={name}")
    return found(cfg)
