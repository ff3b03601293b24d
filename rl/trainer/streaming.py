"""A sharded model's whole weights, gathered one block at a time for publishing.

Gathering every weight onto rank 0 before publishing holds the whole model there: ~1.5 TB for
GLM-5 in bf16, beyond a node's memory. Instead, the publishers (rl/weights/) walk the model
block by block (a decoder layer, or one tensor outside the layers: the embedding, the final
norm, the LM head). Each block is gathered by every rank together (a collective on the FSDP
group), rank 0 keeps it until it is written or sent, and the next block is gathered only
then. Rank 0's peak is one block (plus what a file being
written holds). An FSDP shard goes to rank 0 alone (`to_rank_0`): the other ranks send their
rows and receive nothing, so a version costs each of them its own shard's bytes however large
the world, not the whole model.

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
from torch.distributed.tensor import DTensor, Shard

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

    def blocks(
        self, transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None, host: bool = True
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Rank 0's walk: each block whole, as every rank gathers it, transformed where it was
        gathered, then on the host (or left there: `host=False`)."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 walks the blocks; the others follow()")
        self._signal(1)
        index = 0
        try:
            for index, group in enumerate(self.groups):  # noqa: B007 (read in finally)
                block = self._gather(group, keep=True)
                if transform is not None:
                    block = transform(block)
                yield {name: _on_host(t) for name, t in block.items()} if host else block
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
            whole = to_rank_0(tensor)
            if keep:
                out[name] = whole
        return out


def to_rank_0(tensor: torch.Tensor) -> torch.Tensor | None:
    """The whole of a (possibly sharded) tensor on rank 0 (None elsewhere). An FSDP shard
    (rows split over one mesh dimension, replicated over any other) is gathered to rank 0
    alone: the others send their rows and receive nothing, and replicas other than rank 0's
    take no part. Any other layout (experts under EP) is all-gathered."""
    if not isinstance(tensor, DTensor):
        return tensor
    mesh, placements = tensor.device_mesh, tensor.placements
    sharded = [d for d, p in enumerate(placements) if not p.is_replicate()]
    if len(sharded) != 1 or type(placements[sharded[0]]) is not Shard:
        whole = tensor.full_tensor()
        return whole if dist.get_rank() == 0 else None
    if placements[sharded[0]].dim != 0:
        whole = tensor.full_tensor()
        return whole if dist.get_rank() == 0 else None
    dim = sharded[0]
    coordinate = mesh.get_coordinate()
    if coordinate is None or any(c for d, c in enumerate(coordinate) if d != dim):
        return None  # another replica: rank 0's replica sends its rows
    group, size = mesh.get_group(dim), mesh.size(dim)
    rows = tensor.shape[0]
    chunk = -(-rows // size)  # FSDP's (and torch.chunk's) split: ceil, the last ones short
    local = tensor.to_local()
    padded = local.new_zeros((chunk, *local.shape[1:]))
    padded[: local.shape[0]] = local
    root = dist.get_global_rank(group, 0)
    parts = [torch.empty_like(padded) for _ in range(size)] if dist.get_rank() == root else None
    dist.gather(padded, parts, dst=root, group=group)
    if parts is None:
        return None
    return torch.cat(parts)[:rows]


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("cpu", copy=tensor.device.type != "cpu")
