"""How a step's batch is split: each trainer rank's share, balanced by tokens, and each share's
micro-batches under the token budget of one forward/backward pass."""

from __future__ import annotations

import heapq

from rl.core.binpack import first_fit_decreasing


def partition(sizes: list[int], world: int) -> list[list[int]]:
    """Each rank's sample indices, ascending, balanced by tokens (`sizes`): longest first to
    the lightest rank, the lowest-numbered one on ties."""
    loads = [(0, r) for r in range(world)]  # a heap of (tokens, rank); sorted is a valid heap
    parts: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(loads)
        parts[rank].append(i)
        heapq.heappush(loads, (load + sizes[i], rank))
    return [sorted(part) for part in parts]


def micro_batches(sizes: list[int], budget: int) -> list[list[int]]:
    """A rank's samples (by their `sizes` in tokens) packed into micro-batches of at most
    `budget` tokens; a sample longer than the budget gets a micro-batch of its own."""
    return first_fit_decreasing(sizes, budget)
