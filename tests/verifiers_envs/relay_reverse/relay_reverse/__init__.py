"""relay_reverse: a tiny verifiers 0.4.0 environment for Relay's tests (reverse a short word).

A verifiers 0.4.0 environment is a Python package that exports its `vf.Taskset` subclass through
`__all__`; `environment.args.id=relay_reverse` finds it by import name. Install it as a user
would:

    uv pip install -e tests/verifiers_envs/relay_reverse

or, without installing, put `tests/verifiers_envs/relay_reverse` on `sys.path` / `PYTHONPATH`
(what Relay's tests do, so that they leave the shared virtual environment untouched). The same
distribution ships `relay_reverse_retry`, the multi-turn variant.

Words are pseudo-words of two or three consonant-vowel syllables ("bako", "mitesu"): only
lowercase letters, which Relay's character tokenizer covers, and thousands of them without a
word list. Rewards, summed with their weights as verifiers does: `exact` (weight 0.5) is 1.0 for
the reversed word, `similarity` (weight 0.5) is the longest common subsequence of completion and
answer over the longer length, so the exact answer scores 1.0 and a near miss part of it.
"""

from __future__ import annotations

import itertools
import random

import verifiers.v1 as vf

# Relay's own partial-credit measure (this example package lives in Relay's tests).
from rl.envs.reverse_text import lcs_ratio

__all__ = ["ReverseTaskset"]

SYLLABLES = [c + v for c in "bdgklmnprst" for v in "aeiou"]


def words(count: int, seed: int) -> list[str]:
    """`count` distinct pseudo-words of 2 or 3 syllables, in a seeded order."""
    pool = ["".join(p) for n in (2, 3) for p in itertools.product(SYLLABLES, repeat=n)]
    random.Random(seed).shuffle(pool)
    return pool[:count]


class ReverseData(vf.TaskData):
    answer: str
    """The word reversed, character by character."""


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=0.5)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.5)
    async def similarity(self, trace: vf.Trace) -> float:
        return lcs_ratio(trace.last_reply, self.data.answer)


class ReverseConfig(vf.TasksetConfig):
    num_tasks: int = 2000
    """How many words to build."""
    seed: int = 0
    """Seed of the word order."""


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self) -> list[ReverseTask]:
        return [
            ReverseTask(
                ReverseData(name=word, prompt=f"reverse: {word}\n", answer=word[::-1]),
                self.config.task,
            )
            for word in words(self.config.num_tasks, self.config.seed)
        ]
