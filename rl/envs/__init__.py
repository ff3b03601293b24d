"""Environments: prompts, the answer each is scored against, the rollout and the reward.

An environment is small enough to read on one screen. A single-turn environment scores one
completion; a multi-turn one (`max_turns > 1`) also answers each model turn with a message of
its own (`respond`) until it returns None, and scores the model's turns together. The
orchestrator drives both through the same inference client; in multi-turn samples only the
model's own tokens carry loss, the environment's messages are masked.

`make_environment(cfg.environment)` picks one from the registry the `environment` config
group selects from; modules are imported on demand, so one environment's dependencies never
slow down another's start.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Example:
    """One task instance: the prompt text, what a perfect completion says, and anything else
    the reward needs (`info`, environment-specific)."""

    prompt: str
    answer: str
    info: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


class Environment(Protocol):
    name: str
    max_turns: int
    """Model turns per episode: 1 for single-turn environments."""

    def train_examples(self) -> list[Example]: ...

    def eval_examples(self) -> list[Example]: ...

    def reward(self, example: Example, completion: Any) -> float:
        """Single-turn: `completion` is the text. Multi-turn: the list of the model's turns."""
        ...

    def exact_match(self, example: Example, completion: Any) -> bool: ...


class MultiTurnEnvironment(Environment, Protocol):
    """Optional members the orchestrator uses when an environment has them:
    `use_tokenizer(tokenizer)` (called once, for environments that render a chat template),
    `prompt_ids(example)` (the opening as token ids, instead of BOS + `example.prompt`),
    `chat` (True: each model turn ends with the end-of-turn token before the reply),
    `concurrency` (replies and rewards computed this many at a time, default 1),
    `max_episode_tokens` (tokens after the prompt), and `metrics(example, turns)` (numbers per
    episode, logged as batch means `env/<name>`)."""

    def respond(self, example: Example, turns: list[str]) -> str | None:
        """The environment's message after the model's latest turn (`turns[-1]`), or None when
        the episode is over."""
        ...


# name -> "module:Class"
REGISTRY = {
    "reverse_text": "rl.envs.reverse_text:ReverseText",
    "arithmetic": "rl.envs.reasoning:Arithmetic",
    "gsm8k": "rl.envs.reasoning:GSM8K",
    "countdown": "rl.envs.reasoning:Countdown",
    "wordle": "rl.envs.wordle:Wordle",
    "verifiers": "rl.envs.verifiers_env:VerifiersEnvironment",
    "code_repair": "rl.envs.code_repair:CodeRepair",
}


def make_environment(env_cfg: Any) -> Environment:
    if env_cfg.name not in REGISTRY:
        raise ValueError(f"environment.name={env_cfg.name}: valid: {', '.join(REGISTRY)}")
    module, cls = REGISTRY[env_cfg.name].split(":")
    return getattr(importlib.import_module(module), cls)(env_cfg)


def check_args(args: dict[str, Any], defaults: Any) -> Any:
    """`environment.args` as the dataclass `defaults` describes, typed as its fields are;
    a ValueError naming the first unknown or ill-typed setting."""
    from dataclasses import fields, replace

    valid = {f.name: f for f in fields(defaults)}
    unknown = sorted(set(args) - set(valid))
    if unknown:
        raise ValueError(
            f"environment.args.{unknown[0]}: unknown; valid: {', '.join(sorted(valid))}"
        )
    typed = {}
    for key, value in args.items():
        kind = type(getattr(defaults, key))
        try:
            typed[key] = kind(value) if kind in (int, float, str) else value
        except (TypeError, ValueError) as err:
            raise ValueError(f"environment.args.{key}={value!r}: expected {kind.__name__}") from err
    return replace(defaults, **typed)
