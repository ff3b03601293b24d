"""Environments: prompts, the answer each is scored against, and the reward.

An environment is small enough to read on one screen; `make_environment(cfg.environment)`
picks one from the registry the `environment` config group selects from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Example:
    """One task instance: the prompt text and what a perfect completion says."""

    prompt: str
    answer: str


class Environment(Protocol):
    name: str

    def train_examples(self) -> list[Example]: ...

    def eval_examples(self) -> list[Example]: ...

    def reward(self, example: Example, completion: str) -> float: ...

    def exact_match(self, example: Example, completion: str) -> bool: ...


def make_environment(env_cfg: Any) -> Environment:
    from rl.envs.reverse_text import ReverseText

    registry = {"reverse_text": ReverseText}
    if env_cfg.name not in registry:
        raise ValueError(f"environment.name={env_cfg.name}: valid: {', '.join(registry)}")
    return registry[env_cfg.name](env_cfg)
