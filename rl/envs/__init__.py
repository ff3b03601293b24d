"""Environments: prompts, the answer each is scored against, the rollout and the reward.

An environment is small enough to read on one screen. A single-turn environment scores one
completion; a multi-turn one (`max_turns > 1`) also answers each model turn with a message of
its own (`respond`) until it returns None, and scores the model's turns together. The
orchestrator drives both through the same inference client; in multi-turn samples only the
model's own tokens carry loss, the environment's messages are masked.

Every environment subclasses `Environment`, which declares the members the orchestrator uses,
each optional one with a default that means "not used", so an environment defines only what it
has.

Rewards are checked where they are made: each environment declares `reward_range`, and callers
score through `Environment.score`, which raises `RewardOutOfRange` for a reward outside it (or
not a finite number). Such a reward is a bug in the environment, or a reward the policy found a
way to forge; training on it would teach exactly that, so it stops the run with the reason.
Shaping that callers add afterwards (the orchestrator's length penalty) is not the
environment's reward and is not checked here.

`make_environment(cfg.environment)` builds the one `environment.name` names: a built-in of
`BUILT_IN`, or one an installed package declares in the `relay.environments` entry point group
(entry point name: the environment's name; value: "module:Class" of an `Environment`
subclass), so a package outside this repository adds environments without editing it
(docs/environments.md). Names are read from package metadata without importing anything, so
planning stays fast; the chosen environment's module is imported only when it is built, so one
environment's dependencies never slow down another's start. A package that claims a built-in
name, or one another package claims, is refused rather than shadowing it.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the environments' package stays light: sandboxes start from it
    from rl.core.records import Episode


@dataclass(frozen=True)
class Example:
    """One task instance: the prompt text, what a perfect completion says, and anything else
    the reward needs (`info`, environment-specific)."""

    prompt: str
    answer: str
    info: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


class RewardOutOfRange(RuntimeError):
    """An environment returned a reward outside its declared `reward_range`."""


class Environment(ABC):
    """What every environment is: its examples, its reward and exact match, and the optional
    members below, whose defaults mean "not used". `make_environment` builds one from the
    `environment` config group (`Class(env_cfg)`)."""

    name: str
    """Its `environment.name`: a key of `BUILT_IN`, or its entry point's name."""
    max_turns: int = 1
    """Model turns per episode: 1 for single-turn environments."""
    chat: bool = False
    """True: turns are a chat template's, so a model turn cut at `max_tokens` gets the
    end-of-turn token before the environment's reply."""
    concurrency: int = 1
    """Replies and rewards computed this many at a time."""
    max_episode_tokens: int | None = None
    """Tokens per episode after the prompt; None: up to the served context length."""
    reward_range: tuple[float, float] = (0.0, 1.0)
    """The lowest and highest reward `reward` can return; `score` refuses anything else."""

    @abstractmethod
    def train_examples(self) -> list[Example]:
        """The training split."""

    @abstractmethod
    def eval_examples(self) -> list[Example]:
        """The held-out split."""

    @abstractmethod
    def reward(self, example: Example, completion: Any) -> float:
        """Single-turn: `completion` is the text. Multi-turn: the list of the model's turns."""

    def score(self, example: Example, completion: Any) -> float:
        """`reward`, checked against `reward_range`: what callers train and evaluate on. Off
        by no more than float rounding, it is clamped; further off, RewardOutOfRange."""
        value = self.reward(example, completion)
        number = float(value) if isinstance(value, numbers.Real) else math.nan
        low, high = self.reward_range
        slack = 1e-9 * max(1.0, high - low)
        if not (math.isfinite(number) and low - slack <= number <= high + slack):
            raise RewardOutOfRange(
                f"environment {self.name}: reward {value!r} is outside its declared range "
                f"[{low:g}, {high:g}] (a bug in the environment, or a forged reward); the "
                f"prompt began {example.prompt[:120]!r}"
            )
        return min(max(number, low), high)

    @abstractmethod
    def exact_match(self, example: Example, completion: Any) -> bool:
        """Whether `completion` solves the example (the eval metric)."""

    def use_tokenizer(self, tokenizer: Any) -> None:  # noqa: B027 - optional: a no-op here
        """Called once before multi-turn rollouts, for environments that render a chat template."""

    def prompt_ids(self, example: Example) -> list[int] | None:
        """The episode's opening as token ids; None: the orchestrator encodes BOS +
        `example.prompt`."""
        return None

    def metrics(self, example: Example, completion: Any) -> dict[str, float]:
        """Numbers per episode, logged as batch means `env/<name>`; {}: none."""
        return {}

    def respond(self, example: Example, turns: list[str]) -> str | None:
        """The environment's message after the model's latest turn (`turns[-1]`); None when
        the episode is over (always, for single-turn environments)."""
        return None

    def rollouts(
        self, inference: Any, examples: list[Example], n: int, temperature: float, max_len: int
    ) -> list[Episode | None] | None:
        """Episodes the environment plays itself through `inference` (an agent's, through the
        proxy: rl/orchestrator/agents.py), None for one with no model turn; None: the
        orchestrator plays them."""
        return None


ENTRY_POINT_GROUP = "relay.environments"
"""Where installed packages declare environments: `name = "module:Class"`."""

# name -> "module:Class"
BUILT_IN = {
    "reverse_text": "rl.envs.reverse_text:ReverseText",
    "arithmetic": "rl.envs.reasoning:Arithmetic",
    "gsm8k": "rl.envs.reasoning:GSM8K",
    "countdown": "rl.envs.reasoning:Countdown",
    "wordle": "rl.envs.wordle:Wordle",
    "verifiers": "rl.envs.verifiers_env:VerifiersEnvironment",
    "code_repair": "rl.envs.code_repair:CodeRepair",
    "agent": "rl.orchestrator.agents:AgentEnvironment",
    "dataset": "rl.envs.dataset:Dataset",
    "mix": "rl.envs.mix:Mix",
}


def registry() -> dict[str, str]:
    """Every environment by name, "module:Class": the built-ins, then those of installed
    packages by name (nothing is imported). A ValueError when a package reuses a taken name."""
    found = dict(BUILT_IN)
    claimed = dict.fromkeys(BUILT_IN, "Relay has one of that name built in")
    for point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda p: p.name):
        package = point.dist.name if point.dist else point.value
        if point.name in found:
            raise ValueError(
                f"environment {point.name}: package {package} declares it ({point.value}) in "
                f"the {ENTRY_POINT_GROUP} entry point group, but {claimed[point.name]}; "
                f"rename that entry point or uninstall {package}"
            )
        found[point.name] = point.value
        claimed[point.name] = f"package {package} declares it too"
    return found


def config_packages() -> dict[str, str]:
    """Where installed packages keep their config options: the `conf` package inside the
    top-level package of each `relay.environments` entry point's module (when it has a `conf/`
    folder), with the name of the distribution that declares it. Nothing is imported; Relay's
    Hydra search-path plugin (hydra_plugins/relay_environments.py) puts these on the path."""
    found: dict[str, str] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        top = point.module.partition(".")[0]
        try:
            spec = importlib.util.find_spec(top)  # a top-level name: finds, does not import
        except (ImportError, ValueError):
            continue
        places = (spec.submodule_search_locations or []) if spec else []
        if any((Path(place) / "conf").is_dir() for place in places):
            found.setdefault(f"{top}.conf", point.dist.name if point.dist else top)
    return dict(sorted(found.items()))


def locate(name: str) -> str:
    """Where environment `name` is defined ("module:Class"); a ValueError listing the valid
    names otherwise."""
    known = registry()
    if name not in known:
        raise ValueError(
            f"environment.name={name}: valid: {', '.join(known)} (installed packages add more "
            f"through the {ENTRY_POINT_GROUP} entry point group)"
        )
    return known[name]


def make_environment(env_cfg: Any) -> Environment:
    """The environment `env_cfg.name` names, built from `env_cfg` (its module imported now)."""
    where = locate(env_cfg.name)
    module, _, attr = where.partition(":")
    cls = getattr(importlib.import_module(module), attr, None) if attr else None
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(
            f"environment.name={env_cfg.name}: {where} is not a subclass of "
            f"rl.envs.Environment, which an entry point of {ENTRY_POINT_GROUP} must name"
        )
    return cls(env_cfg)


def load_callable(spec: str, key: str, roots: tuple[Path, ...] = ()) -> Any:
    """The user's function that `spec` names, `package.module:function` or
    `path/to/file.py:function` (a file found as given, else under one of `roots`); a
    ValueError naming `key` (the setting that gave it) when it cannot be had."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"{key}={spec!r}: expected module:function or file.py:function")
    try:
        if where.endswith(".py"):
            places = (Path(where), *(root / where for root in roots))
            path = next((p for p in places if p.is_file()), None)
            if path is None:
                raise ValueError(f"{key}={spec!r}: no file {where}")
            found = importlib.util.spec_from_file_location(f"relay_user_{path.stem}", path)
            module = importlib.util.module_from_spec(found)  # type: ignore[arg-type]
            found.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(where)
    except ValueError:
        raise
    except Exception as exc:  # the user's module: any error it raises on import
        raise ValueError(f"{key}={spec!r}: importing {where} failed: {exc!r}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"{key}={spec!r}: {name} is not a function of {where}")
    return function


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
