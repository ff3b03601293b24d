"""OpenAI's completions and chat completions API, over either inference backend.

Both servers (the embedded engine, rl/inference/server.py, and the front of vLLM,
rl/inference/vllm/front.py) register these routes with a `Backend`: something that turns token-id
prompts and sampling settings into sampled tokens, whole or streamed. Everything else is here, once:
request checking, chat templates and tool calls (rl/core/chat.py), stop strings, logprobs, usage,
errors and server-sent events, so the official `openai` client sees the same API from both.

- `/v1/models` lists the served model. A request naming any other model gets a 400.
- Supported: `n`, `max_tokens` (`max_completion_tokens` in chat), `temperature`, `top_p`,
  `seed`, `stop`, `logprobs`/`top_logprobs`, `stream` (with `stream_options.include_usage`),
  and in chat `tools` with `tool_choice` "auto" or "none".
- Anything else is refused with a 400 in OpenAI's error shape (`{"error": {"message", "type",
  "param", "code"}}`; Relay's own clients read the same text as `detail`): an unknown field,
  and a known one this server cannot honour (`frequency_penalty`, `logit_bias`, `echo`, ...)
  unless it is sent at its no-op default. So are a number field sent as Infinity or NaN, and
  text that is not whole Unicode characters anywhere in a request (a lone surrogate such as
  "\\ud800", which JSON can spell but UTF-8 cannot encode): each names its field.
- Refusals cost little. A text longer than the served length could ever hold is refused (400,
  naming the bound) before it is tokenized or templated: by its UTF-8 bytes against the context
  length times the most bytes one token stands for (`prompt_byte_limit`); a chat counts its
  messages' contents, its tool calls and its tools' strings. Token-id prompts are measured as
  they are.
- Each API key may have `inference.api_rows_per_key` rows (prompts x n) queued or decoding at
  once (`KeyShares`): a request past it is refused (429, Retry-After) before it is tokenized.
  The run's own rollouts (rl/core/auth.py) are not counted; the embedded engine also serves
  them first, between the steps of API clients' batches, and keeps those to
  `inference.api_share` of its time while the run generates (rl/inference/engine.py).
- A streamed response writes each decoding step's events at once, whatever `n`.
- A request whose client disconnects (or times out) is cancelled, streamed or not: the backend
  drops it (the embedded engine its rows, vLLM its sequences) instead of decoding for nobody,
  and its key's share is given back.
- A sleeping server (colocated placement, while the trainer runs) refuses completions: 503.
- Relay's extensions ride on every choice: `prompt_token_ids` and `token_ids` (the exact
  tokens; the trainer's inputs), and on the response `policy_version` (and
  `policy_version_max`: a request in flight during a weight swap on vLLM spans two).
- Logprobs are the policy's: the temperature-scaled distribution before top_p narrows it.
- Text prompts are encoded as `encode_prompt` does (BOS, then the text); token-id prompts are
  used as they are (multi-turn rollouts send their own).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Annotated, Any, ClassVar, Protocol, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from rl.core.chat import CALL_OPEN, ChatTemplate, parse_turn
from rl.core.model import encode_prompt
from rl.inference.generation import Limits, Sample

MAX_TOP_LOGPROBS = 20
ASLEEP = (
    "the server is asleep (its weights' memory given back while the trainer runs): "
    "POST /admin/wake_up, or load weights, first"
)
"""Why a sleeping server (either backend) refuses completions (503)."""


@dataclass(frozen=True)
class Params:
    """What a backend samples with: `n` choices per prompt, up to `max_tokens` each."""

    n: int
    max_tokens: int
    temperature: float
    seed: int | None
    limits: Limits
    model: str = ""
    """The served name asked for ("": the server's model); a LoRA server's adapters each have
    one."""
    kv_transfer: dict[str, Any] | None = None
    """vLLM's `kv_transfer_params`: a prefill/decode replica's KV hand-over
    (rl/inference/router.py)."""
    seeds: tuple[int, ...] | None = None
    """A seed per prompt (Relay's extension), instead of `seed`."""
    rollout: bool = False
    """Sent with the run's rollout key (the orchestrator's): served ahead of API clients'
    requests queued at the same time (rl/core/auth.py)."""


@dataclass
class Result:
    """Sampled choices, prompt-major (index = prompt * n + sample), and the policy versions
    that produced them."""

    version: int
    version_max: int
    samples: list[Sample]
    kv_transfer: dict[str, Any] | None = None
    """What a prefill instance answers for its decode instance (vLLM's `kv_transfer_params`)."""


Deltas = list[tuple[int, list[int]]]
"""Streamed progress: (choice index, its new token ids)."""


class Backend(Protocol):
    model_name: str
    tokenizer: Any
    max_len: int
    max_rows: int | None
    """Most prompts x n per request (None: no limit of its own)."""
    vocab_size: int
    asleep: bool
    """Whether the server sleeps (colocated placement: the trainer's turn): completions are
    then refused (503) before anything is queued."""
    rows_per_key: int | None
    """Most rows (prompts x n) one API key may have queued or decoding at once
    (`inference.api_rows_per_key`; None: no bound); the run's rollouts are not counted."""

    def served(self) -> list[str]:
        """The names requests may ask for: the model's, then any adapter's."""
        ...

    async def generate(self, prompts: list[list[int]], params: Params) -> Result: ...

    def stream(self, prompts: list[list[int]], params: Params) -> AsyncIterator[Deltas | Result]:
        """Deltas as tokens are drawn, then the whole Result last."""
        ...


class APIError(HTTPException):
    """An error answered in OpenAI's shape; `param` names the offending field."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str = "",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(status, message, headers)
        self.param, self.code = param, code or None


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    error = {"message": message, "type": kind, "param": param, "code": code}
    return JSONResponse({"error": error, "detail": message}, status_code=status)


def install_errors(app: FastAPI) -> None:
    """Every error of `app` in OpenAI's shape; a malformed body is a 400 naming the field."""

    @app.exception_handler(HTTPException)
    async def http_error(_: Any, exc: HTTPException) -> JSONResponse:
        param, code = getattr(exc, "param", None), getattr(exc, "code", None)
        response = error_body(exc.status_code, str(exc.detail), param, code)
        response.headers.update(exc.headers or {})  # a 429's Retry-After
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Any, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = [str(p) for p in first["loc"] if p != "body"]
        reasons = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        message = "; ".join(reasons)
        if first["type"] == "extra_forbidden":
            message = f"{'.'.join(where)}: not supported by Relay's server; " + message
        return error_body(400, message, ".".join(where) or None, first["type"])


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Request(BaseModel):
    """Fields both endpoints share; any field not declared here is refused, and so is a number
    field sent as Infinity or NaN (which Python's JSON reads)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    """Seeds the request's own generator; torch takes seeds below 2**63."""
    seeds: list[Annotated[int, Field(ge=0, lt=2**63)]] | None = None
    """Relay's extension: a seed per prompt, so that each prompt's samples are a function of
    its seed alone, whatever the request holds beside it (`seed` then does nothing)."""
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """An end-user id, as OpenAI takes it; it changes nothing."""
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = True
    """Relay's extension (vLLM's name for it): token ids are always returned."""
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's extension, passed to it: the KV hand-over between a prefill/decode replica's
    instances, which Relay's router sends (rl/inference/router.py)."""

    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "logit_bias": None,
    }
    """Fields accepted only at their no-op value: the sampling they would change is not built."""

    def refused(self) -> tuple[str, Any] | None:
        """The first field set to something this server does not do, and its value."""
        for name, default in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if value not in (default, None) and value != {}:
                return name, value
        return None

    def stops(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stop):
            raise APIError(400, "stop: empty strings cannot be stop strings", "stop")
        return tuple(stop)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    """Text, texts, token ids, or a list of token-id lists (multi-turn rollouts send ids)."""
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        **_Request.UNSUPPORTED,
        "echo": False,
        "suffix": None,
        "best_of": None,
    }


class ChatRequest(_Request):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict[str, Any] | None = None
    UNSUPPORTED: ClassVar[dict[str, Any]] = {**_Request.UNSUPPORTED, "parallel_tool_calls": True}

    def refused(self) -> tuple[str, Any] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", f"{self.top_logprobs} without logprobs=true"
        if self.tool_choice not in (None, "auto", "none"):
            return "tool_choice", self.tool_choice  # no constrained decoding here
        if self.response_format not in (None, {"type": "text"}):
            return "response_format", self.response_format
        return super().refused()


def check_text(body: _Request) -> None:
    """Refuse (400, naming the field) a string anywhere in the request that is not whole
    Unicode characters: JSON's escapes can spell a lone surrogate ("\\ud800"), which no
    tokenizer, and no UTF-8 encoder on the way to vLLM, accepts."""
    for name in type(body).model_fields:
        if (where := _unencodable(getattr(body, name), name)) is not None:
            raise APIError(
                400,
                f"{where}: not valid Unicode text (it holds a lone surrogate, such as \\ud800, "
                "which UTF-8 cannot encode); send whole characters",
                where,
                "invalid_text",
            )


def _unencodable(value: Any, where: str) -> str | None:
    """Where in `value` (a JSON value) the first string UTF-8 cannot encode is, or None."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, dict):
        for key, item in value.items():
            if _unencodable(key, where) is not None:
                return f"{where} (a key)"
            if (found := _unencodable(item, f"{where}.{key}")) is not None:
                return found
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if (found := _unencodable(item, f"{where}[{i}]")) is not None:
                return found
    return None


def served_model(body: _Request, backend: Backend) -> None:
    if body.model not in (None, "", *(names := backend.served())):
        raise APIError(
            400,
            f"model {body.model!r} is not served here; this server serves "
            f"{', '.join(repr(n) for n in names)}",
            "model",
            "model_not_found",
        )


def check_supported(body: _Request) -> None:
    if refused := body.refused():
        name, value = refused
        raise APIError(
            400,
            f"{name}={value!r} is not supported by Relay's server; leave it unset",
            name,
            "unsupported_parameter",
        )


def most_token_bytes(tokenizer: Any) -> int:
    """The most bytes of text one token of `tokenizer` can stand for: the longest, in UTF-8,
    of its vocabulary's strings and of its tokens each decoded alone, special tokens included
    (a prompt's text may spell them). A vocabulary string never holds fewer bytes than the text
    it matches in byte-level BPE (a byte is one character of one or two bytes), SentencePiece
    ("▁" is three bytes for a space, "<0x0A>" six for one byte) or a character vocabulary;
    decoding covers a vocabulary whose strings are not text. The bound assumes what those
    tokenizers do: each character of a prompt ends up in some token, none is dropped."""
    ids = list(range(len(tokenizer)))
    spelled = tokenizer.convert_ids_to_tokens(ids)
    decoded = tokenizer.batch_decode(
        [[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    return max(len(text.encode()) for text in (*spelled, *decoded) if text)


def prompt_byte_limit(backend: Backend) -> int:
    """The most UTF-8 bytes of text a prompt the backend serves can hold: its context length
    times the most bytes one token stands for. A longer text never fits, whatever it says."""
    return backend.max_len * most_token_bytes(backend.tokenizer)


def check_text_bytes(sizes: list[tuple[str, int]], limit: int, backend: Backend) -> None:
    """Refuse (400, naming the bound) a text that cannot fit, before anything tokenizes it;
    `sizes`: where each text is, and its UTF-8 bytes."""
    for where, size in sizes:
        if size > limit:
            raise APIError(
                400,
                f"{where}: {size} bytes of text, more than the context length of "
                f"{backend.max_len} tokens can hold (at most {limit} bytes with this tokenizer); "
                "send a shorter text",
                where.split("[")[0],
                "context_length_exceeded",
            )


def prompt_bytes(prompt: Any) -> list[tuple[str, int]]:
    """Where each text among a completions request's prompts is, and its UTF-8 bytes
    (token-id prompts are measured in tokens, once they are checked)."""
    if isinstance(prompt, str):
        return [("prompt", len(prompt.encode()))]
    return [(f"prompt[{i}]", len(p.encode())) for i, p in enumerate(prompt) if isinstance(p, str)]


def chat_bytes(body: ChatRequest) -> list[tuple[str, int]]:
    """The UTF-8 bytes a chat's prompt holds at the least: its messages' contents (text parts
    included) and the names and arguments of their tool calls, and, when offered, every string
    of its tools (templates write calls and tools out whole, tools as JSON)."""
    size = 0
    for message in body.messages:
        if not isinstance(message, dict):
            continue
        content, calls = message.get("content"), message.get("tool_calls")
        for part in content if isinstance(content, list) else [content]:
            text = part.get("text") if isinstance(part, dict) else part
            size += len(text.encode()) if isinstance(text, str) else 0
        for call in calls if isinstance(calls, list) else []:
            size += sum(len(s.encode()) for s in _strings(_function(call)))
    tools = body.tools if body.tool_choice != "none" else None
    return [("messages", size + sum(len(s.encode()) for s in _strings(tools)))]


def _function(call: Any) -> dict[str, Any]:
    """A tool call's name and arguments, as a template writes them ({} in any other shape)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return {}
    return {k: function[k] for k in ("name", "arguments") if k in function}


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value, object keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


class KeyShares:
    """The rows (prompts x n) each API key has queued or decoding, at most `per_key` a key: a
    request that would take its key past that is refused (429, with Retry-After) before it is
    tokenized, so that no client holds more than its share of the server, and a flood of
    requests costs a refusal each. The run's own rollouts (the rollout scope's key) are never
    counted (the routes do not ask): they are the run. A request gives its rows back when it
    is answered, refused or dropped (its client gone)."""

    RETRY_AFTER_S = 1

    def __init__(self, per_key: int | None) -> None:
        self.per_key = per_key
        self.held: dict[str, int] = {}
        """Rows held, by key (the request's Authorization header); only keys holding some."""

    def take(self, request: Request, rows: int) -> Callable[[], None]:
        """Count `rows` against the request's key (APIError when they do not fit); the function
        that gives them back, once however often it is called."""
        if self.per_key is None:
            return _nothing
        if rows > self.per_key:
            raise APIError(
                400,
                f"{rows} rows (prompts x n) in one request, more than an API key may have "
                f"queued (inference.api_rows_per_key={self.per_key}); send fewer prompts or a "
                "smaller n",
                "n",
            )
        key = request.headers.get("authorization", "")
        held = self.held.get(key, 0)
        if held + rows > self.per_key:
            raise APIError(
                429,
                f"this API key has {held} rows (prompts x n) queued or decoding; {rows} more "
                f"would pass inference.api_rows_per_key={self.per_key}: retry once some are "
                "answered",
                None,
                "rate_limit_exceeded",
                {"Retry-After": str(self.RETRY_AFTER_S)},
            )
        self.held[key] = held + rows
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                if (left := self.held[key] - rows) > 0:
                    self.held[key] = left
                else:
                    del self.held[key]

        return give_back


def _nothing() -> None:
    pass


def _rollout(request: Request) -> bool:
    """Whether the request comes with the run's rollout key (the orchestrator's)."""
    return getattr(request.state, "scope", None) == "rollout"


def request_rows(prompt: Any, n: int) -> int:
    """The rows (prompts x n) a completions request asks for, counted without tokenizing."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return n  # one prompt
    return len(prompt) * n


def prompt_ids(tokenizer: Any, prompt: Any) -> list[list[int]]:
    """The request's prompts as token-id lists; text is encoded as `encode_prompt` does."""
    if isinstance(prompt, str):
        return [encode_prompt(tokenizer, prompt)]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return [p if isinstance(p, list) else encode_prompt(tokenizer, p) for p in prompt]


def check_prompts(
    ids: list[list[int]], n: int, max_tokens: int, backend: Backend, seeds: Any = None
) -> None:
    """Refuse (400) what cannot be served, before anything is queued."""
    if not ids:
        raise APIError(400, "prompt is an empty list; send a string or a non-empty list", "prompt")
    if seeds is not None and len(seeds) != len(ids):
        raise APIError(400, f"seeds: {len(seeds)} seeds for {len(ids)} prompts", "seeds")
    if backend.max_rows is not None and len(ids) * n > backend.max_rows:
        raise APIError(
            400,
            f"{len(ids)} prompts x n={n} exceeds inference.max_batch_size={backend.max_rows}",
            "n",
        )
    for i, prompt in enumerate(ids):
        if not prompt or len(prompt) + max_tokens > backend.max_len:
            total = f"{len(prompt)} tokens + max_tokens={max_tokens}"
            raise APIError(
                400,
                f"prompt {i}: {total} must be between 1 and the context length {backend.max_len}",
                "max_tokens" if prompt else "prompt",
            )
        if (bad := next((t for t in prompt if not 0 <= t < backend.vocab_size), None)) is not None:
            raise APIError(
                400,
                f"prompt {i}: token id {bad} is outside the vocabulary [0, {backend.vocab_size})",
                "prompt",
            )


def final_text(tokenizer: Any, sample: Sample, stops: tuple[str, ...]) -> str:
    """A choice's text: its tokens decoded (the closing end-of-sequence token left out), cut
    before the first stop string."""
    ids = sample.token_ids
    if ids and ids[-1] == tokenizer.eos_token_id and sample.finish_reason == "stop":
        ids = ids[:-1]
    return cut_at_stop(tokenizer.decode(ids, skip_special_tokens=True), stops)


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    ends = [i for s in stops if (i := text.find(s)) >= 0]
    return text[: min(ends)] if ends else text


def usage(ids: list[list[int]], samples: list[Sample]) -> dict[str, int]:
    prompt = sum(len(p) for p in ids)
    completion = sum(len(s.token_ids) for s in samples)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token])


def completion_logprobs(tokenizer: Any, sample: Sample, text: str) -> dict[str, Any]:
    tokens = [_token_text(tokenizer, t) for t in sample.token_ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(min(at, len(text)))
        at += len(token)
    top = None
    if sample.top is not None:
        top = [{_token_text(tokenizer, t): lp for t, lp in step} for step in sample.top]
    return {
        "tokens": tokens,
        "token_logprobs": sample.logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Any, sample: Sample) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for i, (token, logprob) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
        item = entry(token, logprob)
        item["top_logprobs"] = [entry(t, lp) for t, lp in (sample.top or [[]] * (i + 1))[i]]
        content.append(item)
    return {"content": content}


def _head(kind: str, model: str, version: int) -> dict[str, Any]:
    return {
        "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "policy_version": version,
    }


class Endpoint:
    """One request's handling: its prompts as ids, its sampling settings, and how a sampled
    choice becomes the response's choice."""

    kind = "text_completion"
    chunk_kind = "text_completion"
    held_back: str | None = None
    """Text from which a streamed choice is held back to the end (a tool call, in chat)."""

    def __init__(self, backend: Backend, body: _Request) -> None:
        self.backend, self.body = backend, body
        self.tokenizer = backend.tokenizer
        self.stop = body.stops()
        self.model = body.model or backend.model_name

    def params(self, max_tokens: int, top_logprobs: int) -> Params:
        limits = Limits(self.body.top_p, self.stop, top_logprobs)
        body = self.body
        seeds = getattr(body, "seeds", None)
        return Params(
            body.n,
            max_tokens,
            body.temperature,
            body.seed,
            limits,
            body.model or "",
            body.kv_transfer_params,
            tuple(seeds) if seeds is not None else None,
        )

    def choice(self, index: int, prompt: list[int], sample: Sample) -> dict[str, Any]:
        raise NotImplementedError

    def response(self, ids: list[list[int]], result: Result) -> dict[str, Any]:
        n = self.body.n
        choices = [self.choice(k, ids[k // n], s) for k, s in enumerate(result.samples)]
        head = _head(self.kind, self.model, result.version)
        head["policy_version_max"] = result.version_max
        if result.kv_transfer is not None:
            head["kv_transfer_params"] = result.kv_transfer
        return {**head, "choices": choices, "usage": usage(ids, result.samples)}

    async def events(self, ids: list[list[int]], params: Params) -> AsyncIterator[str]:
        """The streamed response as server-sent events, ending with `data: [DONE]`: each
        decoding step's events written at once (one write for all its choices, not one each:
        n=512 would cost 512 writes a step, and as many after the client has gone)."""
        streams = [TextStream(self.tokenizer, self.stop, self.held_back) for _ in ids * params.n]
        head = _head(self.chunk_kind, self.model, -1)
        # Closed here even when the client leaves at a yield: the backend drops the request.
        async with aclosing(self.backend.stream(ids, params)) as stream:
            async for item in stream:
                if isinstance(item, Result):
                    head["policy_version"] = item.version
                    events = []
                    for k, sample in enumerate(item.samples):
                        tail = streams[k].finish(sample)
                        last = self.last_chunk(k, ids[k // params.n], sample, tail)
                        events.append(_sse({**head, "choices": [last]}))
                    if self.body.stream_options and self.body.stream_options.include_usage:
                        events.append(
                            _sse({**head, "choices": [], "usage": usage(ids, item.samples)})
                        )
                    yield "".join(events)
                    break
                deltas = [(k, delta) for k, new in item if (delta := streams[k].feed(new))]
                if deltas:
                    yield "".join(_sse({**head, "choices": [self.chunk(k, d)]}) for k, d in deltas)
        yield "data: [DONE]\n\n"

    def chunk(self, index: int, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def last_chunk(self, index: int, prompt: list[int], sample: Sample, text: str) -> dict:
        raise NotImplementedError


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class TextStream:
    """A streamed choice's text, decoded as its tokens arrive. Text that may yet turn out to
    start a stop string (or the `held_back` marker) is kept until it cannot."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], held_back: str | None) -> None:
        self.tokenizer, self.stops, self.held_back = tokenizer, stops, held_back
        self.ids: list[int] = []
        self.sent = 0
        self.margin = max([len(s) for s in (*stops, held_back or "")], default=1) - 1

    def feed(self, new: list[int]) -> str:
        self.ids += new
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = len(cut_at_stop(text, self.stops))
        if self.held_back and (at := text.find(self.held_back)) >= 0:
            cut = min(cut, at)
        safe = min(cut, len(text) - self.margin)
        while safe > self.sent and text[safe - 1] == "\ufffd":  # a character not yet whole
            safe -= 1
        delta, self.sent = text[self.sent : max(safe, self.sent)], max(safe, self.sent)
        return delta

    def finish(self, sample: Sample) -> str:
        """The rest of the final text (the held-back marker's part excluded)."""
        text = final_text(self.tokenizer, sample, self.stops)
        if self.held_back and (at := text.find(self.held_back)) >= 0:
            text = text[:at]
        return text[self.sent :]


class Completions(Endpoint):
    body: CompletionRequest

    def choice(self, index: int, prompt: list[int], sample: Sample) -> dict[str, Any]:
        text = final_text(self.tokenizer, sample, self.stop)
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = completion_logprobs(self.tokenizer, sample, text)
        return {
            "index": index,
            "text": text,
            "finish_reason": sample.finish_reason,
            "logprobs": logprobs,
            "prompt_token_ids": prompt,
            "token_ids": sample.token_ids,
        }

    def chunk(self, index: int, text: str) -> dict[str, Any]:
        return {"index": index, "text": text, "finish_reason": None, "logprobs": None}

    def last_chunk(self, index: int, prompt: list[int], sample: Sample, text: str) -> dict:
        whole = self.choice(index, prompt, sample)
        return {**whole, "text": text}


class ChatCompletions(Endpoint):
    kind = "chat.completion"
    chunk_kind = "chat.completion.chunk"
    body: ChatRequest

    def __init__(self, backend: Backend, body: ChatRequest) -> None:
        super().__init__(backend, body)
        self.tools = body.tools if body.tool_choice != "none" else None
        self.held_back = CALL_OPEN if self.tools else None

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message of a choice's text, and whether it calls tools."""
        if not self.tools:
            return {"role": "assistant", "content": text}, False
        turn = parse_turn(text)
        message: dict[str, Any] = {"role": "assistant", "content": turn.content}
        if turn.tool_calls:
            message["tool_calls"] = turn.tool_calls
        return message, bool(turn.tool_calls)

    def choice(self, index: int, prompt: list[int], sample: Sample) -> dict[str, Any]:
        message, calls = self.message(final_text(self.tokenizer, sample, self.stop))
        logprobs = chat_logprobs(self.tokenizer, sample) if self.body.logprobs else None
        return {
            "index": index,
            "message": message,
            "finish_reason": "tool_calls" if calls else sample.finish_reason,
            "logprobs": logprobs,
            "prompt_token_ids": prompt,
            "token_ids": sample.token_ids,
        }

    def chunk(self, index: int, text: str) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text}, "finish_reason": None}

    def last_chunk(self, index: int, prompt: list[int], sample: Sample, text: str) -> dict:
        whole = self.choice(index, prompt, sample)
        delta: dict[str, Any] = {"content": text}
        if calls := whole["message"].get("tool_calls"):
            delta["tool_calls"] = [{**c, "index": i} for i, c in enumerate(calls)]
        return {
            "index": index,
            "delta": delta,
            "finish_reason": whole["finish_reason"],
            "logprobs": whole["logprobs"],
            "prompt_token_ids": prompt,
            "token_ids": sample.token_ids,
        }

    async def events(self, ids: list[list[int]], params: Params) -> AsyncIterator[str]:
        head = _head(self.chunk_kind, self.model, -1)
        delta = {"role": "assistant", "content": ""}
        yield "".join(
            _sse({**head, "choices": [{"index": k, "delta": delta, "finish_reason": None}]})
            for k in range(len(ids) * params.n)
        )
        async with aclosing(super().events(ids, params)) as events:
            async for event in events:
                yield event


ROLES = {"system", "developer", "user", "assistant", "tool"}


def chat_messages(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's messages as a template takes them: content as one string (text parts
    joined), `developer` as `system`; a 400 naming the first message that cannot be read."""
    if not raw:
        raise APIError(400, "messages: at least one message is needed", "messages")
    messages = []
    for i, message in enumerate(raw):
        role, content = message.get("role"), message.get("content")
        where = f"messages[{i}]"
        if role not in ROLES:
            raise APIError(400, f"{where}.role={role!r}: one of {sorted(ROLES)}", where)
        if isinstance(content, list):
            if not all(_text_part(p) for p in content):
                raise APIError(400, f"{where}.content: only text parts are supported", where)
            content = "".join(p["text"] for p in content)
        if content is not None and not isinstance(content, str):
            raise APIError(400, f"{where}.content: a string or a list of text parts", where)
        if content is None and not message.get("tool_calls"):
            raise APIError(400, f"{where}.content: missing", where)
        out = {"role": "system" if role == "developer" else role, "content": content or ""}
        if message.get("tool_calls"):
            out["tool_calls"] = message["tool_calls"]
        for key in ("tool_call_id", "name"):  # rendered into the prompt: text only
            if key in message:
                if not isinstance(message[key], str):
                    raise APIError(400, f"{where}.{key}: must be a string", where)
                out[key] = message[key]
        messages.append(out)
    return messages


def _text_part(part: Any) -> bool:
    return (
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
    )


def chat_prompt(tokenizer: Any, body: ChatRequest) -> list[int]:
    template = ChatTemplate(tokenizer)
    tools = body.tools if body.tool_choice != "none" else None
    messages = chat_messages(body.messages)
    try:
        text = template.render(messages, tools, generation=True)
    except Exception as exc:  # the template's own refusal (jinja raises on what it rejects)
        raise APIError(400, f"messages: the chat template refused them: {exc}", "messages") from exc
    return template.encode(text)


T = TypeVar("T")


class ClientGone(HTTPException):
    """The client disconnected before its answer was ready (nginx's 499; nobody reads it)."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the request before its answer was ready")


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, unless the client disconnects (or times out) first: `work` is then
    cancelled, which a backend takes as dropping the request, and ClientGone raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    """Return once the client has disconnected. The body has been read whole (the route's
    model), so the only message left to come is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def admit(
    backend: Backend,
    shares: KeyShares,
    request: Request,
    rows: int,
    serve: Callable[[], Awaitable[Any]],
) -> Any:
    """`serve()`'s response, its `rows` held against the request's key until it is
    answered, refused, or its client goes (a stream's: until the stream ends)."""
    if backend.asleep:
        raise APIError(503, ASLEEP)
    if _rollout(request):  # the run's own: not counted
        return await serve()
    give_back = shares.take(request, rows)
    try:
        response = await serve()
    except BaseException:
        give_back()
        raise
    if not isinstance(response, StreamingResponse):
        give_back()
        return response
    events = response.body_iterator

    async def held() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        finally:  # ended, failed, or left at a yield by a client that went away
            try:
                await events.aclose()  # type: ignore[attr-defined]  # the backend drops it
            finally:
                give_back()

    response.body_iterator = held()
    # Run once the stream ends or its client goes (Starlette then stops iterating it).
    response.background = BackgroundTask(response.body_iterator.aclose)
    return response


def add_openai_routes(app: FastAPI, backend: Backend, authorized: Callable) -> None:
    """/v1/models, /v1/completions and /v1/chat/completions over `backend`."""
    install_errors(app)
    guard = [Depends(authorized)]

    @app.get("/v1/models", dependencies=guard)
    async def models() -> dict[str, Any]:
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "relay",
             "max_model_len": backend.max_len}
            for name in backend.served()
        ]  # fmt: skip
        return {"object": "list", "data": data}

    shares = KeyShares(backend.rows_per_key)
    text_limit = prompt_byte_limit(backend)

    admitted = functools.partial(admit, backend, shares)

    async def answer(
        request: Request, endpoint: Endpoint, ids: list[list[int]], max_tokens: int, top: int
    ) -> Any:
        body = endpoint.body
        check_prompts(ids, body.n, max_tokens, backend, getattr(body, "seeds", None))
        params = replace(endpoint.params(max_tokens, top), rollout=_rollout(request))
        if body.stream:  # the response stops iterating the stream when the client goes
            return StreamingResponse(endpoint.events(ids, params), media_type="text/event-stream")
        result = await unless_gone(request, backend.generate(ids, params))
        # Serialized here, by json.dumps: FastAPI's encoder takes ten times as long (20 ms for
        # a step's rollouts), and the answer is ready once this returns.
        return JSONResponse(endpoint.response(ids, result))

    @app.post("/v1/completions", dependencies=guard)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_text(body)
        served_model(body, backend)
        check_supported(body)
        check_text_bytes(prompt_bytes(body.prompt), text_limit, backend)

        async def serve() -> Any:
            # Off the event loop: a long text takes a while to tokenize, and /health must answer.
            ids = await asyncio.to_thread(prompt_ids, backend.tokenizer, body.prompt)
            endpoint = Completions(backend, body)
            return await answer(request, endpoint, ids, body.max_tokens, body.logprobs or 0)

        return await admitted(request, request_rows(body.prompt, body.n), serve)

    @app.post("/v1/chat/completions", dependencies=guard)
    async def chat(body: ChatRequest, request: Request) -> Any:
        check_text(body)
        served_model(body, backend)
        check_supported(body)
        check_text_bytes(chat_bytes(body), text_limit, backend)

        async def serve() -> Any:
            ids = [await asyncio.to_thread(chat_prompt, backend.tokenizer, body)]
            limit = body.max_completion_tokens or body.max_tokens or backend.max_len - len(ids[0])
            top = (body.top_logprobs or 0) if body.logprobs else 0
            return await answer(request, ChatCompletions(backend, body), ids, max(limit, 1), top)

        return await admitted(request, body.n, serve)
