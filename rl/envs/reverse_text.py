"""reverse_text, the smoke test: reverse a short English word, character by character.

Words come from the `english-words` package (web2 list, shipped on disk: no download), split
into train and held-out eval words by a seeded shuffle. The reward gives partial credit: the
longest common subsequence of completion and answer over the longer length (exact = 1.0).
Settings (`environment.args`): `min_len`, `max_len` (word lengths, inclusive).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from rl.envs import Environment, Example, check_args


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence (O(len(a) * len(b)) dynamic programme)."""
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def lcs_ratio(completion: str, answer: str) -> float:
    longest = max(len(completion), len(answer))
    return lcs_length(completion, answer) / longest if longest else 1.0


def prompt_for(word: str) -> str:
    return f"reverse: {word}\n"


@dataclass(frozen=True)
class ReverseTextArgs:
    min_len: int = 3
    """Shortest word, in characters."""
    max_len: int = 6
    """Longest word, in characters."""


def parse_args(args: dict[str, Any]) -> ReverseTextArgs:
    return check_args(args, ReverseTextArgs())


class ReverseText(Environment):
    name = "reverse_text"

    def __init__(self, env_cfg: Any) -> None:
        from english_words import get_english_words_set

        parsed = parse_args(dict(env_cfg.args))
        lo, hi = parsed.min_len, parsed.max_len
        if not 1 <= lo <= hi:
            raise ValueError(f"environment.args: need 1 <= min_len <= max_len, got {lo}, {hi}")
        words = sorted(
            w for w in get_english_words_set(["web2"], lower=True, alpha=True) if lo <= len(w) <= hi
        )
        random.Random(env_cfg.seed).shuffle(words)
        examples = [Example(prompt_for(w), w[::-1]) for w in words]
        self._eval = examples[: env_cfg.eval_size]
        self._train = examples[env_cfg.eval_size :]

    def train_examples(self) -> list[Example]:
        return self._train

    def eval_examples(self) -> list[Example]:
        return self._eval

    def reward(self, example: Example, completion: str) -> float:
        return lcs_ratio(completion.strip(), example.answer)

    def exact_match(self, example: Example, completion: str) -> bool:
        return completion.strip() == example.answer
