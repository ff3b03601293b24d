"""mix: several single-turn environments in one run, drawn by weight.

Settings (`environment.args`):
- `members`: a list of `{option: <environment option>, weight: <share>, args: {...}}`. Each
  member is built from its option in conf/environment/ (its `args`, overridden by the
  member's own), with the run's seed; the run's `max_tokens`, `group_size` and
  `prompts_per_step` serve every member.

The training pool holds each member's examples in proportion to its weight (as many as the
member that runs out first allows, so none repeats), so a batch's prompts are drawn from the
members by weight. The held-out prompts are split across the members by weight too
(`environment.eval_size` in all). A prompt is scored by the member it came from, within that
member's reward range; each member's mean reward is logged (`env/<option>/reward`).
Multi-turn members and those that play their own episodes (agents, verifiers) are refused.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

from rl.envs import Environment, Example, make_environment

MEMBER = "mix_member"
"""The key of an example's `info` that names the member it came from."""


def member_config(
    option: str,
    args: dict[str, Any],
    env_cfg: Any,
    eval_size: int | None,
    key: str = "environment.args.members",
) -> Any:
    """Member `option`'s environment config: its option's YAML under the schema, its own
    `args` over the option's, the run's seed and this member's share of the eval (None: the
    option's own)."""
    from omegaconf import OmegaConf

    from rl.core.config import EnvironmentConfig
    from rl.core.paths import CONF

    path = CONF / "environment" / f"{option}.yaml"
    if not path.is_file():
        raise ValueError(f"{key}: no environment option {option!r} in {path.parent}")
    merged = OmegaConf.merge(
        OmegaConf.structured(EnvironmentConfig),
        OmegaConf.load(path),
        {"args": args or {}, "seed": env_cfg.seed},
        {"eval_size": eval_size} if eval_size is not None else {},
    )
    return merged


def single_turn(member: Environment, option: str, key: str) -> Environment:
    """`member`, refused where it is multi-turn or plays its own episodes."""
    if member.max_turns > 1 or type(member).rollouts is not Environment.rollouts:
        raise ValueError(
            f"{key}: {option} is multi-turn or plays its own episodes; only single-turn "
            "environments go there"
        )
    return member


def eval_environments(specs: list[Any], env_cfg: Any) -> list[tuple[str, Environment]]:
    """`eval.environments`: each `{option, args, eval_size}` built as an environment whose
    held-out examples are evaluated beside the run's own, by option."""
    built, seen = [], set()
    for spec in specs:
        option = str(spec.get("option", ""))
        if not option or option in seen:
            raise ValueError(f"eval.environments: each needs an option, each option once (got "
                             f"{[str(s.get('option', '')) for s in specs]})")  # fmt: skip
        seen.add(option)
        size = spec.get("eval_size")  # the option's own prompts and lengths, the run's seed
        member_cfg = member_config(
            option, spec.get("args"), env_cfg, size and int(size), "eval.environments"
        )
        env = single_turn(make_environment(member_cfg), option, "eval.environments")
        built.append((option, env))
    return built


class Mix(Environment):
    name = "mix"

    def __init__(self, env_cfg: Any) -> None:
        specs = list(env_cfg.args.get("members") or [])
        if len(specs) < 2:
            raise ValueError("environment.args.members: give two or more {option, weight}")
        options = [str(spec.get("option", "")) for spec in specs]
        weights = [float(spec.get("weight", 1.0)) for spec in specs]
        if len(set(options)) < len(options) or min(weights) <= 0:
            raise ValueError(
                f"environment.args.members: each option once, each weight above 0 (got "
                f"{list(zip(options, weights, strict=True))})"
            )
        shares = [w / sum(weights) for w in weights]
        evals = [max(1, round(env_cfg.eval_size * share)) for share in shares]
        self.members: list[Environment] = []
        for option, spec, eval_size in zip(options, specs, evals, strict=True):
            member = make_environment(member_config(option, spec.get("args"), env_cfg, eval_size))
            self.members.append(single_turn(member, option, "environment.args.members"))
        self.options = options
        lows, highs = zip(*(m.reward_range for m in self.members), strict=True)
        self.reward_range = (min(lows), max(highs))
        self._train = self.pool(shares, env_cfg.seed)
        self._eval = [self.tagged(e, i) for i, m in enumerate(self.members)
                      for e in m.eval_examples()]  # fmt: skip

    def tagged(self, example: Example, member: int) -> Example:
        return replace(example, info={**example.info, MEMBER: member})

    def pool(self, shares: list[float], seed: int) -> list[Example]:
        """The members' training examples in proportion to their weights, shuffled."""
        sizes = [len(m.train_examples()) for m in self.members]
        total = min(math.floor(size / share) for size, share in zip(sizes, shares, strict=True))
        pool = []
        for i, (member, share) in enumerate(zip(self.members, shares, strict=True)):
            pool += [self.tagged(e, i) for e in member.train_examples()[: int(total * share)]]
        random.Random(seed).shuffle(pool)
        return pool

    def member(self, example: Example) -> Environment:
        return self.members[example.info[MEMBER]]

    def train_examples(self) -> list[Example]:
        return self._train

    def eval_examples(self) -> list[Example]:
        return self._eval

    def reward(self, example: Example, completion: str) -> float:
        return self.member(example).score(example, completion)

    def exact_match(self, example: Example, completion: str) -> bool:
        return self.member(example).exact_match(example, completion)

    def metrics(self, example: Example, completion: str) -> dict[str, float]:
        option = self.options[example.info[MEMBER]]
        own = self.member(example).metrics(example, completion)
        return {f"{option}/reward": self.reward(example, completion),
                **{f"{option}/{k}": v for k, v in own.items()}}  # fmt: skip
