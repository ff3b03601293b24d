"""OpenAI compatibility: the official `openai` client against a real embedded inference server
(tests/support/openai_checks.py, shared with the vLLM front's tests), and the chat layer's tool
calls, templates and refusals against a scripted backend whose "model" says what the test wants."""

from __future__ import annotations

import asyncio
import json
import queue
import re
import string
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from omegaconf import DictConfig

from rl.core.auth import derive, scoped_guard
from rl.core.chat import ChatTemplate, parse_turn
from rl.core.model import build_char_tokenizer, encode_prompt, ensure_checkpoint, load_model
from rl.core.paths import ROOT
from rl.core.runtime import read_address, wait_for_address
from rl.envs import Example
from rl.inference.generation import Limits, generate
from rl.inference.openai_api import ChatRequest, Params, Result, add_openai_routes, chat_prompt
from rl.trainer.batches import sft_batch
from tests.support import openai_checks
from tests.support.inference import served_in_thread
from tests.support.runs import compose_run, start_role, stop_role, write_run_dir

TOKEN = "openai-test"
API_KEY = derive(TOKEN)["inference"]  # what a client finds in <run dir>/api_key


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DictConfig]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RELAY_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield compose_run()


@pytest.fixture(scope="module")
def served(cfg: DictConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A real `python -m rl.inference` process (embedded engine); its run directory."""
    run_dir = write_run_dir(tmp_path_factory.mktemp("run"), cfg, TOKEN)
    proc = start_role("inference", run_dir, "--replica", "0")
    try:
        try:
            wait_for_address(run_dir, "inference-0", timeout=120)
        except TimeoutError:
            pytest.fail((run_dir / "inference.log").read_text())
        yield run_dir
    finally:
        stop_role(proc)


@pytest.fixture(scope="module")
def server(served: Path) -> str:
    """That server's base URL."""
    return read_address(served, "inference-0")


@pytest.mark.slow
@pytest.mark.parametrize("check", openai_checks.ALL, ids=lambda c: c.__name__)
def test_official_client_against_the_embedded_server(
    server: str, check: Callable[[openai.OpenAI, str], None]
) -> None:
    check(openai_checks.client(server, API_KEY), "tiny")


@pytest.mark.slow
def test_wrong_token_is_an_authentication_error(server: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai_checks.client(server, "wrong").models.list()


@pytest.mark.slow
def test_the_docs_client_example_runs_as_written(
    served: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/agents.md's example, pointed at a live server's run directory: it finds the
    address and the API key there and gets the model's name and an answer."""
    text = (ROOT / "docs" / "agents.md").read_text()
    code = re.search(r"```python\n(from pathlib.*?)```", text, re.S).group(1)
    code = code.replace('Path("outputs/reverse_text-tiny/...")', f"Path({str(served)!r})")
    exec(compile(code, "docs/agents.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    # The model's name, then its sampled answer (which may hold line breaks of its own).
    assert printed[0] == "tiny" and len(printed) >= 2, printed


def test_chat_warm_up_rows_are_what_the_chat_route_sends() -> None:
    """`warmup.chat_share` of the warm-up's rows: the prompt as a user's message, rendered as
    /v1/chat/completions renders it, then the answer and EOS to learn; the rest raw prompts."""
    tok = build_char_tokenizer(64)
    examples = [Example(f"reverse: {w}\n", w[::-1]) for w in ("stone", "apple", "cat", "dog")]
    for share, chats in [(0.5, 2), (0.0, 0)]:
        ids, attention, learned = sft_batch(tok, examples, ChatTemplate(tok), share)
        for row, example in enumerate(examples):
            message = {"role": "user", "content": example.prompt.strip()}
            if row < chats:
                prompt = chat_prompt(tok, ChatRequest(model="tiny", messages=[message]))
            else:
                prompt = encode_prompt(tok, example.prompt)
            answer = [*tok.encode(example.answer, add_special_tokens=False), tok.eos_token_id]
            assert ids[row][attention[row].bool()].tolist() == prompt + answer
            assert ids[row][learned[row]].tolist() == answer


# --- generation settings, directly -------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(cfg: DictConfig) -> tuple[Any, Any]:
    from rl.core.model import load_tokenizer

    path = ensure_checkpoint(cfg.model)
    return load_model(path, dtype=cfg.model.dtype).eval(), load_tokenizer(path)


def test_stop_strings_end_each_row_at_the_token_completing_them(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    prompts = [encode_prompt(tokenizer, p) for p in ("hello world", "ab")]
    free = generate(model, tokenizer, prompts, 16, 0.0)
    texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in free]
    stop = texts[0][3:5]  # two characters: the stop spans tokens
    limits = [Limits(stop=(stop,)), Limits()]
    cut = generate(model, tokenizer, prompts, 16, 0.0, None, limits)
    ends = texts[0].find(stop) + len(stop)  # one token per character
    assert cut[0].token_ids == free[0].token_ids[:ends] and cut[0].finish_reason == "stop"
    # The row without stop strings is untouched: the same tokens, and the same logprobs up to
    # float rounding (once the other row stopped, it decoded in a batch of one).
    assert cut[1].token_ids == free[1].token_ids
    assert cut[1].finish_reason == free[1].finish_reason
    torch.testing.assert_close(cut[1].logprobs, free[1].logprobs, atol=1e-5, rtol=0)


def test_top_logprobs_are_the_distributions_largest(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    prompt = encode_prompt(tokenizer, "hello")
    (sample,) = generate(model, tokenizer, [prompt], 6, 1.0, None, Limits(top_logprobs=4))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + sample.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    for step, row in zip(sample.top, logp, strict=True):
        values, ids = row.topk(4)
        assert [t for t, _ in step] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in step]), values, atol=1e-4, rtol=0)


# --- the chat layer, over a scripted backend ---------------------------------------------

ASCII = string.ascii_letters + string.digits + string.punctuation + " \n"


class Scripted:
    """A backend whose every choice is `reply` (then end of sequence), token by token."""

    def __init__(self, reply: str) -> None:
        self.tokenizer = build_char_tokenizer(len(ASCII) + 4, ASCII)
        self.model_name, self.max_len, self.max_rows = "scripted", 4096, None
        self.vocab_size, self.asleep = len(self.tokenizer), False
        self.rows_per_key: int | None = None
        self.reply = reply
        self.prompts: list[list[int]] = []

    def served(self) -> list[str]:
        return [self.model_name]

    def _samples(self, prompts: list[list[int]], params: Params) -> Result:
        from rl.inference.generation import Sample

        self.prompts += prompts
        ids = self.tokenizer(self.reply, add_special_tokens=False)["input_ids"]
        ids = [*ids, self.tokenizer.eos_token_id]
        return Result(3, 3, [Sample(ids, [-0.5] * len(ids), "stop")] * len(prompts) * params.n)

    async def generate(self, prompts: list[list[int]], params: Params) -> Result:
        return self._samples(prompts, params)

    async def stream(self, prompts: list[list[int]], params: Params) -> AsyncIterator[Any]:
        result = self._samples(prompts, params)
        for token in result.samples[0].token_ids:
            yield [(k, [token]) for k in range(len(result.samples))]
        yield result


def scripted_client(reply: str) -> tuple[TestClient, Scripted]:
    backend = Scripted(reply)
    app = FastAPI()
    add_openai_routes(app, backend, scoped_guard(TOKEN))
    return TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"}), backend


GUESS = {
    "type": "function",
    "function": {
        "name": "guess",
        "description": "Submit a guess.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
    },
}
CALLING = (
    'Let me try.\n<tool_call>\n{"name": "guess", "arguments": {"word": "crane"}}\n</tool_call>'
)


def chat(client: TestClient, **body: Any) -> Any:
    messages = body.pop("messages", [{"role": "user", "content": "play"}])
    return client.post("/v1/chat/completions", json={"messages": messages, **body})


def test_tool_calls_are_parsed_into_the_message() -> None:
    client, backend = scripted_client(CALLING)
    body = chat(client, tools=[GUESS]).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me try."
    (called,) = choice["message"]["tool_calls"]
    assert called["type"] == "function" and called["function"]["name"] == "guess"
    assert json.loads(called["function"]["arguments"]) == {"word": "crane"}
    # The template here cannot render tools: they were declared in the system message.
    prompt = backend.tokenizer.decode(backend.prompts[-1])
    assert prompt.startswith("<bos>system: You can call tools") and '"name": "guess"' in prompt
    # Without tools offered (or with tool_choice none) the same text is plain content.
    plain = chat(client, tools=[GUESS], tool_choice="none").json()["choices"][0]
    assert plain["message"]["content"] == CALLING and plain["finish_reason"] == "stop"


def test_streamed_tool_calls_come_whole_at_the_end() -> None:
    client, _ = scripted_client(CALLING)
    with client.stream("POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "play"}], "tools": [GUESS], "stream": True,
    }) as response:  # fmt: skip
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content") or "" for d in deltas).strip() == "Let me try."
    calls = [d["tool_calls"] for d in deltas if d.get("tool_calls")]
    assert len(calls) == 1 and calls[0][0]["function"]["name"] == "guess"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_malformed_call_stays_text() -> None:
    client, _ = scripted_client("<tool_call>{not json}</tool_call>")
    choice = chat(client, tools=[GUESS]).json()["choices"][0]
    assert choice["message"]["content"] == "<tool_call>{not json}</tool_call>"
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"


def test_history_with_tool_calls_and_results_renders() -> None:
    """An agent's second request: its earlier call and the tool's result are in the prompt."""
    client, backend = scripted_client("done")
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "guess", "arguments": '{"word": "crane"}'},
    }
    messages = [
        {"role": "user", "content": "play"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "xgyxx"},
    ]
    assert chat(client, messages=messages, tools=[GUESS]).status_code == 200
    prompt = backend.tokenizer.decode(backend.prompts[-1])
    assert '{"name": "guess", "arguments": {"word": "crane"}}' in prompt
    assert prompt.endswith("tool: xgyxx\nassistant: ")


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0]"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0]"),
        ([{"role": "user"}], "messages[0]"),
        ([{"role": "user", "content": "x", "name": {"a": 1}}], "messages[0]"),
        ([{"role": "tool", "content": "x", "tool_call_id": ["1"]}], "messages[0]"),
    ],
)
def test_unreadable_messages_are_refused(messages: list, param: str) -> None:
    client, _ = scripted_client("x")
    response = chat(client, messages=messages)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_top_logprobs_without_logprobs_is_refused() -> None:
    client, _ = scripted_client("x")
    response = chat(client, top_logprobs=2)
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"
    assert chat(client, top_logprobs=2, logprobs=True).status_code == 200


def test_text_parts_are_joined() -> None:
    client, backend = scripted_client("x")
    parts = [{"type": "text", "text": "pl"}, {"type": "text", "text": "ay"}]
    assert chat(client, messages=[{"role": "user", "content": parts}]).status_code == 200
    assert "user: play" in backend.tokenizer.decode(backend.prompts[-1])


def test_after_turn_is_what_the_template_writes_after_a_model_turn() -> None:
    tokenizer = build_char_tokenizer(len(ASCII) + 4, ASCII)
    template = ChatTemplate(tokenizer)
    history = [{"role": "user", "content": "play"}, {"role": "assistant", "content": "crane"}]
    added = [{"role": "tool", "content": "xgyxx"}]
    whole = template.render([*history, *added], None, generation=True)
    asked = template.render(history[:1], None, generation=True)
    assert whole == asked + "crane" + tokenizer.eos_token + template.after_turn(added, None)


def test_parse_turn_keeps_text_around_calls() -> None:
    turn = parse_turn('a <tool_call>{"name": "f", "arguments": {}}</tool_call> b')
    assert turn.content == "a  b" and turn.tool_calls[0]["function"]["arguments"] == "{}"
    assert parse_turn("no calls") == parse_turn("no calls")
    assert parse_turn("no calls").tool_calls == []


def test_scripted_backend_serves_the_official_client_too() -> None:
    """The scripted app speaks the same protocol: the client reads its tool calls."""
    client, _ = scripted_client(CALLING)
    api = openai.OpenAI(
        base_url="http://testserver/v1", api_key=API_KEY, http_client=client, max_retries=0
    )
    done = api.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "play"}], tools=[GUESS]
    )
    assert done.choices[0].message.tool_calls[0].function.name == "guess"


# --- cheap refusals: text that cannot fit, and each API key's share ----------------------

MEGABYTE = "a" * 1_000_000


class Tokenizing(Exception):
    """Raised by the watched tokenizer: text reached it."""


class WatchedTokenizer:
    """A tokenizer that records every call that tokenizes or templates text, and refuses those
    while `closed` (so that a server that tokenizes first fails at once, not 15 s later)."""

    def __init__(self, tokenizer: Any) -> None:
        self.inner, self.seen, self.closed = tokenizer, [], True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def _text(self, how: str, *args: Any, **kwargs: Any) -> Any:
        self.seen.append(how)
        if self.closed:
            raise Tokenizing(f"{how} was called")
        return getattr(self.inner, how)(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._text("__call__", *args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        return self._text("encode", *args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self._text("apply_chat_template", *args, **kwargs)


A_CALL = {"id": "c1", "type": "function",
          "function": {"name": "guess", "arguments": json.dumps({"word": MEGABYTE})}}  # fmt: skip
MEGABYTE_BODIES = {
    "completion": ("/v1/completions", {"prompt": MEGABYTE}),
    "completion-list": ("/v1/completions", {"prompt": ["ab", MEGABYTE], "stream": True}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": MEGABYTE}]}),
    "chat-parts": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": MEGABYTE}]}]},
    ),
    "chat-tools": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "play"}],
            "tools": [{**GUESS, "function": {**GUESS["function"], "description": MEGABYTE}}],
        },
    ),
    "chat-tool-call": (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": "play"},
                {"role": "assistant", "content": None, "tool_calls": [A_CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "no"},
            ],
            "tools": [GUESS],
        },
    ),
}


@pytest.mark.parametrize("route, body", MEGABYTE_BODIES.values(), ids=MEGABYTE_BODIES.keys())
def test_a_megabyte_prompt_is_refused_before_the_tokenizer_sees_it(
    route: str, body: dict[str, Any]
) -> None:
    """The scripted server holds 4096 tokens, and its longest token is "<pad>" (5 bytes): no
    text over 4096 x 5 = 20480 bytes can fit, and 1 MB is refused without tokenizing it."""
    client, backend = scripted_client("ok")
    watched = backend.tokenizer = WatchedTokenizer(backend.tokenizer)
    refused = client.post(route, json={"max_tokens": 2, **body})
    assert refused.status_code == 400, refused.text[:300]
    error = refused.json()["error"]
    assert "1000" in error["message"] and "at most 20480 bytes" in error["message"], error
    assert error["code"] == "context_length_exceeded"
    assert watched.seen == []
    # The same route tokenizes a text that fits (the watch sees what the server tokenizes).
    watched.closed = False
    fits = json.loads(json.dumps(body).replace(MEGABYTE, "x" * 2_000))
    served = client.post(route, json={"max_tokens": 2, **fits})
    assert served.status_code == 200, served.text[:300]
    assert watched.seen


WAIT_S = 60  # for what must happen; reached only when it does not


class Held(Scripted):
    """The scripted backend with a bound of 8 rows per API key, holding every request until
    the test lets them through; records the rows of each request it takes, and each stream
    it drops."""

    def __init__(self) -> None:
        super().__init__("ok")
        self.rows_per_key = 8
        self.through = threading.Event()
        self.taken: queue.Queue[int] = queue.Queue()
        self.dropped: queue.Queue[int] = queue.Queue()

    async def _held(self, prompts: list[list[int]], params: Params) -> None:
        self.taken.put(len(prompts) * params.n)
        while not self.through.is_set():  # on the event loop: no thread of the server's pool
            await asyncio.sleep(0.01)

    async def generate(self, prompts: list[list[int]], params: Params) -> Result:
        await self._held(prompts, params)
        return self._samples(prompts, params)

    async def stream(self, prompts: list[list[int]], params: Params) -> AsyncIterator[Any]:
        rows, ended = len(prompts) * params.n, False
        try:
            yield [(k, [self.tokenizer.convert_tokens_to_ids("o")]) for k in range(rows)]
            await self._held(prompts, params)
            ended = True
        finally:
            if not ended:
                self.dropped.put(rows)
        yield self._samples(prompts, params)


@pytest.fixture
def held() -> Iterator[SimpleNamespace]:
    """A Held backend served over a socket, with a client holding the API key and one holding
    the run's rollout key; whatever it holds is let through at the end."""
    backend = Held()
    app = FastAPI()
    add_openai_routes(app, backend, scoped_guard(TOKEN))
    rollout_key = derive(TOKEN)["rollout"]
    with served_in_thread(app) as url, ThreadPoolExecutor(4) as pool:
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"})
        runs = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {rollout_key}"})
        try:
            yield SimpleNamespace(backend=backend, api=api, rollout=runs, pool=pool)
        finally:
            backend.through.set()
            api.close()
            runs.close()


def rows(client: httpx.Client, prompts: int, n: int) -> httpx.Response:
    """A completions request of `prompts` prompts x `n` rows."""
    body = {"prompt": ["ab"] * prompts, "n": n, "max_tokens": 2}
    return client.post("/v1/completions", json=body, timeout=WAIT_S)


def test_an_api_key_past_its_rows_gets_429_and_the_runs_rollouts_are_not_counted(
    held: SimpleNamespace,
) -> None:
    """inference.api_rows_per_key=8 (the backend's): an API key holding 6 rows is refused 3
    more (429, Retry-After), on either route, and given 2; a request of 9 rows could never
    fit (400); the run's rollout key is served past the bound meanwhile; answered requests
    give their rows back."""
    backend, api, pool = held.backend, held.api, held.pool
    six = pool.submit(rows, api, 2, 3)
    assert backend.taken.get(timeout=WAIT_S) == 6
    refused = rows(api, 1, 3)
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert "6 rows" in error["message"] and "api_rows_per_key=8" in error["message"], error
    assert error["code"] == "rate_limit_exceeded"
    chat = {"messages": [{"role": "user", "content": "a"}], "n": 3}
    assert api.post("/v1/chat/completions", json=chat).status_code == 429
    too_many = rows(api, 3, 3)
    assert too_many.status_code == 400 and "9 rows" in too_many.json()["error"]["message"]
    two = pool.submit(rows, api, 1, 2)
    assert backend.taken.get(timeout=WAIT_S) == 2
    assert rows(api, 1, 1).status_code == 429  # 8 of 8 held
    runs = pool.submit(rows, held.rollout, 4, 4)  # 16 rows, the run's own: not counted
    assert backend.taken.get(timeout=WAIT_S) == 16
    backend.through.set()
    assert [f.result().status_code for f in (six, two, runs)] == [200] * 3
    assert rows(api, 2, 4).status_code == 200  # all 8 rows given back


def test_a_dropped_stream_gives_its_rows_back(held: SimpleNamespace) -> None:
    backend, api = held.backend, held.api
    body = {"prompt": "ab", "n": 8, "max_tokens": 2, "stream": True}
    with api.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()  # kept: an iterator let go closes the connection
        assert next(lines).startswith("data: ")
        assert backend.taken.get(timeout=WAIT_S) == 8
        assert rows(api, 1, 1).status_code == 429  # held while it streams
    assert backend.dropped.get(timeout=WAIT_S) == 8  # its client went: dropped
    backend.through.set()
    for _ in range(WAIT_S * 10):  # its rows come back as it is dropped
        if (again := rows(api, 1, 8)).status_code != 429:
            break
        time.sleep(0.1)
    assert again.status_code == 200, again.text
