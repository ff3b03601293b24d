"""Reasoning tasks from reasoning-gym: arithmetic, GSM8K-style word problems and countdown.

reasoning-gym (Apache-2.0) generates every task offline from a seed and checks answers with its
own scorer, so these environments download nothing. Each split comes from its own seeded
stream: eval, train and the few-shot examples. Train and the shots drop any question that is
also in eval, and train drops the shots, so no prompt shows or trains on a held-out answer.

A prompt is plain "Q: ...\\nA:" text a small base or instruct model can follow. With
`few_shot: k` it starts with k solved examples ("Q: 3 + 4 = ?\\nA: 7\\n"), so the completion is
just the answer. The answer is read from the completion's first line (`prompt_style: plain`) or
from its last <answer>...</answer> tag (`tagged`, for models that reason first: the question
ends with an instruction to use the tags). reasoning-gym's scorer judges it; exact match means
a reward of 1.

Settings (`environment.args`), shared: `train_size` (train questions generated), `few_shot`
(solved examples before each question), `prompt_style` (`plain` or `tagged`).
- arithmetic (`basic_arithmetic`): `min_terms`, `max_terms` (numbers per expression),
  `min_digits`, `max_digits` (digits per number), `operators` (a string drawn from "+-*/"; "/"
  divides exactly). The first number on the answer line is scored; reasoning-gym gives partial
  credit len(true)/len(given) when the true answer is a substring of a wrong one ("17" for 7).
- gsm8k (`gsm_symbolic`): templated grade-school word problems; the scorer reads the first
  number of the answer and gives a wrong one 0.01.
- countdown (`countdown`): `min_numbers`, `max_numbers`, `min_value`, `max_value`,
  `min_target`, `max_target`: make the target from the numbers with + - * /, each used once.
  The answer is an expression (anything from "=" on is dropped); 1.0 when it uses exactly the
  given numbers and hits the target, 0.05 when it does not, 0.01 when there is no expression.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

from rl.envs import Environment, Example, check_args

PROMPT_STYLES = ("plain", "tagged")
TAG_INSTRUCTION = "Think step by step, then give the final answer inside <answer></answer> tags."
SPLIT_STRIDE = 10**9
"""reasoning-gym seeds item i with `seed + i`: split seeds this far apart share no item."""
SPLIT_OFFSET = {"eval": 0, "train": 1, "shots": 2}
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
EXPRESSION = re.compile(r"[\d\s+\-*/().]+")


@dataclass(frozen=True)
class ReasoningArgs:
    train_size: int = 5000
    """Train questions generated (fewer remain when some repeat an eval question or a shot)."""
    few_shot: int = 0
    """Solved examples before each question, from a stream of their own (never eval)."""
    prompt_style: str = "plain"
    """`plain`: the answer is the completion's first line; `tagged`: its last <answer> tag."""


def first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0].strip()


class ReasoningGymEnvironment(Environment):
    """One reasoning-gym dataset as a single-turn environment; subclasses phrase and read it."""

    dataset: ClassVar[str]
    """reasoning-gym's name for the dataset."""
    Args: ClassVar[type[ReasoningArgs]] = ReasoningArgs

    def __init__(self, env_cfg: Any) -> None:
        self.args = check_args(dict(env_cfg.args), self.Args())
        self.check()
        self.seed = env_cfg.seed
        self.scorer = self.make_dataset("eval", max(env_cfg.eval_size, 1))  # checks the config
        eval_entries = self.generate(self.scorer, env_cfg.eval_size)
        held_out = {self.question(e) for e in eval_entries}
        self.prefix = ""
        self.shots = self.pick_shots(held_out)
        self.prefix = "".join(f"{e.prompt}{e.answer}\n" for e in self.shots)
        self._eval = [self.example(e) for e in eval_entries]
        self._seen = held_out | {self.question(e.info["entry"]) for e in self.shots}

    # What a subclass says about its task.

    def check(self) -> None:
        """A ValueError naming the first setting out of range."""
        args = self.args
        if args.train_size < 1:
            raise ValueError(f"environment.args.train_size={args.train_size}: need >= 1")
        if args.few_shot < 0:
            raise ValueError(f"environment.args.few_shot={args.few_shot}: need >= 0")
        if args.prompt_style not in PROMPT_STYLES:
            raise ValueError(
                f"environment.args.prompt_style={args.prompt_style!r}: "
                f"valid: {', '.join(PROMPT_STYLES)}"
            )

    def dataset_config(self) -> dict[str, Any]:
        """reasoning-gym's config for the dataset, from the settings."""
        return {}

    def question(self, entry: dict[str, Any]) -> str:
        """The question, short and in words a small model has seen ("3 + 4 = ?")."""
        raise NotImplementedError

    def parse(self, text: str) -> str | None:
        """The answer the scorer sees, from the answer line or tag."""
        return text

    # The environment.

    def make_dataset(self, split: str, size: int) -> Any:
        import reasoning_gym

        seed = SPLIT_OFFSET[split] * SPLIT_STRIDE + self.seed
        try:
            return reasoning_gym.create_dataset(
                self.dataset, seed=seed, size=size, **self.dataset_config()
            )
        except AssertionError as err:  # reasoning-gym validates its configs with asserts
            raise ValueError(f"environment.args: {err}") from err

    def generate(self, dataset: Any, size: int) -> list[dict[str, Any]]:
        try:
            return [dataset[i] for i in range(size)]
        except ValueError as err:  # e.g. countdown found no expression within the ranges
            raise ValueError(f"environment.args ({self.name}): {err}") from err

    def pick_shots(self, held_out: set[str]) -> list[Example]:
        k = self.args.few_shot
        if k == 0:
            return []
        shots: dict[str, Example] = {}
        size = 4 * k + 16
        for entry in self.generate(self.make_dataset("shots", size), size):
            question = self.question(entry)
            if question not in held_out and question not in shots:
                shots[question] = self.example(entry)
        if len(shots) < k:
            raise ValueError(
                f"environment.args.few_shot={k}: only {len(shots)} distinct questions "
                "outside eval; widen the task's ranges"
            )
        return list(shots.values())[:k]

    def example(self, entry: dict[str, Any]) -> Example:
        """The prompt (after the shots) and what a perfect completion says."""
        question, answer = self.question(entry), entry["answer"]
        if self.args.prompt_style == "tagged":
            question, answer = f"{question}\n{TAG_INSTRUCTION}", f"<answer>{answer}</answer>"
        return Example(f"{self.prefix}Q: {question}\nA:", f" {answer}", {"entry": entry})

    @cached_property
    def _train(self) -> list[Example]:
        # Built on first use: countdown takes tens of milliseconds per question.
        size = self.args.train_size
        entries = self.generate(self.make_dataset("train", size), size)
        return [self.example(e) for e in entries if self.question(e) not in self._seen]

    def train_examples(self) -> list[Example]:
        return self._train

    def eval_examples(self) -> list[Example]:
        return self._eval

    def extract(self, completion: str) -> str | None:
        """The answer the scorer sees: None when the completion gives none."""
        if self.args.prompt_style == "tagged":
            from reasoning_gym.utils import extract_answer

            text = extract_answer(completion)
        else:
            text = first_line(completion)
        return None if text is None else self.parse(text)

    def reward(self, example: Example, completion: str) -> float:
        return float(self.scorer.score_answer(self.extract(completion), example.info["entry"]))

    def exact_match(self, example: Example, completion: str) -> bool:
        return self.reward(example, completion) == 1.0


@dataclass(frozen=True)
class ArithmeticArgs(ReasoningArgs):
    min_terms: int = 2
    """Fewest numbers in an expression."""
    max_terms: int = 2
    """Most numbers in an expression."""
    min_digits: int = 1
    """Fewest digits per number."""
    max_digits: int = 2
    """Most digits per number."""
    operators: str = "+-"
    """Operators to draw from, a string over "+-*/"."""


class Arithmetic(ReasoningGymEnvironment):
    name = "arithmetic"
    dataset = "basic_arithmetic"
    Args = ArithmeticArgs

    def check(self) -> None:
        super().check()
        ops = self.args.operators
        if not ops or set(ops) - set("+-*/"):
            raise ValueError(f"environment.args.operators={ops!r}: need a string over '+-*/'")

    def dataset_config(self) -> dict[str, Any]:
        a = self.args
        return {
            "min_terms": a.min_terms,
            "max_terms": a.max_terms,
            "min_digits": a.min_digits,
            "max_digits": a.max_digits,
            "operators": tuple(dict.fromkeys(a.operators)),
            "allow_parentheses": False,
            "allow_negation": False,
        }

    def question(self, entry: dict[str, Any]) -> str:
        return f"{entry['metadata']['expression']} = ?"

    def parse(self, text: str) -> str | None:
        number = NUMBER.search(text)
        return number.group(0) if number else None


class GSM8K(ReasoningGymEnvironment):
    name = "gsm8k"
    dataset = "gsm_symbolic"
    INSTRUCTION = " Give the result as your final answer. Do not include units."
    """What reasoning-gym appends to every question; "A:" (or the tag instruction) says it."""

    def question(self, entry: dict[str, Any]) -> str:
        return entry["question"].removesuffix(self.INSTRUCTION)


@dataclass(frozen=True)
class CountdownArgs(ReasoningArgs):
    min_numbers: int = 3
    """Fewest numbers given."""
    max_numbers: int = 4
    """Most numbers given."""
    min_value: int = 1
    """Smallest number."""
    max_value: int = 100
    """Largest number."""
    min_target: int = 100
    """Smallest target."""
    max_target: int = 999
    """Largest target."""


class Countdown(ReasoningGymEnvironment):
    name = "countdown"
    dataset = "countdown"
    Args = CountdownArgs

    def dataset_config(self) -> dict[str, Any]:
        a = self.args
        return {
            "min_numbers": a.min_numbers,
            "max_numbers": a.max_numbers,
            "min_value": a.min_value,
            "max_value": a.max_value,
            "min_target": a.min_target,
            "max_target": a.max_target,
        }

    def question(self, entry: dict[str, Any]) -> str:
        numbers = ", ".join(map(str, entry["metadata"]["numbers"]))
        target = entry["metadata"]["target"]
        return f"Make {target} from {numbers} with + - * /, using each number once."

    def parse(self, text: str) -> str | None:
        expression = text.split("=", 1)[0].strip()
        # The scorer hands the answer to sympy's parse_expr, which evaluates Python: let only
        # arithmetic through (no "**", whose towers never finish).
        if not EXPRESSION.fullmatch(expression) or "**" in expression:
            return None
        return expression
