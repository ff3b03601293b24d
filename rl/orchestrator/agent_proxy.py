"""The agents' OpenAI endpoint: one session per episode, each kept as token ids.

rl/orchestrator/agents.py runs the user's agent per episode against `AgentProxy`, which this module
holds: a loopback server in the orchestrator whose sessions (`Session`) turn an episode's chat
requests into exact token sequences (the rules are in rl/orchestrator/agents.py's docstring and
docs/agents.md), and send each model turn on to the run's inference servers as token ids.

Each episode has a key of its own, valid for its session only and only while it is open: one
agent cannot write into another's episode. A request's body is bounded by what the served
length could hold (a larger one is refused, 413, before it is read whole), and its messages are
rendered and tokenized off the event loop, so one large request delays no other episode.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from rl.core.chat import (
    ChatTemplate,
    ToolsError,
    check_tool_calls,
    check_tools,
    parsed_arguments,
)
from rl.core.records import Completion, Episode
from rl.inference.generation import Sample
from rl.inference.openai_api import (
    APIError,
    ChatCompletions,
    ChatRequest,
    Result,
    chat_messages,
    check_supported,
    check_text,
    install_errors,
    served_model,
)


def _same(message: dict[str, Any]) -> tuple:
    """A message as compared against the history: role, text, and calls by name and arguments
    (call ids and JSON spacing do not matter)."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {})
        args = parsed_arguments(function.get("arguments"))
        calls.append((function.get("name"), json.dumps(args, sort_keys=True)))
    return (message["role"], message.get("content") or "", tuple(calls))


class Session:
    """One episode's conversation as token ids (module docstring)."""

    def __init__(self, template: ChatTemplate, on_drift: str, deadline: float) -> None:
        self.template, self.on_drift, self.deadline = template, on_drift, deadline
        self.closed: list[Episode] = []
        self.current: Episode | None = None
        self.history: list[tuple] = []
        self.tools: list[dict] | None = None
        self.turns: list[str] = []
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
        self.current = Episode(self.template.encode(text), multi_turn=True)
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
        self.current.add_other(ids)
        self.history += [_same(m) for m in added]
        return self.current.prompt_ids + self.current.completion_ids

    def record(self, completion: Completion, message: dict[str, Any]) -> None:
        """A model turn: its exact tokens, and the assistant message the agent was sent."""
        assert self.current is not None
        self.current.add_model_turn(completion)
        self.finish_reason = completion.finish_reason
        self.last_token = completion.token_ids[-1] if completion.token_ids else None
        self.turns.append(completion.text)
        self.history.append(_same(message))

    def state(self) -> Any:
        """What a turn changes, to put back if it fails."""
        return copy.deepcopy((self.closed, self.current, self.history, self.tools, self.drift))

    def restore(self, state: Any) -> None:
        self.closed, self.current, self.history, self.tools, self.drift = state

    def samples(self) -> list[Episode]:
        """The episode's samples, oldest first: those closed by drift, then the current one
        (each with the model tokens it holds; one without any is left out)."""
        every = [*self.closed, *([self.current] if self.current else [])]
        return [s for s in every if s.model_tokens]


class AgentProxy:
    """The agents' OpenAI endpoint: one session per episode, each model turn sent on to the
    inference servers as token ids (rl/orchestrator/loop.py's InferenceClient)."""

    def __init__(self, inference: Any, tokenizer: Any, max_len: int, args: Any) -> None:
        """`args`: the episodes' settings (rl/orchestrator/agents.py's AgentArgs: max_turns,
        concurrency, timeouts, on_drift)."""
        self.inference, self.max_len, self.args = inference, max_len, args
        self.template = ChatTemplate(tokenizer)
        self.tokenizer = tokenizer
        self.model_name = inference.model
        self.sessions: dict[str, tuple[Session, dict[str, Any], str]] = {}
        self.url = ""
        # Model turns wait on the inference servers in threads: one per concurrent episode, so
        # the servers see every open episode's turn at once and batch them.
        self.pool = ThreadPoolExecutor(args.concurrency, thread_name_prefix="proxy")
        self._turn = 0
        # The agents' side: one connection pool for every episode's client (Task.client).
        self.http = SharedPool(
            timeout=args.request_timeout_s,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=args.concurrency),
        )

    def start(self) -> None:
        """Serve on a loopback port from a daemon thread; returns once it accepts requests."""
        import uvicorn

        from rl.core.runtime import listen_socket

        sock = listen_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app(), log_config=None, log_level="warning", access_log=False)
        server = uvicorn.Server(config)
        threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        while not server.started:
            time.sleep(0.02)

    def open(self, sampling: dict[str, Any]) -> tuple[str, str]:
        """A new episode's session: its id and its own key."""
        sid, key = secrets.token_hex(12), secrets.token_urlsafe(24)
        deadline = time.monotonic() + self.args.episode_timeout_s
        session = Session(self.template, self.args.on_drift, deadline)
        self.sessions[sid] = (session, sampling, key)
        return sid, key

    def close(self, sid: str) -> Session:
        """End an episode's session: its key opens nothing from now on."""
        session, _, _ = self.sessions.pop(sid)
        session.ended = True
        return session

    def app(self) -> FastAPI:
        from rl.inference.server import BodyLimit, body_limit

        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        app.add_middleware(BodyLimit, limit=body_limit(self.max_len, 1))
        install_errors(app)

        @app.get("/s/{sid}/v1/models")
        async def models(sid: str, request: Request) -> dict[str, Any]:
            self._session(sid, request)
            entry = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "relay"}
            entry["max_model_len"] = self.max_len
            return {"object": "list", "data": [entry]}

        @app.post("/s/{sid}/v1/chat/completions")
        async def chat(sid: str, body: ChatRequest, request: Request) -> Any:
            return await self.turn(sid, body, request)

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

    def served(self) -> list[str]:
        return [self.model_name]

    def _session(self, sid: str, request: Request) -> tuple[Session, dict[str, Any]]:
        """The open session `sid`, if the request holds its key (401 otherwise; 404 for a
        session that is not open)."""
        if sid not in self.sessions:
            raise APIError(404, f"no open episode {sid!r} (ended, timed out, or never opened)")
        session, sampling, key = self.sessions[sid]
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {key}".encode()):
            raise APIError(401, "missing or wrong 'Authorization: Bearer <the episode's key>'")
        return session, sampling

    async def turn(self, sid: str, body: ChatRequest, request: Request) -> Any:
        session, sampling = self._session(sid, request)
        check_text(body)
        served_model(body, self)
        check_supported(body)
        if body.n != 1:
            raise APIError(400, "n: an episode's turn has one choice", "n")
        async with session.lock:
            if len(session.turns) >= self.args.max_turns:
                raise APIError(400, f"the episode has had its {self.args.max_turns} model turns")
            messages = chat_messages(body.messages)
            tools = body.tools if body.tool_choice != "none" else None
            try:  # before the session compares them with its history
                check_tools(tools)
                check_tool_calls(messages)
            except ToolsError as err:
                raise APIError(400, str(err), err.param) from None
            before = session.state()  # a turn that fails leaves the episode as it was
            try:
                answer, result, ids, completion = await self._answer(
                    session, sampling, body, messages, tools
                )
            except BaseException:
                session.restore(before)
                raise
            session.record(completion, answer["choices"][0]["message"])
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
    ) -> tuple[dict[str, Any], Result, list[int], Completion]:
        """One model turn: the prompt from the session (rendered and tokenized in a thread),
        the sample, the chat answer."""
        ids = await asyncio.to_thread(session.prompt, messages, tools)
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
        completion = await self._sample(ids, max_tokens, sampling, body, remaining)
        sample = Sample(completion.token_ids, completion.logprobs, completion.finish_reason)
        result = Result(completion.min_version, completion.max_version, [sample])
        answer = ChatCompletions(self, body).response([ids], result)
        return answer, result, ids, completion

    async def _sample(
        self, ids: list[int], max_tokens: int, sampling: dict, body: ChatRequest, budget: float
    ) -> Completion:
        stop = body.stops()
        self._turn += 1
        server = self._turn % len(self.inference.servers)
        call = asyncio.get_running_loop().run_in_executor(
            self.pool, self.inference.complete, server, [ids], 1, max_tokens,
            sampling["temperature"], list(stop),
        )  # fmt: skip
        try:
            done = await asyncio.wait_for(call, min(budget, self.args.request_timeout_s))
        except TimeoutError as exc:
            raise APIError(504, "the model turn took longer than the request timeout") from exc
        return done[0]


class SharedPool(httpx.Client):
    """The episodes' one HTTP connection pool to the proxy: an agent that closes its client
    (`with task.client() as api:`) leaves the pool open for the others."""

    def close(self) -> None:
        pass


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
