"""dataset: prompts and answers from a file, rewards from plain Python functions (what TRL's
`reward_funcs` and `reward_weights` are), with no environment class to write.

Settings (`environment.args`):
- `path`: a JSONL file (one JSON object a line), a Parquet file, or a folder that Hugging Face
  `datasets`' `save_to_disk` wrote (Parquet needs `pyarrow`, a saved folder `datasets`).
- `prompt_field`, `answer_field`: the row's fields read as prompt and answer (`prompt`,
  `answer`); the rest of the row is the example's `info`, passed to the reward functions.
- `rewards`: reward functions, each `package.module:function` or `path/to/file.py:function`,
  called as `function(prompt=..., completion=..., answer=..., **other_fields)` and returning a
  number in [0, 1]; none given: 1.0 when the completion (stripped) is the answer.
- `reward_weights`: one non-negative weight per function (default 1 each); the reward is the
  weighted mean, so it stays in [0, 1]. Each function's value is logged too (`env/<name>`).

The rows are shuffled with `environment.seed`; the first `environment.eval_size` are held out
for evaluation. Exact match: the stripped completion equals the answer.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl.envs import Environment, Example, check_args, load_callable


@dataclass(frozen=True)
class DatasetArgs:
    path: str = ""
    """JSONL or Parquet file, or a `datasets` save_to_disk folder."""
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    rewards: list[str] = field(default_factory=list)
    """Reward functions, `module:function` or `file.py:function`."""
    reward_weights: list[float] = field(default_factory=list)
    """One weight per reward function; empty: 1 each."""


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of a JSONL or Parquet file or a saved `datasets` folder, as dicts."""
    if path.is_dir():
        try:
            from datasets import load_from_disk
        except ImportError:
            raise ValueError(
                f"environment.args.path={path}: a saved datasets folder needs the `datasets` "
                "package (uv pip install datasets)"
            ) from None
        data = load_from_disk(str(path))
        if hasattr(data, "keys"):  # a DatasetDict: its train split, else its first
            data = data["train"] if "train" in data else data[next(iter(data.keys()))]
        return [dict(row) for row in data]
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(
                f"environment.args.path={path}: Parquet needs the `pyarrow` package "
                "(uv pip install pyarrow)"
            ) from None
        return pq.read_table(path).to_pylist()
    rows = []
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"environment.args.path={path}: line {number}: {err}") from None
            if not isinstance(row, dict):
                raise ValueError(f"environment.args.path={path}: line {number} is not an object")
            rows.append(row)
    return rows


def exact(prompt: str, completion: str, answer: str, **_: Any) -> float:
    """The default reward: 1.0 when the completion, stripped, is the answer."""
    return float(completion.strip() == answer)


class Dataset(Environment):
    name = "dataset"

    def __init__(self, env_cfg: Any) -> None:
        args = check_args(dict(env_cfg.args), DatasetArgs())
        if not args.path:
            raise ValueError("environment.args.path: required (a JSONL or Parquet file)")
        path = Path(args.path).expanduser()
        if not path.exists():
            raise ValueError(f"environment.args.path={args.path}: no such file or folder")
        self.rewards = [
            load_callable(spec, "environment.args.rewards") for spec in args.rewards
        ] or [exact]
        weights = [float(w) for w in args.reward_weights] or [1.0] * len(self.rewards)
        if len(weights) != len(self.rewards) or min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(
                f"environment.args.reward_weights={list(args.reward_weights)}: one non-negative "
                f"weight per reward function ({len(self.rewards)}), not all zero"
            )
        self.weights = [w / sum(weights) for w in weights]
        self.names = [getattr(f, "__name__", f"reward_{i}") for i, f in enumerate(self.rewards)]
        self.args = args
        examples = [self.example(row, path, i) for i, row in enumerate(read_rows(path), 1)]
        if len(examples) <= env_cfg.eval_size:
            raise ValueError(
                f"environment.args.path={args.path}: {len(examples)} rows, not more than "
                f"environment.eval_size={env_cfg.eval_size} held out; lower eval_size"
            )
        random.Random(env_cfg.seed).shuffle(examples)
        self._eval, self._train = examples[: env_cfg.eval_size], examples[env_cfg.eval_size :]

    def example(self, row: dict[str, Any], path: Path, number: int) -> Example:
        """Row `number` of `path` as an example; a ValueError naming a field it lacks."""
        prompt, answer = self.args.prompt_field, self.args.answer_field
        for key, name in (("prompt_field", prompt), ("answer_field", answer)):
            if name not in row:
                raise ValueError(
                    f"environment.args.path={path}: row {number} has no field {name!r} "
                    f"(environment.args.{key}); its fields: {', '.join(map(str, row))}"
                )
        info = {k: v for k, v in row.items() if k not in (prompt, answer)}
        return Example(str(row[prompt]), str(row[answer]), info)

    def train_examples(self) -> list[Example]:
        return self._train

    def eval_examples(self) -> list[Example]:
        return self._eval

    def values(self, example: Example, completion: str) -> list[float]:
        """Each reward function's value for `completion`, checked to lie in [0, 1]."""
        said = []
        for name, function in zip(self.names, self.rewards, strict=True):
            value = function(prompt=example.prompt, completion=completion, answer=example.answer,
                             **example.info)  # fmt: skip
            if not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
                raise ValueError(
                    f"environment.args.rewards: {name} returned {value!r}, not a number in "
                    f"[0, 1], for the prompt {example.prompt[:80]!r}"
                )
            said.append(float(value))
        return said

    def reward(self, example: Example, completion: str) -> float:
        values = self.values(example, completion)
        return sum(w * v for w, v in zip(self.weights, values, strict=True))

    def exact_match(self, example: Example, completion: str) -> bool:
        return completion.strip() == example.answer

    def metrics(self, example: Example, completion: str) -> dict[str, float]:
        return dict(zip(self.names, self.values(example, completion), strict=True))
