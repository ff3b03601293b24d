"""A sharded model's whole weights, gathered one block at a time for publishing.

Gathering every weight onto rank 0 before publishing holds the whole model there: ~1.5 TB for
GLM-5 in bf16, beyond a node's memory. Instead, the publishers (rl/weights/) walk the model
block by block (a decoder layer, or one tensor outside the layers: the embedding, the final
norm, the LM head). Each block is gathered by every rank together (a collective on the FSDP
group: each rank's shards go to all), rank 0 keeps it on the host until it is written or sent,
and the next block is gathered only then. Rank 0's peak is one block (plus what a file being
written holds); the other ranks drop each block at once.

Rank 0 may walk the blocks more than once for one version (a broadcast version that is also
written to disk); before each walk it tells the other ranks, which follow until it says it is
done (`follow`). A walk rank 0 leaves early (an error while writing) still gathers the rest of
its blocks, so every rank ends the walk together and the error is raised after.

`meta()` gives every block's names, global shapes and dtypes without gathering anything: what
a broadcast's header announces before the first byte is sent.

A version is published in the model's dtype while the trainer keeps float32 master weights:
each rank casts its own shards before the gather, so the gather moves the published bytes, not
the master's. A LoRA run's version walks only the tensors it holds (`select`): the base for
version 0, the adapter's matrices after, gathered layer by layer like the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rl.core.model import hf_name
from rl.weights.base import BlockSource


def block_of(name: str) -> str:
    """The block a tensor belongs to: its decoder layer (`model.layers.7`), or itself."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


Select = Callable[[dict[str, Any]], dict[str, Any]]
"""Which of a model's state-dict tensors a version holds, under the names it publishes them
by (rl/weights/lora.py's `base_tensors` and `adapter_tensors`)."""


class GatheredBlocks(BlockSource):
    """The weights of a module sharded by FSDP (or one rank's own), block by block, in `dtype`
    where given (floating-point tensors only); every rank of the default group takes part in
    each walk."""

    def __init__(
        self,
        model: torch.nn.Module,
        rank: int,
        dtype: torch.dtype | None = None,
        select: Select | None = None,
    ) -> None:
        self.rank, self.dtype = rank, dtype
        seen: set[int] = set()
        self.groups: list[list[tuple[str, torch.Tensor]]] = []
        last = None
        state = model.state_dict(keep_vars=True)
        # A tensor held under two names (tied embeddings) is walked once, under its first.
        for name, tensor in (select(state) if select is not None else state).items():
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            block = block_of(hf_name(name))
            if block != last:
                self.groups.append([])
                last = block
            self.groups[-1].append((hf_name(name), tensor))

    def meta(self) -> Iterator[dict[str, torch.Tensor]]:
        for group in self.groups:
            yield {
                name: torch.empty(t.shape, dtype=self._dtype(t), device="meta") for name, t in group
            }

    def _dtype(self, tensor: torch.Tensor) -> torch.dtype:
        if self.dtype is not None and tensor.is_floating_point():
            return self.dtype
        return tensor.dtype

    def blocks(self) -> Iterator[dict[str, torch.Tensor]]:
        """Rank 0's walk: each block whole on the host, as every rank gathers it."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 walks the blocks; the others follow()")
        self._signal(1)
        index = 0
        try:
            for index, group in enumerate(self.groups):  # noqa: B007 (read in finally)
                yield self._gather(group, keep=True)
            index = len(self.groups)
        finally:  # left early: the other ranks are gathering the rest
            for group in self.groups[index + 1 : len(self.groups)]:
                self._gather(group, keep=False)

    def done(self) -> None:
        """Rank 0: no more walks for this version."""
        self._signal(0)

    def follow(self) -> None:
        """Every other rank: take part in each walk rank 0 makes, until it is done."""
        while self._signal(None):
            for group in self.groups:
                self._gather(group, keep=False)

    def _signal(self, value: int | None) -> int:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return value or 0
        flag = torch.tensor([value or 0], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.broadcast(flag, src=0)
        return int(flag.item())

    def _gather(self, group: list[tuple[str, torch.Tensor]], keep: bool) -> dict[str, torch.Tensor]:
        out = {}
        nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        for name, tensor in group:
            if isinstance(tensor, DTensor) and nccl and tensor.device.type == "cpu":
                tensor = tensor.to(torch.device("cuda", torch.cuda.current_device()))  # offloaded
            tensor = tensor.detach().to(self._dtype(tensor))  # each rank casts its own shard
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if keep:
                out[name] = whole.detach().to("cpu", copy=whole.device.type != "cpu")
        return out
