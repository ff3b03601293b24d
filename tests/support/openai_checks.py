"""What the official `openai` client must get from a Relay inference server, whichever backend
serves it: tests/test_openai_api.py runs these against the embedded engine, tests/test_vllm.py
against the front of a real vLLM."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

PROMPTS = ["hello world", "ab"]


def client(base_url: str, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=token, max_retries=0, timeout=300)


def greedy_text(api: openai.OpenAI, model: str, prompt: str, max_tokens: int = 12) -> str:
    done = api.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return done.choices[0].text


def check_models(api: openai.OpenAI, model: str) -> None:
    assert [m.id for m in api.models.list().data] == [model]


def check_completions(api: openai.OpenAI, model: str) -> None:
    done = api.completions.create(
        model=model, prompt=PROMPTS, n=2, logprobs=1, max_tokens=8, temperature=1.0
    )
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    for choice in done.choices:
        extra = choice.model_extra
        ids = extra["token_ids"]
        assert 0 < len(ids) == len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs)
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
        assert choice.finish_reason in ("stop", "length")
    assert done.usage.completion_tokens == sum(
        len(c.model_extra["token_ids"]) for c in done.choices
    )
    assert done.usage.prompt_tokens == sum(
        len(done.choices[2 * i].model_extra["prompt_token_ids"]) for i in range(2)
    )
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    assert "policy_version" in done.model_extra


def check_chat(api: openai.OpenAI, model: str) -> None:
    done = api.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_completion_tokens=8,
    )
    message = done.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    assert done.choices[0].finish_reason in ("stop", "length")
    assert done.usage.completion_tokens == len(done.choices[0].model_extra["token_ids"]) <= 8


def check_streams_equal_greedy(api: openai.OpenAI, model: str) -> None:
    for prompt in PROMPTS:
        whole = greedy_text(api, model, prompt, 16)
        chunks = list(
            api.completions.create(
                model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True
            )
        )
        assert len(chunks) > 1
        assert "".join(c.choices[0].text for c in chunks) == whole
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    messages = [{"role": "user", "content": "hello"}]
    whole = api.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=12, temperature=0
    )
    streamed = api.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for chunk in streamed:
        usage = chunk.usage or usage
        parts += [c.delta.content or "" for c in chunk.choices]
    assert "".join(parts) == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def check_stop(api: openai.OpenAI, model: str) -> None:
    """A stop string cuts the text before it, ends the choice there ("stop"), and generation
    ends at the token that completed it."""
    prompt = PROMPTS[0]
    free = api.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
    text = free.choices[0].text
    assert len(text) >= 6, text
    stop = text[2:4]  # two characters: with a character tokenizer, the stop spans tokens
    cut = text.find(stop)
    done = api.completions.create(
        model=model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop]
    )
    assert done.choices[0].text == text[:cut]
    assert done.choices[0].finish_reason == "stop"
    assert len(done.choices[0].model_extra["token_ids"]) < len(
        free.choices[0].model_extra["token_ids"]
    )
    streamed = api.completions.create(
        model=model, prompt=prompt, max_tokens=16, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text[:cut]


def check_sampling_settings(api: openai.OpenAI, model: str) -> None:
    """top_p narrows sampling (a tiny nucleus is greedy), a seed repeats a draw, and
    logprobs=k gives k alternatives per token with the sampled one's logprob among them."""
    greedy = api.completions.create(model=model, prompt=PROMPTS, max_tokens=10, temperature=0)
    nucleus = api.completions.create(
        model=model, prompt=PROMPTS, n=4, max_tokens=10, temperature=1.0, top_p=1e-6
    )
    for k, choice in enumerate(nucleus.choices):
        assert choice.text == greedy.choices[k // 4].text
    seeded = [
        api.completions.create(
            model=model, prompt=PROMPTS[0], n=3, max_tokens=10, temperature=1.0, seed=7
        )
        for _ in range(2)
    ]
    assert [c.text for c in seeded[0].choices] == [c.text for c in seeded[1].choices]
    top = api.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3
    )
    logprobs = top.choices[0].logprobs
    for chosen, alternatives in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(alternatives) == 3
        assert max(alternatives.values()) == pytest.approx(chosen, abs=1e-3)  # greedy: the top
    chat = api.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == len(chat.choices[0].model_extra["token_ids"])
    assert all(len(item.top_logprobs) == 2 for item in content)


def check_refusals(api: openai.OpenAI, model: str) -> None:
    """Unsupported options and unknown models get a 400 in OpenAI's error shape."""
    cases = [
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty"),
        ({"model": "gpt-4o"}, "model"),
    ]
    for extra, param in cases:
        kwargs = {"model": model, "prompt": "ab", "max_tokens": 2, **extra}
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(**kwargs)
        error = refused.value.body
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert param in error["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], tool_choice="required"
        )
    assert refused.value.body["param"] == "tool_choice"
    # Defaults that change nothing are accepted.
    api.completions.create(model=model, prompt="ab", max_tokens=2, presence_penalty=0.0)


def raw_post(api: openai.OpenAI, route: str, body: dict) -> httpx.Response:
    """POST `body` as Python's JSON writes it (Infinity, NaN and lone surrogates' escapes
    included), which the official client refuses to send."""
    return httpx.post(
        f"{api.base_url}{route}",
        content=json.dumps(body),
        headers={"Authorization": f"Bearer {api.api_key}", "Content-Type": "application/json"},
        timeout=60,
    )


HI = [{"role": "user", "content": "hi"}]
UNREADABLE = [
    ("completions", {"temperature": float("inf")}, "temperature"),
    ("completions", {"temperature": float("nan")}, "temperature"),
    ("completions", {"top_p": float("-inf")}, "top_p"),
    ("completions", {"presence_penalty": float("inf")}, "presence_penalty"),
    ("completions", {"logit_bias": {"5": float("nan")}}, "logit_bias.5"),
    ("chat/completions", {"messages": HI, "temperature": float("inf")}, "temperature"),
    ("completions", {"prompt": "a\ud800b"}, "prompt"),
    ("completions", {"prompt": ["ab", "\udfff"]}, "prompt[1]"),
    ("completions", {"stop": ["x\ud800"]}, "stop[0]"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]},
     "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "text", "text": "\ud800"}]}]},
     "messages[0].content[1].text"),
    ("chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {
        "name": "f", "description": "\ud800", "parameters": {}}}]},
     "tools[0].function.description"),
]  # fmt: skip


def check_unreadable_numbers_and_text(api: openai.OpenAI, model: str) -> None:
    """A number field sent as Infinity or NaN, and text holding a lone surrogate (JSON can
    spell one, UTF-8 cannot encode it), are 400s naming the field, wherever they are; a
    surrogate pair is one whole character and is served."""
    for route, extra, param in UNREADABLE:
        body = {"model": model, "prompt": "ab", "max_tokens": 2, **extra}
        if route.startswith("chat"):
            body.pop("prompt")
        response = raw_post(api, route, body)
        assert response.status_code == 400, (extra, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
    whole = raw_post(
        api, "completions", {"model": model, "prompt": "\ud83d\ude00", "max_tokens": 2}
    )
    assert whole.status_code == 200, whole.text


ALL = [
    check_models,
    check_completions,
    check_chat,
    check_streams_equal_greedy,
    check_stop,
    check_sampling_settings,
    check_refusals,
    check_unreadable_numbers_and_text,
]
