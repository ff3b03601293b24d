"""Bring your own agent: any program that talks to an OpenAI `base_url` becomes an environment.

`environment=agent` (conf/environment/agent.yaml; `experiment=wordle_agent` runs it) runs the
user's agent once per episode: a Python callable (`module:function` or
`path/to/file.py:function`) in a thread of the orchestrator, or a program (`command`) in a
process of its own. Each episode gets its own base URL,
`http://127.0.0.1:<port>/s/<session>/v1`, served by the `AgentProxy` below, which sits in front
of the run's inference servers.

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
turns. An agent that raises, returns garbage, or overruns `episode_timeout_s` ends its episode
with reward 0 and a logged reason; the run goes on. A callable that never returns cannot be
stopped from Python: its session is closed (its next request fails) and its thread abandoned;
a `command` agent's whole process group is killed.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import importlib.util
import json
import logging
import math
import os
import secrets
import signal
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from rl.auth import bearer_guard
from rl.chat import ChatTemplate
from rl.envs import Environment, Example, check_args, make_environment
from rl.generation import Sample
from rl.openai_api import (
    APIError,
    ChatCompletions,
    ChatRequest,
    Result,
    chat_messages,
    check_supported,
    install_errors,
    served_model,
)

ROOT = Path(__file__).resolve().parent.parent
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
    task_args: dict = field(default_factory=dict)
    """`environment.args` of the tasks environment."""
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
    model: str
    prompt: str
    answer: str
    info: dict[str, Any]
    max_tokens: int
    """Tokens per model turn."""


class Transcript(list):
    """The model's turns (assistant texts), with how the episode ended: what the orchestrator
    scores and the environment reads its reward from."""

    def __init__(self, turns: list[str], reward: float | None, failure: str, stats: dict) -> None:
        super().__init__(turns)
        self.reward, self.failure, self.stats = reward, failure, stats


# --- the proxy ---------------------------------------------------------------------------


@dataclass
class Segment:
    """One training sample of an episode: its prompt, then model and added tokens."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    env_spans: list[list[int]] = field(default_factory=list)
    model_tokens: int = 0

    def add(self, ids: list[int], logprobs: list[float] | None) -> None:
        if logprobs is None:  # added by the agent: no loss
            self.env_spans.append([len(self.ids), len(self.ids) + len(ids)])
            logprobs = [0.0] * len(ids)
        else:
            self.model_tokens += len(ids)
        self.ids += ids
        self.logprobs += logprobs

    def as_sample(self) -> dict[str, Any]:
        return {
            "prompt_token_ids": self.prompt_ids,
            "token_ids": self.ids,
            "logprobs": {"token_logprobs": self.logprobs},
            "env_spans": self.env_spans,
        }


def _same(message: dict[str, Any]) -> tuple:
    """A message as compared against the history: role, text, and calls by name and arguments
    (call ids and JSON spacing do not matter)."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {})
        args = function.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass
        calls.append((function.get("name"), json.dumps(args, sort_keys=True)))
    return (message["role"], message.get("content") or "", tuple(calls))


class Session:
    """One episode's conversation as token ids (module docstring)."""

    def __init__(self, template: ChatTemplate, on_drift: str, deadline: float) -> None:
        self.template, self.on_drift, self.deadline = template, on_drift, deadline
        self.closed: list[Segment] = []
        self.current: Segment | None = None
        self.history: list[tuple] = []
        self.tools: list[dict] | None = None
        self.turns: list[str] = []
        self.versions: list[int] = []
        self.finish_reason = "stop"
        self.last_token: int | None = None
        self.drift = 0
        self.ended = False
        self.lock = asyncio.Lock()

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """The token ids to continue from for this request's messages (recorded)."""
        seen = [_same(m) for m in messages]
        if self.current is None:
            return self._start(messages, tools)
        if tools == self.tools and seen[: len(self.history)] == self.history:
            return self._continue(messages[len(self.history) :], tools)
        self.drift += 1
        if self.on_drift == "keep_sampled":
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
            if last >= 0:
                return self._continue(messages[last + 1 :], tools)
        self.closed.append(self.current)
        return self._start(messages, tools)

    def _start(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        text = self.template.render(messages, tools, generation=True)
        self.current = Segment(self.template.encode(text))
        self.tools = tools
        self.history = [_same(m) for m in messages]
        return list(self.current.prompt_ids)

    def _continue(self, added: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        assert self.current is not None
        ids = []
        eos = self.template.tokenizer.eos_token_id
        if self.last_token != eos:  # a turn cut short (max_tokens, a stop string) is closed
            ids.append(eos)
        ids += self.template.encode(self.template.after_turn(added, tools))
        self.current.add(ids, None)
        self.history += [_same(m) for m in added]
        return self.current.prompt_ids + self.current.ids

    def record(self, sample: Sample, version: int, message: dict[str, Any], text: str) -> None:
        """A model turn: its exact tokens, and the assistant message the agent was sent."""
        assert self.current is not None
        self.current.add(list(sample.token_ids), list(sample.logprobs))
        self.finish_reason = sample.finish_reason
        self.last_token = sample.token_ids[-1] if sample.token_ids else None
        self.versions.append(version)
        self.turns.append(text)
        self.history.append(_same(message))

    def state(self) -> Any:
        """What a turn changes, to put back if it fails."""
        return copy.deepcopy((self.closed, self.current, self.history, self.tools, self.drift))

    def restore(self, state: Any) -> None:
        self.closed, self.current, self.history, self.tools, self.drift = state

    def segments(self) -> list[Segment]:
        every = [*self.closed, *([self.current] if self.current else [])]
        return [s for s in every if s.model_tokens]


class AgentProxy:
    """The agents' OpenAI endpoint: one session per episode, each model turn sent on to the
    inference servers as token ids (rl/orchestrator.py's InferenceClient)."""

    def __init__(self, inference: Any, tokenizer: Any, max_len: int, args: AgentArgs) -> None:
        self.inference, self.max_len, self.args = inference, max_len, args
        self.template = ChatTemplate(tokenizer)
        self.tokenizer = tokenizer
        self.model_name = inference.model
        self.key = secrets.token_urlsafe(24)
        self.sessions: dict[str, tuple[Session, dict[str, Any]]] = {}
        self.url = ""
        # Model turns wait on the inference servers in threads: one per concurrent episode, so
        # the servers see every open episode's turn at once and batch them.
        self.pool = ThreadPoolExecutor(args.concurrency, thread_name_prefix="proxy")
        self._turn = 0

    def start(self) -> None:
        """Serve on a loopback port from a daemon thread; returns once it accepts requests."""
        import uvicorn

        from rl.runtime import listen_socket

        sock = listen_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app(), log_config=None, log_level="warning", access_log=False)
        server = uvicorn.Server(config)
        threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        while not server.started:
            time.sleep(0.02)

    def open(self, sampling: dict[str, Any]) -> str:
        sid = secrets.token_hex(12)
        deadline = time.monotonic() + self.args.episode_timeout_s
        self.sessions[sid] = (Session(self.template, self.args.on_drift, deadline), sampling)
        return sid

    def close(self, sid: str) -> Session:
        session, _ = self.sessions.pop(sid)
        session.ended = True
        return session

    def app(self) -> FastAPI:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        install_errors(app)
        guard = bearer_guard(self.key)

        @app.get("/s/{sid}/v1/models")
        async def models(sid: str, request: Request) -> dict[str, Any]:
            guard(request)
            self._session(sid)
            entry = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "relay"}
            entry["max_model_len"] = self.max_len
            return {"object": "list", "data": [entry]}

        @app.post("/s/{sid}/v1/chat/completions")
        async def chat(sid: str, body: ChatRequest, request: Request) -> Any:
            guard(request)
            return await self.turn(sid, body)

        @app.post("/s/{sid}/v1/completions")
        async def completions(sid: str, request: Request) -> None:
            raise APIError(
                400,
                "an agent's episode is a chat: send /v1/chat/completions (the proxy keeps the "
                "conversation's tokens)",
                None,
                "unsupported_endpoint",
            )

        return app

    def _session(self, sid: str) -> tuple[Session, dict[str, Any]]:
        if sid not in self.sessions:
            raise APIError(404, f"no open episode {sid!r} (ended, timed out, or never opened)")
        return self.sessions[sid]

    async def turn(self, sid: str, body: ChatRequest) -> Any:
        session, sampling = self._session(sid)
        served_model(body, self)
        check_supported(body)
        if body.n != 1:
            raise APIError(400, "n: an episode's turn has one choice", "n")
        async with session.lock:
            if len(session.turns) >= self.args.max_turns:
                raise APIError(400, f"the episode has had its {self.args.max_turns} model turns")
            messages = chat_messages(body.messages)
            tools = body.tools if body.tool_choice != "none" else None
            before = session.state()  # a turn that fails leaves the episode as it was
            try:
                answer, result, ids, text = await self._answer(
                    session, sampling, body, messages, tools
                )
            except BaseException:
                session.restore(before)
                raise
            session.record(result.samples[0], result.version, answer["choices"][0]["message"], text)
        if body.stream:
            replay = ChatCompletions(Replayed(self, result), body)
            events = replay.events([ids], replay.params(1, 0))
            return StreamingResponse(events, media_type="text/event-stream")
        return {**answer, "relay_sampling": sampling}

    async def _answer(
        self,
        session: Session,
        sampling: dict[str, Any],
        body: ChatRequest,
        messages: list[dict[str, Any]],
        tools: list[dict] | None,
    ) -> tuple[dict[str, Any], Result, list[int], str]:
        """One model turn: the prompt from the session, the sample, the chat answer."""
        ids = session.prompt(messages, tools)
        max_tokens = min(
            sampling["max_tokens"], body.max_completion_tokens or body.max_tokens or 1 << 30
        )
        if len(ids) + max_tokens > self.max_len:
            raise APIError(
                400,
                f"the conversation is {len(ids)} tokens; with max_tokens={max_tokens} it "
                f"passes the context length {self.max_len}",
                "messages",
                "context_length_exceeded",
            )
        remaining = session.deadline - time.monotonic()
        if remaining <= 0:
            raise APIError(408, "the episode ran past environment.args.episode_timeout_s")
        choice, version = await self._sample(ids, max_tokens, sampling, body, remaining)
        sample = Sample(choice["token_ids"], choice["logprobs"]["token_logprobs"],
                        choice["finish_reason"])  # fmt: skip
        result = Result(version, version, [sample])
        answer = ChatCompletions(self, body).response([ids], result)
        return answer, result, ids, choice["text"]

    async def _sample(
        self, ids: list[int], max_tokens: int, sampling: dict, body: ChatRequest, budget: float
    ) -> tuple[dict[str, Any], int]:
        stop = body.stops()
        self._turn += 1
        server = self._turn % len(self.inference.servers)
        call = asyncio.get_running_loop().run_in_executor(
            self.pool, self.inference.complete, server, [ids], 1, max_tokens,
            sampling["temperature"], list(stop),
        )  # fmt: skip
        try:
            response = await asyncio.wait_for(call, min(budget, self.args.request_timeout_s))
        except TimeoutError as exc:
            raise APIError(504, "the model turn took longer than the request timeout") from exc
        return response["choices"][0], response["policy_version"]


class Replayed:
    """A finished turn as a stream backend: its tokens replayed as chunks (the proxy samples a
    turn whole before it can record it)."""

    def __init__(self, proxy: AgentProxy, result: Result) -> None:
        self.model_name, self.tokenizer = proxy.model_name, proxy.tokenizer
        self.result = result

    async def stream(self, prompts: list[list[int]], params: Any) -> Any:
        for token in self.result.samples[0].token_ids:
            yield [(0, [token])]
        yield self.result


# --- running agents ----------------------------------------------------------------------


def load_agent(spec: str) -> Any:
    """The callable `module:function` or `path/to/file.py:function` names."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(
            f"environment.args.agent={spec!r}: expected module:function or file.py:function"
        )
    if where.endswith(".py"):
        path = next((p for p in (Path(where), ROOT / where) if p.is_file()), None)
        if path is None:
            raise ValueError(f"environment.args.agent={spec!r}: no file {where} here or in {ROOT}")
    try:
        if where.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location(f"relay_agent_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except Exception as exc:  # the user's module: any error it raises on import
        raise ValueError(
            f"environment.args.agent={spec!r}: importing {where} failed: {exc!r}"
        ) from None
    agent = getattr(module, name, None)
    if not callable(agent):
        raise ValueError(f"environment.args.agent={spec!r}: {name} is not a function of {where}")
    return agent


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
        **os.environ,
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
        locate(args.tasks)
    except ValueError as err:
        raise ValueError(f"environment.args.tasks={args.tasks}: {err}") from None
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
        return self.tasks.score(example, list(completion))

    def exact_match(self, example: Example, completion: Transcript) -> bool:
        if completion.failure:
            return False
        if completion.reward is not None:
            return completion.reward >= self.reward_range[1]
        return self.tasks.exact_match(example, list(completion))

    def metrics(self, example: Example, completion: Transcript) -> dict[str, float]:
        return completion.stats

    def rollouts(
        self, inference: Any, examples: list[Example], n: int, temperature: float, max_len: int
    ) -> list[dict[str, Any] | None]:
        """`n` episodes per example (example-major) as completion choices; None for an
        episode in which the model never spoke (nothing to train on)."""
        if self.proxy is None:
            self.proxy = AgentProxy(inference, self.tokenizer, max_len, self.args)
            self.proxy.start()
        plays = [e for e in examples for _ in range(n)]
        sampling = {"temperature": temperature, "max_tokens": self.max_tokens, "n": 1}
        with ThreadPoolExecutor(min(self.args.concurrency, len(plays))) as pool:
            return list(pool.map(lambda e: self.episode(e, sampling), plays))

    def episode(self, example: Example, sampling: dict[str, Any]) -> dict[str, Any] | None:
        assert self.proxy is not None
        sid = self.proxy.open(sampling)
        task = Task(
            f"{self.proxy.url}/s/{sid}/v1", self.proxy.key, self.proxy.model_name,
            example.prompt, example.answer, dict(example.info), self.max_tokens,
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
        return as_choice(session, reward, failure)


def tasks_config(env_cfg: Any, args: AgentArgs) -> Any:
    """The tasks environment's config: this one's, with its name and `task_args`."""
    from dataclasses import is_dataclass, replace

    from omegaconf import OmegaConf

    if is_dataclass(env_cfg):
        return replace(env_cfg, name=args.tasks, args=dict(args.task_args))
    inner = OmegaConf.to_container(env_cfg, resolve=True)
    inner.update(name=args.tasks, args=dict(args.task_args))
    return OmegaConf.create(inner)


def as_choice(session: Session, reward: float | None, failure: str) -> dict[str, Any] | None:
    """An ended episode in the shape of a completion choice (rl/orchestrator.py's
    `score_group`): its last sample, with the earlier ones (after drift) as `segments`."""
    segments = session.segments()
    if not segments:
        return None
    stats = {
        "template_drift": float(session.drift),
        "agent_failed": float(bool(failure)),
        "agent_timeout": float("timed out" in failure),
        "turns": float(len(session.turns)),
        "samples": float(len(segments)),
    }
    *earlier, last = segments
    return {
        **last.as_sample(),
        "text": "".join(session.turns),
        "turns": Transcript(session.turns, reward, failure, stats),
        "segments": [s.as_sample() for s in earlier],
        "policy_version": min(session.versions),
        "policy_version_max": max(session.versions),
        "finish_reason": session.finish_reason,
    }
