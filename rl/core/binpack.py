"""The one packer: items of given sizes into bins of a capacity, first fit, largest first.

The queue packs a rank's samples into micro-batches under `trainer.micro_batch_tokens`, and the
trainer packs a micro-batch's samples into rows as long as its longest; both are this.
"""

from __future__ import annotations


def first_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Indices of `sizes` in bins of at most `capacity` (an item larger than that gets a bin of
    its own): each item, largest first (the lower index on ties), goes into the first bin it
    fits. Each bin's indices ascend."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        for b, free in enumerate(room):
            if sizes[i] <= free:
                bins[b].append(i)
                room[b] -= sizes[i]
                break
        else:
            bins.append([i])
            room.append(capacity - sizes[i])
    return [sorted(members) for members in bins]
