"""wordle, a multi-turn game: find a hidden 5-letter word in up to six guesses.

After each guess the environment answers with one letter per position: `g` (right letter, right
place), `y` (in the word elsewhere), `x` (not in the word, or no more of it), as in the game,
repeated letters included. The transcript is plain lowercase text, so any tokenizer (even the
tiny model's characters) can read it:

    wordle: find the 5-letter word. feedback per letter: g right place, y elsewhere, x absent.
    guess 1: crane
    feedback: xgyxx
    guess 2: ...

The model's guess is the first word of its turn. Words: the 2,315 answers shipped with the
`reasoning-gym` package, split into train and held-out eval words by a seeded shuffle.
Reward: 1.0 for a solved game; otherwise `partial_credit` x the best guess's (2 x greens +
yellows) / 10. Exact match: solved.

Settings (`environment.args`): `max_turns` (guesses per game), `partial_credit`, `any_guess`
(accept any five letters, not only words of the list).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from rl.envs import Environment, Example, check_args

INTRO = (
    "wordle: find the 5-letter word. feedback per letter: g right place, y elsewhere, x absent.\n"
)


@dataclass(frozen=True)
class WordleArgs:
    max_turns: int = 6
    """Guesses per game."""
    partial_credit: float = 0.5
    """Reward weight of the best unsolved guess's letter score."""
    any_guess: bool = True
    """Accept any five letters as a guess, not only words of the list."""


def feedback(guess: str, secret: str) -> str:
    """One of g/y/x per position; a repeated letter is marked y only as often as the secret
    has it unmatched."""
    marks = ["x"] * 5
    left = Counter(s for g, s in zip(guess, secret, strict=True) if g != s)
    for i, (g, s) in enumerate(zip(guess, secret, strict=True)):
        if g == s:
            marks[i] = "g"
        elif left[g] > 0:
            marks[i] = "y"
            left[g] -= 1
    return "".join(marks)


def parse_guess(turn: str) -> str:
    """The first word of a model turn, lowercased ('' when there is none)."""
    match = re.search(r"[a-zA-Z]+", turn)
    return match.group(0).lower() if match else ""


def letter_score(marks: str) -> float:
    return (2 * marks.count("g") + marks.count("y")) / 10


class Wordle(Environment):
    name = "wordle"

    def __init__(self, env_cfg: Any) -> None:
        from reasoning_gym.data.wordle_words import wordle_words

        self.args = check_args(dict(env_cfg.args), WordleArgs())
        if self.args.max_turns < 1:
            raise ValueError(f"environment.args.max_turns={self.args.max_turns}: need >= 1")
        if not 0 <= self.args.partial_credit <= 1:  # rewards stay in the declared 0..1
            raise ValueError(
                f"environment.args.partial_credit={self.args.partial_credit}: need 0..1"
            )
        self.max_turns = self.args.max_turns
        self.words = frozenset(wordle_words)
        words = sorted(self.words)
        random.Random(env_cfg.seed).shuffle(words)
        examples = [Example(self.prompt(), w) for w in words]
        self._eval = examples[: env_cfg.eval_size]
        self._train = examples[env_cfg.eval_size :]

    def prompt(self) -> str:
        return INTRO + "guess 1:"

    def train_examples(self) -> list[Example]:
        return self._train

    def eval_examples(self) -> list[Example]:
        return self._eval

    def valid(self, guess: str) -> bool:
        if len(guess) != 5:
            return False
        return self.args.any_guess or guess in self.words

    def respond(self, example: Example, turns: list[str]) -> str | None:
        guess = parse_guess(turns[-1])
        if guess == example.answer or len(turns) >= self.max_turns:
            return None
        if not self.valid(guess):
            reply = "feedback: not a valid guess; answer with one 5-letter word"
        else:
            reply = f"feedback: {feedback(guess, example.answer)}"
        return f"\n{reply}\nguess {len(turns) + 1}:"

    def reward(self, example: Example, completion: list[str]) -> float:
        guesses = [parse_guess(t) for t in completion]
        if example.answer in guesses:
            return 1.0
        scores = [letter_score(feedback(g, example.answer)) for g in guesses if self.valid(g)]
        return self.args.partial_credit * max(scores, default=0.0)

    def exact_match(self, example: Example, completion: list[str]) -> bool:
        return example.answer in (parse_guess(t) for t in completion)
