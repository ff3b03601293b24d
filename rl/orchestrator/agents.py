"""Bring your own agent: any program that talks to an OpenAI `base_url` becomes an environment.

`environment=agent` (conf/environment/agent.yaml; `experiment=wordle_agent` runs it) runs the
user's agent once per episode: a Python callable (`module:function` or
`path/to/file.py:function`) in a thread of the orchestrator, or a program (`command`) in a
process of its own. Each episode gets its own base URL,
`http://127.0.0.1:<port>/s/<session>/v1`, served by the `AgentProxy`
(rl/orchestrator/agent_proxy.py) in front of the run's inference servers.

The proxy is what makes an agent's episode a training sample without retokenizing anything the
model sampled (docs/agents.md):
- The first request's messages are rendered with the model's chat template and tokenized once:
  the sample's prompt.
- Every model turn is kept as the exact token ids, logprobs and policy version the inference
  server returned; they carry the loss.
- A later request must begin with the conversation so far: the messages the proxy saw and the
  assistant messages it answered. What follows (user messages, tool results) is rendered as the
  template writes it after a model turn, tokenized once, appended with no loss, and the model
  continues from the exact tokens: prompt + sampled + added + sampled ...
- A request whose history no longer matches (the agent edited or re-rendered a turn, dropped
  one, changed its tools) is template drift. It is counted (`env/template_drift`) and
  `on_drift` decides: `new_sample` (default) closes the sample so far and starts a new one
  from the request as sent, so the model always sees what the agent sent; both samples train
  with the episode's reward. `keep_sampled` keeps the sampled tokens and appends only the
  messages after the request's last assistant message.
- Sampling is the run's: the proxy samples at `algorithm.temperature` (0 in evals) with one
  choice per request and at most `environment.max_tokens` tokens; an agent's own temperature,
  top_p or seed is overridden, and every response says what was used (`relay_sampling`).

An episode ends when the agent returns. Its reward is what the agent returned (a number in the
tasks' reward range), or, if it returned None, the tasks environment's reward over the model's
turns: the list of them for a multi-turn tasks environment, the last one (the agent's final
answer) for a single-turn one, whose reward scores one completion. A tasks environment that
plays its own episodes (another agent) cannot score an agent's, and is refused at plan time.
An agent that raises, returns garbage, or overruns `episode_timeout_s` ends its episode
with reward 0 and a logged reason; the run goes on. A callable that never returns cannot be
stopped from Python: its session is closed (its next request fails) and its thread abandoned;
a `command` agent's whole process group is killed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import math
import os
import signal
import subprocess
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rl.core.auth import without_credentials
from rl.core.paths import ROOT
from rl.core.records import Episode
from rl.envs import Environment, Example, check_args, load_callable, make_environment
from rl.orchestrator.agent_proxy import AgentProxy, Session

log = logging.getLogger("orchestrator")


@dataclass(frozen=True)
class AgentArgs:
    agent: str = ""
    """The agent as `module:function` or `path/to/file.py:function` (relative paths: from the
    working directory, then from Relay's checkout); called as `function(task)`."""
    command: list = field(default_factory=list)
    """Or a program to run per episode (argv); it gets OPENAI_BASE_URL, OPENAI_API_KEY,
    OPENAI_MODEL and RELAY_TASK (JSON: prompt, answer, info) and may print its reward as the
    last line of its output."""
    tasks: str = ""
    """The environment whose examples the episodes play, and whose reward scores the model's
    turns when the agent returns none."""
    task_args: dict | None = None
    """`environment.args` of the tasks environment (None: its defaults)."""
    max_turns: int = 16
    """Most model turns per episode; later requests get a 400."""
    concurrency: int = 8
    """Episodes run at once."""
    episode_timeout_s: float = 120.0
    """An episode still running after this ends with reward 0."""
    request_timeout_s: float = 60.0
    """A model turn that takes longer is answered with a 504."""
    on_drift: str = "new_sample"
    """When an agent's history no longer matches what was sampled: `new_sample` or
    `keep_sampled` (module docstring)."""


@dataclass
class Task:
    """What an agent gets for one episode."""

    base_url: str
    """This episode's OpenAI base URL (it ends in /v1)."""
    api_key: str
    """This episode's own key: it opens this session only, while the episode is open."""
    model: str
    prompt: str
    answer: str
    info: dict[str, Any]
    max_tokens: int
    """Tokens per model turn."""
    http: Any = field(default=None, repr=False)
    """The HTTP connection pool to the proxy that every episode shares (`client()` uses it)."""

    def client(self) -> Any:
        """This episode's client of the official `openai` package, on the connection pool
        every episode shares. A client built per episode with a pool of its own costs about
        35 ms of the orchestrator's CPU (its TLS context, made even for http://), five times
        what the proxy and the client then spend on a turn."""
        from openai import OpenAI

        return OpenAI(
            base_url=self.base_url, api_key=self.api_key, max_retries=0, http_client=self.http
        )


class Transcript(list):
    """The model's turns (assistant texts), with how the episode ended: what the orchestrator
    scores and the environment reads its reward from."""

    def __init__(self, turns: list[str], reward: float | None, failure: str, stats: dict) -> None:
        super().__init__(turns)
        self.reward, self.failure, self.stats = reward, failure, stats


# --- running agents ----------------------------------------------------------------------


def load_agent(spec: str) -> Any:
    """The callable `module:function` or `path/to/file.py:function` names (a file as given,
    else under the checkout)."""
    return load_callable(spec, "environment.args.agent", (ROOT,))


def run_callable(agent: Any, task: Task, timeout: float) -> tuple[Any, str]:
    """The agent's return value and "" , or None and why it failed; a hung agent's thread is
    left behind (daemon)."""
    done: Future = Future()

    def play() -> None:
        try:
            done.set_result(agent(task))
        except BaseException as exc:  # the agent's own failure, whatever it is
            done.set_exception(exc)

    threading.Thread(target=play, name="agent", daemon=True).start()
    try:
        return done.result(timeout=timeout), ""
    except TimeoutError:
        return None, f"timed out after {timeout:.0f} s"
    except BaseException as exc:
        return None, f"raised {type(exc).__name__}: {str(exc)[:300]}"


def run_command(argv: list[str], task: Task, timeout: float) -> tuple[Any, str]:
    """Run a program agent; its reward is the last line of its output (none when empty)."""
    env = {
        **without_credentials(os.environ),  # the episode's own key is all it gets
        "OPENAI_BASE_URL": task.base_url,
        "OPENAI_API_KEY": task.api_key,
        "OPENAI_MODEL": task.model,
        "RELAY_TASK": json.dumps({"prompt": task.prompt, "answer": task.answer, "info": task.info}),
    }
    proc = subprocess.Popen(
        [str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        start_new_session=True, text=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, f"timed out after {timeout:.0f} s (process group killed)"
    if proc.returncode != 0:
        return None, f"exited with {proc.returncode}: {err.strip()[-300:]}"
    lines = [line for line in out.splitlines() if line.strip()]
    if not lines:
        return None, ""
    try:
        return json.loads(lines[-1]), ""
    except json.JSONDecodeError:
        return lines[-1], ""


def checked_reward(value: Any, low: float, high: float) -> tuple[float | None, str]:
    """An agent's reward, or why it is not one."""
    if value is None:
        return None, ""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None, f"returned {value!r:.100}, not a finite number"
    if not low <= value <= high:
        return None, f"returned reward {value} outside the tasks' range [{low:g}, {high:g}]"
    return float(value), ""


def agent_args(env_cfg: Any) -> AgentArgs:
    """`environment.args` of an agent environment, checked; a ValueError naming the key."""
    args = check_args(dict(env_cfg.args), AgentArgs())
    if bool(args.agent) == bool(args.command):
        raise ValueError(
            "environment.args: set exactly one of agent (module:function or file.py:function) "
            "or command (a program's argv)"
        )
    if args.on_drift not in ("new_sample", "keep_sampled"):
        raise ValueError(f"environment.args.on_drift={args.on_drift}: new_sample or keep_sampled")
    if not args.tasks:
        raise ValueError("environment.args.tasks: name the environment whose examples to play")
    for key in ("max_turns", "concurrency"):
        if getattr(args, key) < 1:
            raise ValueError(f"environment.args.{key}={getattr(args, key)}: must be >= 1")
    for key in ("episode_timeout_s", "request_timeout_s"):
        if getattr(args, key) <= 0:
            raise ValueError(f"environment.args.{key}={getattr(args, key)}: must be > 0")
    return args


def check_config(env_cfg: Any) -> None:
    """What the planner checks before anything starts: the settings, the tasks environment,
    and that the agent can be loaded (or the program found)."""
    import shutil

    from rl.envs import locate

    args = agent_args(env_cfg)
    try:
        where = locate(args.tasks)
    except ValueError as err:
        raise ValueError(f"environment.args.tasks={args.tasks}: {err}") from None
    module, _, name = where.partition(":")
    tasks = getattr(importlib.import_module(module), name)
    if isinstance(tasks, type) and tasks.rollouts is not Environment.rollouts:
        raise ValueError(
            f"environment.args.tasks={args.tasks}: it plays its own episodes, so its reward "
            f"cannot score an agent's conversation; name an environment of examples and a "
            f"reward (reverse_text, arithmetic, gsm8k, countdown, wordle, code_repair, ...)"
        )
    if args.agent:
        load_agent(args.agent)
    elif shutil.which(str(args.command[0])) is None:
        raise ValueError(
            f"environment.args.command={list(args.command)}: no program {args.command[0]}"
        )


class AgentEnvironment(Environment):
    """Episodes played by the user's agent through the proxy (module docstring)."""

    name = "agent"
    chat = True

    def __init__(self, env_cfg: Any) -> None:
        self.args = agent_args(env_cfg)
        self.tasks = make_environment(tasks_config(env_cfg, self.args))
        self.reward_range = self.tasks.reward_range
        self.max_turns = self.args.max_turns
        self.agent = load_agent(self.args.agent) if self.args.agent else None
        self.max_tokens = env_cfg.max_tokens
        self.tokenizer: Any = None
        self.proxy: AgentProxy | None = None

    def train_examples(self) -> list[Example]:
        return self.tasks.train_examples()

    def eval_examples(self) -> list[Example]:
        return self.tasks.eval_examples()

    def use_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def reward(self, example: Example, completion: Transcript) -> float:
        if completion.failure:
            return 0.0
        if completion.reward is not None:
            return completion.reward
        return self.tasks.score(example, self.scored(completion))

    def exact_match(self, example: Example, completion: Transcript) -> bool:
        if completion.failure:
            return False
        if completion.reward is not None:
            return completion.reward >= self.reward_range[1]
        return self.tasks.exact_match(example, self.scored(completion))

    def scored(self, completion: Transcript) -> list[str] | str:
        """What the tasks environment's reward reads: the model's turns for a multi-turn one,
        the last of them (the agent's answer) for a single-turn one."""
        if self.tasks.max_turns > 1:
            return list(completion)
        return completion[-1] if completion else ""

    def metrics(self, example: Example, completion: Transcript) -> dict[str, float]:
        return completion.stats

    def rollouts(
        self, inference: Any, examples: list[Example], n: int, temperature: float, max_len: int
    ) -> list[Episode | None]:
        """`n` episodes per example (example-major); None for an episode in which the model
        never spoke (nothing to train on)."""
        if self.proxy is None:
            self.proxy = AgentProxy(inference, self.tokenizer, max_len, self.args)
            self.proxy.start()
        plays = [e for e in examples for _ in range(n)]
        sampling = {"temperature": temperature, "max_tokens": self.max_tokens, "n": 1}
        with ThreadPoolExecutor(min(self.args.concurrency, len(plays))) as pool:
            return list(pool.map(lambda e: self.episode(e, sampling), plays))

    def episode(self, example: Example, sampling: dict[str, Any]) -> Episode | None:
        assert self.proxy is not None
        sid, key = self.proxy.open(sampling)
        task = Task(
            f"{self.proxy.url}/s/{sid}/v1", key, self.proxy.model_name,
            example.prompt, example.answer, dict(example.info), self.max_tokens, self.proxy.http,
        )  # fmt: skip
        timeout = self.args.episode_timeout_s
        if self.agent is not None:
            value, failure = run_callable(self.agent, task, timeout)
        else:
            value, failure = run_command(self.args.command, task, timeout)
        session = self.proxy.close(sid)
        reward, bad = (None, "") if failure else checked_reward(value, *self.reward_range)
        failure = failure or bad
        if failure:
            log.warning(
                "agent episode (%r...) ends with reward 0: %s", example.prompt[:40], failure
            )
        return ended(session, reward, failure)


def tasks_config(env_cfg: Any, args: AgentArgs) -> Any:
    """The tasks environment's config: this one's, with its name and `task_args`."""
    from dataclasses import is_dataclass, replace

    from omegaconf import OmegaConf

    if is_dataclass(env_cfg):
        return replace(env_cfg, name=args.tasks, args=dict(args.task_args or {}))
    inner = OmegaConf.to_container(env_cfg, resolve=True)
    inner.update(name=args.tasks, args=dict(args.task_args or {}))
    return OmegaConf.create(inner)


def ended(session: Session, reward: float | None, failure: str) -> Episode | None:
    """An ended episode for scoring: its last sample, with the earlier ones (after drift) in
    `earlier`, and its turns as the `Transcript` the reward reads."""
    samples = session.samples()
    if not samples:
        return None
    stats = {
        "template_drift": float(session.drift),
        "agent_failed": float(bool(failure)),
        "agent_timeout": float("timed out" in failure),
        "turns": float(len(session.turns)),
        "samples": float(len(samples)),
    }
    *earlier, last = samples
    last.turns = Transcript(session.turns, reward, failure, stats)
    last.text = "".join(session.turns)
    last.earlier = earlier
    return last
