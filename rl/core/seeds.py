"""Every random draw of a run, as a function of its config.

A sample's randomness comes from a seed derived from the run's `seed` and where the sample is:
its batch (step), the batch's fill round, its prompt's place in the round, and for multi-turn
episodes the turn. Inference servers draw each prompt's samples from a generator of that
prompt's own (Relay's `seeds` extension of the completions API), so a sample is the same
whatever requests, servers or batches it shares with others.
"""

from __future__ import annotations

import hashlib

MAX_SEED = 2**63 - 1


def derived(seed: int, *where: int | str) -> int:
    """A seed in 0..2**63-1 for `where`, independent of every other `where` of the same run."""
    digest = hashlib.sha256(repr((int(seed), *where)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & MAX_SEED


def prompt_seeds(seed: int, count: int, *where: int | str) -> list[int]:
    """One seed per prompt of a request made at `where` (e.g. `"train", step, round`)."""
    return [derived(seed, *where, k) for k in range(count)]
