"""verifiers: train on any installed verifiers 0.4.0 environment (`environment.args.id=<name>`).

A verifiers 0.4.0 environment is a Python package, found by import name, that exports a
`vf.Taskset` subclass (and, for a multi-turn game, a `vf.Env` subclass) through `__all__`.
Relay runs the rollouts itself, through its own inference servers, because the trainer needs
the sampled token ids and logprobs; from verifiers it takes only what needs no model client:

- the tasks: each `vf.Task` becomes an `Example` whose prompt is the task's text (below), whose
  answer is the task data's `answer` field (`answer_field`; "" when absent: the SFT warm-up
  needs one), and whose `info` holds the task itself (`task`) and its verifiers `Env` (`env`);
- the rewards: the task's `@vf.reward` functions (async, as verifiers requires) run through
  `Task.score` on a trace built from the prompt and the completion, on a private event loop in
  a thread of its own (so it works whether or not the caller runs a loop); the reward is the
  trace's weighted sum, exactly as verifiers computes it. Rewards that need a runtime (sandbox)
  are refused when the environment loads, since there is none;
- multi-turn games: verifiers 0.4.0 has no model-free "environment step". Its multi-turn surface
  is an `Env.run(task, agents)` coroutine that holds `agents.<role>.interaction(task)` open and
  calls `await interaction.turn(message)` once per model turn (TextArena does so). Relay replays
  that coroutine against scripted agents: `respond(example, turns)` runs `Env.run` with the
  model's turns so far and returns the message the environment sends next (None once `run`
  leaves the interaction), and `reward` replays the whole episode, then scores as verifiers
  does: the task's rewards when the interaction closes, what `run` records on the trace, then
  `Env.finalize`. Replays cost O(turns) environment steps per call and assume `run` is
  deterministic given the model's turns (TextArena seeds its engine per task). An `Env` that
  calls `agent.run(task)` or a second agent's model cannot be replayed: it is refused at load.

Prompt text: Relay's models may have no chat template, so a task's prompt is rendered as plain
text the way verifiers itself folds a prompt for a harness without chat messages: the system
prompt, a blank line, then `TaskData.prompt_text` (every message's text, blank-line separated).
A prompt-less task of a multi-turn game (the environment opens the conversation) takes the
environment's opening message as its prompt. The environment's later messages go on lines of
their own ("\\n<message>\\n").

Errors in a reward (a reward function raising or timing out on one completion) are logged with
their traceback and score 0.0, as a failed scoring does in verifiers; after
`max_consecutive_reward_errors` failures in a row the next raises, so that a broken reward
stops the run instead of training on zeros.

Settings (`environment.args`): `id` (required), `env_args` (the taskset's settings, what
`vf-eval --env.taskset.<name>` sets), `eval_env_args` (settings merged onto `env_args` for a
separate eval taskset, e.g. `{split: test}`; empty: the eval set is `eval_size` tasks held out
of the training taskset by a seeded shuffle), `max_tasks` (cap; needed for infinite tasksets),
`max_turns`, `answer_field`, `solved_at` (`exact_match` is reward >= solved_at),
`reward_timeout_s`, `max_consecutive_reward_errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import math
import random
import threading
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from rl.envs import Environment, Example, check_args

log = logging.getLogger(__name__)

DEFAULT_MAX_TURNS = 8
"""Model turns per episode of a multi-turn game when neither `max_turns` nor its role caps it."""


@dataclass(frozen=True)
class VerifiersArgs:
    id: str = ""
    """Import name of the installed verifiers environment (a hub id `owner/name` installs as
    `name`)."""
    env_args: dict[str, Any] = field(default_factory=dict)
    """The taskset's settings (its `vf.TasksetConfig` fields)."""
    eval_env_args: dict[str, Any] = field(default_factory=dict)
    """Settings merged onto `env_args` for a separate eval taskset; empty: hold out `eval_size`
    training tasks."""
    max_tasks: int = 0
    """Most tasks read from the taskset (0: all; an infinite taskset needs a cap)."""
    max_turns: int = 0
    """Model turns per episode of a multi-turn game (0: the role's `max_turns`, else 8)."""
    answer_field: str = "answer"
    """Task data field holding the reference answer (SFT warm-up, rollout logs)."""
    solved_at: float = 1.0
    """`exact_match` is true when the weighted reward reaches this."""
    reward_timeout_s: float = 60.0
    """Seconds one scoring (or one multi-turn replay) may take before it counts as an error."""
    max_consecutive_reward_errors: int = 64
    """Reward errors in a row after which scoring raises instead of returning 0.0."""


def parse_args(args: dict[str, Any]) -> VerifiersArgs:
    """`environment.args` checked: unset (null) values keep their defaults, `id` is required,
    the `*env_args` are mappings."""
    parsed = check_args({k: v for k, v in args.items() if v is not None}, VerifiersArgs())
    if not parsed.id:
        raise ValueError(
            "environment.args.id: required: the import name of an installed verifiers "
            "environment, e.g. environment.args.id=relay_reverse"
        )
    for name in ("env_args", "eval_env_args"):
        if not isinstance(getattr(parsed, name), dict):
            raise ValueError(
                f"environment.args.{name}={getattr(parsed, name)!r}: expected a mapping of "
                "taskset settings, e.g. {num_tasks: 100}"
            )
    if parsed.max_tasks < 0 or parsed.max_turns < 0:
        raise ValueError("environment.args: max_tasks and max_turns must be >= 0")
    return parsed


def module_name(env_id: str) -> str:
    """The import name verifiers derives from an id: `owner/name@version` -> `name`."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def check_installed(env_id: str) -> None:
    """A ValueError that says how to install it unless `env_id` names an installed package or
    one of verifiers' own tasksets; found without importing anything (verifiers takes seconds
    to import), so that the plan can check it."""
    module = module_name(env_id)
    if importlib.util.find_spec(module):
        return
    verifiers = importlib.util.find_spec("verifiers")
    for root in (verifiers.submodule_search_locations or []) if verifiers else []:
        tasksets = Path(root) / "v1" / "tasksets"
        if (tasksets / f"{module}.py").is_file() or (tasksets / module / "__init__.py").is_file():
            return
    raise ValueError(
        f"environment.args.id={env_id}: no installed verifiers environment (Python package "
        f"{module!r}). Install it into Relay's environment, e.g. `uv pip install -e "
        f"path/to/{module}` or `uv pip install {module.replace('_', '-')}`, or put the "
        "folder that holds the package on PYTHONPATH"
    )


def load_vf_env(env_id: str, env_args: dict[str, Any]) -> Any:
    """The verifiers `Env` for taskset `env_id` with `env_args`, or a ValueError that says what
    is wrong and how to install an environment."""
    import verifiers.v1 as vf
    from pydantic import ValidationError

    check_installed(env_id)
    try:
        config = vf.resolve_env_config({"taskset": {**env_args, "id": env_id}})
        return vf.load_environment(config)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'][1:])) or 'taskset'}: {e['msg']}" for e in err.errors()
        )
        raise ValueError(f"environment.args.env_args for {env_id}: {problems}") from err
    except (ImportError, AttributeError, TypeError) as err:
        raise ValueError(
            f"environment.args.id={env_id}: {module_name(env_id)!r} is not a loadable verifiers "
            f"0.4.0 environment ({type(err).__name__}: {err}); it must export its vf.Taskset "
            "subclass through __all__"
        ) from err


def render_prompt(data: Any) -> str:
    """A task's prompt as plain text: the system prompt, a blank line, the prompt's text."""
    text = data.prompt_text
    return f"{data.system_prompt}\n\n{text}" if data.system_prompt else text


def render_reply(text: str) -> str:
    """An environment message as it follows a model turn: on a line of its own."""
    return f"\n{text.strip()}\n"


class EventLoop:
    """A private asyncio loop in a daemon thread: runs verifiers' coroutines from synchronous
    code, also where the caller's thread already runs a loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="verifiers", daemon=True).start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.loop)
        # wait_for cancels a slow coroutine; the margin covers one that blocks the loop itself.
        return future.result(timeout + 5.0)


# --- traces -------------------------------------------------------------------------------


def new_trace(task: Any) -> Any:
    """An empty verifiers trace of `task`, with its prompt messages as the first nodes."""
    import verifiers.v1 as vf

    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
    )
    data = task.data
    if data.system_prompt is not None:
        add_message(trace, vf.SystemMessage(content=data.system_prompt))
    if isinstance(data.prompt, str):
        add_message(trace, vf.UserMessage(content=data.prompt))
    else:
        for message in data.prompt or []:
            add_message(trace, message)
    return trace


def add_message(trace: Any, message: Any, sampled: bool = False) -> None:
    """Append `message` to the trace's one branch (`sampled`: the model wrote it)."""
    from verifiers.v1.graph import MessageNode

    parent = len(trace.nodes) - 1 if trace.nodes else None
    trace.nodes.append(MessageNode(parent=parent, message=message, sampled=sampled))


def add_model_turn(trace: Any, text: str) -> Any:
    import verifiers.v1 as vf

    message = vf.AssistantMessage(content=text)
    add_message(trace, message, sampled=True)
    return message


# --- multi-turn replay ----------------------------------------------------------------------


class NeedsModelTurn(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """Raised inside a replay when the environment asks for a model turn past the script;
    `message` is what it sent with the request (None: a bare `turn()`). A BaseException, like
    asyncio's CancelledError, so that an `except Exception` in the environment's code lets it
    through."""

    def __init__(self, message: str | None) -> None:
        super().__init__(message)
        self.message = message


class ScriptedInteraction:
    """What `Env.run` sees of `agents.<role>.interaction(task)`: each `turn()` answers with the
    next scripted model turn."""

    def __init__(self, trace: Any, turns: list[str], stop_at_end: bool) -> None:
        self.trace = trace
        self.turns = list(turns)
        self.stop_at_end = stop_at_end

    async def turn(self, message: Any = None) -> Any:
        from verifiers.v1 import Segment, UserMessage
        from verifiers.v1.types import content_text

        text = None
        if message is not None:
            messages = [UserMessage(content=message)] if isinstance(message, str) else message
            text = "\n\n".join(content_text(getattr(m, "content", None)) for m in messages)
        if not self.turns:
            if self.stop_at_end:
                raise NeedsModelTurn(text)
            return Segment(messages=[], terminated=True)  # Relay ended the episode here
        if message is not None:
            for m in messages:
                add_message(self.trace, m)
        return Segment(messages=[add_model_turn(self.trace, self.turns.pop(0))])


class ScriptedAgent:
    """A role of the environment's config, played by a script of model turns."""

    def __init__(self, role: str, replay: Replay) -> None:
        self.role, self.replay = role, replay
        self.trainable = True

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any, **_: Any) -> AsyncIterator[ScriptedInteraction]:
        replay = self.replay
        if replay.trace is not None:
            raise NotImplementedError(
                f"the environment opened a second interaction ({self.role}); Relay replays "
                "one conversation with one model per episode"
            )
        replay.trace = new_trace(task)
        interaction = ScriptedInteraction(replay.trace, replay.turns, replay.stop_at_end)
        yield interaction
        if not replay.stop_at_end:  # the interaction closed: score as verifiers' rollout does
            await task.score(replay.trace)

    async def run(self, task: Any, **_: Any) -> Any:
        raise NotImplementedError(
            f"the environment runs its {self.role!r} agent to completion (agent.run), which "
            "calls a model itself; Relay replays only interaction()/turn() conversations"
        )


@dataclass
class Replay:
    """One replay of a multi-turn episode through `Env.run`."""

    turns: list[str]
    stop_at_end: bool
    """True: stop at the first model turn past `turns` (what `respond` needs); False: the
    episode ended after `turns` (what `reward` needs)."""
    trace: Any = None


async def replay(env: Any, task: Any, turns: list[str], stop_at_end: bool) -> tuple[Any, Any]:
    """Run `env.run(task)` against scripted agents. Returns (the trace, the message the
    environment sent when it asked for the next model turn, or None when `run` ended)."""
    import verifiers.v1 as vf

    script = Replay(turns, stop_at_end)
    agents = vf.Agents(env.config, lambda role, _spec: ScriptedAgent(role, script))
    await env.setup(agents)
    try:
        await env.run(task, agents)
    except NeedsModelTurn as pending:
        return script.trace, pending.message or ""
    if stop_at_end or script.trace is None:
        return script.trace, None
    episode = vf.Episode(env=vf.EnvInfo(id=env.config.env_id), task=script.trace.task)
    episode.traces.append(script.trace)
    await env.finalize(task, episode)
    return script.trace, None


# --- the environment ------------------------------------------------------------------------


class VerifiersEnvironment(Environment):
    name = "verifiers"
    # A weighted sum of the environment's own reward functions: no bound Relay can know. NaN
    # and infinity are still refused.
    reward_range = (-math.inf, math.inf)

    def __init__(self, env_cfg: Any) -> None:
        from omegaconf import DictConfig, OmegaConf

        raw = env_cfg.args
        raw = OmegaConf.to_container(raw, resolve=True) if isinstance(raw, DictConfig) else raw
        self.args = args = parse_args(dict(raw))
        self.loop = EventLoop()
        self.vf_env = load_vf_env(args.id, args.env_args)
        self.multi_turn = not self._single_agent(self.vf_env)
        self.max_turns = self._max_turns() if self.multi_turn else 1
        train = self._examples(self.vf_env)
        if args.eval_env_args:
            eval_env = load_vf_env(args.id, {**args.env_args, **args.eval_env_args})
            held_out = self._examples(eval_env)
            random.Random(env_cfg.seed).shuffle(held_out)
            self._eval, self._train = held_out[: env_cfg.eval_size], train
        else:
            random.Random(env_cfg.seed).shuffle(train)
            self._eval, self._train = train[: env_cfg.eval_size], train[env_cfg.eval_size :]
        if not self._train:
            raise ValueError(
                f"environment.args.id={args.id}: no training tasks left after holding out "
                f"eval_size={env_cfg.eval_size}; lower environment.eval_size or load more tasks"
            )
        self._score = lru_cache(maxsize=16384)(self._score_uncached)
        self._consecutive_errors = 0
        log.info(
            "verifiers environment %s: %d train / %d eval tasks, %s",
            args.id,
            len(self._train),
            len(self._eval),
            f"multi-turn (max {self.max_turns} turns)" if self.multi_turn else "single-turn",
        )

    @staticmethod
    def _single_agent(vf_env: Any) -> bool:
        from verifiers.v1 import SingleAgentEnv

        return type(vf_env) is SingleAgentEnv

    def _max_turns(self) -> int:
        from verifiers.v1.configs.agent import agent_config_fields

        caps = [a.max_turns for a in agent_config_fields(self.vf_env.config).values()]
        return self.args.max_turns or min((c for c in caps if c), default=DEFAULT_MAX_TURNS)

    def _examples(self, vf_env: Any) -> list[Example]:
        taskset = vf_env.taskset
        if self.args.max_tasks:
            taskset = taskset.take(self.args.max_tasks)
        elif not taskset.bounded:
            raise ValueError(
                f"environment.args.id={self.args.id}: the taskset is infinite; cap it with "
                "environment.args.max_tasks"
            )
        examples = [self._example(vf_env, task) for task in taskset]
        if not examples:
            raise ValueError(f"environment.args.id={self.args.id}: the taskset has no tasks")
        self._check_scorable(vf_env, examples[0].info["task"])
        return examples

    def _example(self, vf_env: Any, task: Any) -> Example:
        data = task.data
        if data.prompt is not None:
            prompt = render_prompt(data)
        elif self.multi_turn:  # the environment opens the conversation
            _, opening = self.loop.run(
                replay(vf_env, task, [], stop_at_end=True), self.args.reward_timeout_s
            )
            head = f"{data.system_prompt}\n\n" if data.system_prompt else ""
            prompt = f"{head}{opening or ''}\n"
        else:
            raise ValueError(
                f"environment.args.id={self.args.id}: task {data.idx} has no prompt, and a "
                "single-turn task needs one"
            )
        answer = getattr(data, self.args.answer_field, None)
        return Example(prompt, "" if answer is None else str(answer), {"task": task, "env": vf_env})

    def _check_scorable(self, vf_env: Any, task: Any) -> None:
        """Refuse rewards Relay cannot run (they need a sandbox runtime), and a multi-turn
        game whose `run` cannot be replayed."""
        import inspect

        needs_runtime = [
            fn.__name__
            for fn in (*task.hooks("reward"), *task.hooks("metric"))
            if (p := inspect.signature(fn).parameters.get("runtime")) is not None
            and p.default is inspect.Parameter.empty
        ]
        if needs_runtime:
            raise ValueError(
                f"environment.args.id={self.args.id}: rewards {needs_runtime} need a runtime "
                "(sandbox), which Relay's rollouts do not have"
            )
        if not task.hooks("reward") and not self.multi_turn:
            raise ValueError(f"environment.args.id={self.args.id}: the task has no @vf.reward")
        if self.multi_turn:
            try:
                self.loop.run(
                    replay(vf_env, task, [], stop_at_end=True), self.args.reward_timeout_s
                )
            except NotImplementedError as err:
                raise ValueError(f"environment.args.id={self.args.id}: {err}") from err

    def train_examples(self) -> list[Example]:
        return self._train

    def eval_examples(self) -> list[Example]:
        return self._eval

    # --- scoring ----------------------------------------------------------------------------

    def reward(self, example: Example, completion: str | list[str]) -> float:
        """The weighted sum of the task's rewards (single-turn: `completion` is the text;
        multi-turn: the model's turns); 0.0 when scoring fails (see the module docstring)."""
        if isinstance(completion, list):
            key: str | tuple[str, ...] = tuple(completion)
        else:  # a one-turn episode of a game is still replayed through its run()
            key = (completion,) if self.multi_turn else completion
        task = example.info["task"]
        try:
            value = self._score(task, example.info["env"], key)
        except Exception as err:
            self._consecutive_errors += 1
            what = (
                f"took over {self.args.reward_timeout_s:g} s (environment.args.reward_timeout_s)"
                if isinstance(err, TimeoutError)
                else f"{type(err).__name__}: {err}"
            )
            if self._consecutive_errors >= self.args.max_consecutive_reward_errors:
                raise RuntimeError(
                    f"verifiers environment {self.args.id}: {self._consecutive_errors} reward "
                    f"errors in a row, the last: {what}"
                ) from err
            log.warning(
                "reward of task %s failed, scoring 0.0 (%d in a row): %s",
                task.data.idx,
                self._consecutive_errors,
                what,
                exc_info=not isinstance(err, TimeoutError),
            )
            return 0.0
        self._consecutive_errors = 0
        return value

    def exact_match(self, example: Example, completion: str | list[str]) -> bool:
        return self.reward(example, completion) >= self.args.solved_at

    def _score_uncached(self, task: Any, vf_env: Any, completion: str | tuple[str, ...]) -> float:
        """One scoring; cached by (task, completion) since the orchestrator's eval asks for
        `reward` and then `exact_match` of the same completion. Errors are not cached."""
        return self.loop.run(
            self._score_async(task, vf_env, completion), self.args.reward_timeout_s
        )

    async def _score_async(self, task: Any, vf_env: Any, completion: Any) -> float:
        if isinstance(completion, str):
            trace = new_trace(task)
            add_model_turn(trace, completion)
            await task.score(trace)
        else:
            trace, _ = await replay(vf_env, task, list(completion), stop_at_end=False)
            if trace is None:
                raise RuntimeError("the environment's run() opened no interaction")
        return float(trace.reward)

    # --- multi-turn -------------------------------------------------------------------------

    def respond(self, example: Example, turns: list[str]) -> str | None:
        """The environment's message after the model's latest turn, or None when its `run`
        ended the conversation (or failed: the error is logged, the episode ends)."""
        if not self.multi_turn:
            return None
        task, vf_env = example.info["task"], example.info["env"]
        try:
            _, message = self.loop.run(
                replay(vf_env, task, list(turns), stop_at_end=True), self.args.reward_timeout_s
            )
        except Exception:
            log.warning(
                "environment step of task %s failed; ending the episode",
                task.data.idx,
                exc_info=True,
            )
            return None
        return None if message is None else render_reply(message)
