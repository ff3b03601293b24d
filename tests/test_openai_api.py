"""OpenAI compatibility: the official `openai` client against a real embedded inference server
(tests/support/openai_checks.py, shared with the vLLM front's tests), and the chat layer's tool
calls, templates and refusals against a scripted backend whose "model" says what the test wants."""

from __future__ import annotations

import json
import re
import string
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

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
