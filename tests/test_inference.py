"""The embedded inference server: generate() against full forward passes, and the real server.

`generate` is checked directly (left padding, KV cache, sampling logprobs, stopping); the server
is started as a real process and exercised over HTTP, weight swaps and concurrency included.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from rl.core.auth import decode_keys, derive, role_env, token_auth
from rl.core.model import (
    encode_prompt,
    ensure_checkpoint,
    load_model,
    load_tokenizer,
    publish_weights,
)
from rl.core.paths import ROOT
from rl.core.rundir import write_checksums
from rl.inference.engine import Engine
from rl.inference.engines import engine_of
from rl.inference.generation import Limits, generate
from rl.inference.server import build_app
from rl.weights.base import BROADCAST_ROUTE
from rl.weights.broadcast import InferenceBroadcaster
from tests.support import inference
from tests.support.inference import complete, served_in_thread
from tests.support.runs import TOKEN, compose_run

cache, server = inference.cache, inference.server  # the module's server fixtures

PROMPTS = ["hello world", "ab", "the quick brown fox jumps over"]


@pytest.fixture(scope="module")
def cfg(cache: Path) -> DictConfig:
    return compose_run()


@pytest.fixture(scope="module")
def checkpoint(cfg: DictConfig) -> Path:
    return ensure_checkpoint(cfg.model)


@pytest.fixture(scope="module")
def tiny(checkpoint: Path, cfg: DictConfig) -> tuple[Any, Any]:
    return load_model(checkpoint, dtype=cfg.model.dtype).eval(), load_tokenizer(checkpoint)


def reference_logprobs(model: Any, prompt: list[int], completion: list[int], temp: float) -> Any:
    """Logprobs of `completion` from one uncached, unpadded forward pass over the sequence."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits / (temp or 1.0), dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(completion))
    return logp[positions, torch.tensor(completion)]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_logprobs_match_full_forward(tiny: tuple[Any, Any], temperature: float) -> None:
    model, tokenizer = tiny
    prompts = [encode_prompt(tokenizer, p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # left padding really happens
    samples = generate(model, tokenizer, prompts, 24, temperature)
    for prompt, sample in zip(prompts, samples, strict=True):
        assert len(sample.token_ids) == len(sample.logprobs) > 0
        ref = reference_logprobs(model, prompt, sample.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(sample.logprobs), ref, atol=1e-4, rtol=0)


def test_greedy_batch_equals_each_prompt_alone(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    prompts = [encode_prompt(tokenizer, p) for p in PROMPTS]
    batched = generate(model, tokenizer, prompts, 20, 0.0)
    for prompt, sample in zip(prompts, batched, strict=True):
        alone = generate(model, tokenizer, [prompt], 20, 0.0)[0]
        assert sample.token_ids == alone.token_ids
        assert sample.finish_reason == alone.finish_reason


def test_rows_sharing_a_prompt_share_its_pass_exactly(tiny: tuple[Any, Any]) -> None:
    """A group's samples are prefilled once and fanned out: each row samples (seeded) the same
    tokens, with logprobs of the full forward, as when it is alone."""
    model, tokenizer = tiny
    a, b = (encode_prompt(tokenizer, p) for p in PROMPTS[:2])
    rows = [a, b, a, a, b]

    def seeded(row: int) -> torch.Generator:
        return torch.Generator().manual_seed(row)

    shared = generate(model, tokenizer, rows, 12, 1.0, [seeded(r) for r in range(len(rows))])
    for row, (prompt, sample) in enumerate(zip(rows, shared, strict=True)):
        alone = generate(model, tokenizer, [prompt], 12, 1.0, [seeded(row)])[0]
        assert sample.token_ids == alone.token_ids
        ref = reference_logprobs(model, prompt, sample.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(sample.logprobs), ref, atol=1e-4, rtol=0)
    assert len({tuple(s.token_ids) for s in shared}) > 2  # the shared rows did diverge


@pytest.mark.parametrize("top", [0, 3], ids=["tokens", "alternatives"])
def test_finished_rows_leave_the_batch_and_the_rest_decode_as_alone(
    tiny: tuple[Any, Any], top: int
) -> None:
    """Rows that end early stop being computed; every row still samples (seeded) the tokens,
    and gets the logprobs (and the `top` likeliest alternatives), it gets alone."""
    model, tokenizer = tiny
    a, b = (encode_prompt(tokenizer, p) for p in PROMPTS[:2])
    rows, caps = [a, a, b, b, a, b, a, b], [2, 3, 3, 4, 5, 9, 12, 12]
    limits = Limits(top_logprobs=top)

    def seeded(row: int) -> torch.Generator:
        return torch.Generator().manual_seed(100 + row)

    with passes(model) as computed:
        batched = generate(model, tokenizer, rows, caps, 1.0, [seeded(r) for r in range(8)], limits)
    assert computed[0] == 2 and computed[1] == 8  # the prompt pass, then every row
    assert computed[-1] < 8  # the rows done by then had left
    for row, (prompt, sample) in enumerate(zip(rows, batched, strict=True)):
        alone = generate(model, tokenizer, [prompt], caps[row], 1.0, [seeded(row)], limits)[0]
        assert sample.token_ids == alone.token_ids
        ref = reference_logprobs(model, prompt, sample.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(sample.logprobs), ref, atol=1e-4, rtol=0)
        if top:
            assert [[t for t, _ in step] for step in sample.top] == [
                [t for t, _ in step] for step in alone.top
            ]
            values = [[v for _, v in step] for step in sample.top]
            expected = [[v for _, v in step] for step in alone.top]
            torch.testing.assert_close(values, expected, atol=1e-4, rtol=0)


def test_withdrawn_rows_end_at_once_and_the_rest_decode_as_alone(tiny: tuple[Any, Any]) -> None:
    """Rows withdrawn after the second step (their client went away) keep the two tokens drawn
    and leave the batch before the next forward pass; the others are as alone."""
    model, tokenizer = tiny
    prompts = [encode_prompt(tokenizer, p) for p in PROMPTS]
    asked = []

    def withdrawn() -> list[int]:
        asked.append(len(asked))
        return [0, 2] if len(asked) == 2 else []

    with passes(model) as computed:
        batched = generate(model, tokenizer, prompts, 10, 0.0, withdrawn=withdrawn)
    full = generate(model, tokenizer, prompts, 10, 0.0)
    assert [s.token_ids for s in batched] == [
        full[0].token_ids[:2],
        full[1].token_ids,
        full[2].token_ids[:2],
    ]
    assert computed[:3] == [3, 3, 1]  # prompt pass, first step, then row 1 alone


@contextlib.contextmanager
def passes(model: Any) -> Iterator[list[int]]:
    """The rows of each forward pass of `model` inside the block."""
    computed: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda m, i, o: computed.append(i[0].shape[0])
    )
    try:
        yield computed
    finally:
        hook.remove()


def test_per_row_limits_and_eos_stop(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    prompts = [encode_prompt(tokenizer, p) for p in PROMPTS]
    first = generate(model, tokenizer, prompts[:1], 1, 0.0)[0].token_ids[0]
    # A tokenizer whose EOS is the greedy first token of prompt 0: that row must stop at once.
    fake = SimpleNamespace(eos_token_id=first, pad_token_id=tokenizer.pad_token_id)
    samples = generate(model, fake, prompts, [5, 3, 7], 0.0)
    assert samples[0].token_ids == [first] and samples[0].finish_reason == "stop"
    for sample, limit in zip(samples[1:], [3, 7], strict=True):
        assert first not in sample.token_ids[:-1]  # nothing after an EOS
        if sample.finish_reason == "length":
            assert len(sample.token_ids) == limit


def test_seeded_rows_ignore_batch_neighbours(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    prompts = [encode_prompt(tokenizer, p) for p in PROMPTS]

    def seeded() -> torch.Generator:
        return torch.Generator().manual_seed(1234)

    alone = generate(model, tokenizer, prompts[:1], 16, 1.0, [seeded()])[0]
    shared = seeded()
    mixed = generate(model, tokenizer, prompts, 16, 1.0, [shared, None, None])[0]
    assert mixed.token_ids == alone.token_ids


@pytest.mark.slow
def test_server_health_and_completions(server: Any) -> None:
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200
    assert health.json() == {
        "status": "ok",
        "policy_version": -1,
        "asleep": False,
        "receiving": None,
        "tokens_decoded": 0,
        "requests_dropped": 0,
    }
    resp = complete(server.client, prompt=PROMPTS, n=4, max_tokens=12, logprobs=1)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["policy_version"] == -1
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(12))
    for c in choices:
        assert c["prompt_token_ids"] == choices[(c["index"] // 4) * 4]["prompt_token_ids"]
        assert 0 < len(c["token_ids"]) == len(c["logprobs"]["token_logprobs"]) <= 12
        assert len(c["logprobs"]["tokens"]) == len(c["token_ids"])
        assert c["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)


GREEDY = {"prompt": PROMPTS, "max_tokens": 16, "temperature": 0}


def greedy_ids(server: Any) -> list[list[int]]:
    response = complete(server.client, **GREEDY)
    assert response.status_code == 200, response.text
    return [c["token_ids"] for c in response.json()["choices"]]


def sleep_and_wake(server: Any) -> None:
    """Sleep (checked: every weight's memory given back, /health says so, completions are
    refused), then wake up (checked: the weights' memory back)."""
    held = server.client.get("/health").json()
    assert not held["asleep"]
    asleep = server.client.post("/admin/sleep")
    assert asleep.json() == {"asleep": True, "device_bytes": 0, "weight_bytes": 0}, asleep.text
    assert httpx.get(f"{server.url}/health").json() | {"asleep": False} == held
    for stream in (False, True):
        refused = complete(server.client, **GREEDY, stream=stream)
        assert refused.status_code == 503 and "asleep" in refused.json()["detail"]
    awake = server.client.post("/admin/wake_up").json()
    assert awake["asleep"] is False and awake["weight_bytes"] > 0
    assert httpx.get(f"{server.url}/health").json()["asleep"] is False


@pytest.mark.slow
def test_sleep_frees_the_weights_and_waking_serves_the_same(server: Any) -> None:
    """Colocated placement puts the server to sleep while the trainer runs: on CPU its
    weights' memory is freed (read again from the checkpoint on waking), and after waking it
    serves the same tokens."""
    before = greedy_ids(server)
    sleep_and_wake(server)
    assert greedy_ids(server) == before
    assert httpx.post(f"{server.url}/admin/sleep").status_code == 401  # needs the token


@pytest.mark.slow
def test_server_rejects_bad_requests(server: Any) -> None:
    no_token = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ab"})
    assert no_token.status_code == 401
    wrong = httpx.get(f"{server.url}/admin/version", headers={"Authorization": "Bearer wrong"})
    assert wrong.status_code == 401
    too_long = {"prompt": "ab", "max_tokens": 500}  # beyond the 128-token context
    for body in ({"prompt": []}, {"prompt": "ab", "n": 0}, too_long, {"max_tokens": 4}):
        resp = complete(server.client, **body)
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["detail"]
    missing = server.client.post("/admin/load_weights", json={"path": "/nope", "version": 3})
    assert missing.status_code == 400 and "/nope" in missing.json()["detail"]


@pytest.mark.slow
def test_out_of_range_seed_is_refused_and_the_engine_keeps_serving(server: Any) -> None:
    for seed in (2**64, -1, 2**63):
        resp = complete(server.client, prompt="ab", max_tokens=2, seed=seed)
        assert resp.status_code == 400 and "seed" in resp.json()["detail"], (seed, resp.text)
    assert complete(server.client, prompt="ab", max_tokens=2, seed=2**63 - 1).status_code == 200
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


@pytest.mark.slow
def test_out_of_vocabulary_ids_are_refused_alone(server: Any, cfg: DictConfig) -> None:
    """Ids the model cannot embed are refused naming the id; valid requests sent alongside are
    all served, and so is the last id the model has (which the tokenizer may not name)."""
    rows = cfg.model.vocab_size  # the embedding's rows
    assert complete(server.client, prompt=[[1, rows - 1]], max_tokens=2).status_code == 200
    bad = [[99999], [[5, -3]], [rows]]
    with ThreadPoolExecutor(12) as pool:
        good = [pool.submit(complete, server.client, prompt=p, max_tokens=8) for p in PROMPTS * 3]
        refused = [pool.submit(complete, server.client, prompt=p, max_tokens=8) for p in bad]
        for future, token in zip(refused, ["99999", "-3", str(rows)], strict=True):
            resp = future.result()
            assert resp.status_code == 400 and token in resp.json()["detail"], resp.text
        assert [f.result().status_code for f in good] == [200] * len(good)


def raw_post_head(url: str, path: str, content_length: int) -> bytes:
    """The status line of a POST that declares `content_length` bytes and sends none."""
    host, port = httpx.URL(url).host, httpx.URL(url).port
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {content_length}\r\n\r\n"
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(head.encode())
        return sock.recv(4096).split(b"\r\n")[0]


@pytest.mark.slow
def test_oversized_bodies_are_refused_before_parsing(server: Any) -> None:
    huge = complete(server.client, prompt="a" * 10_000_000, max_tokens=2)
    assert huge.status_code == 413 and "bytes" in huge.json()["detail"], huge.text[:200]
    assert b" 413 " in raw_post_head(server.url, "/v1/completions", 10_000_000)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the streamed size is counted
        yield b'{"prompt": "'
        yield from (b"a" * 1_000_000 for _ in range(10))
        yield b'"}'

    streamed = server.client.post("/v1/completions", content=chunks())
    assert streamed.status_code == 413, streamed.text[:200]
    assert complete(server.client, prompt="ab", max_tokens=2).status_code == 200


@pytest.mark.slow
def test_text_that_cannot_fit_is_refused_by_its_bytes(server: Any) -> None:
    """The tiny model serves 128 tokens, and its longest token is "<pad>" (5 bytes): text over
    640 bytes is refused by its size, on either route, before it is tokenized; 640 bytes are
    tokenized (then refused for their 641 tokens: BOS, then one a character)."""
    chat = "/v1/chat/completions"
    for size in (641, 1_000_000):
        for route, body in [
            ("/v1/completions", {"prompt": "a" * size}),
            (chat, {"messages": [{"role": "user", "content": "a" * size}]}),
        ]:
            resp = server.client.post(route, json={"model": "tiny", "max_tokens": 1, **body})
            assert resp.status_code == 400, resp.text[:300]
            assert f"{size} bytes of text" in resp.json()["detail"], resp.text[:300]
            assert "at most 640 bytes" in resp.json()["detail"]
    tokenized = complete(server.client, prompt="a" * 640, max_tokens=1)
    assert tokenized.status_code == 400 and "641 tokens" in tokenized.json()["detail"]


@pytest.mark.slow
def test_health_answers_while_a_large_prompt_is_tokenized(server: Any) -> None:
    """Text within the byte bound but too long in tokens (refused for length once tokenized):
    /health is not held up while it is tokenized."""
    large = ["ab " * 213] * 512  # 639 bytes each, the most a request's rows hold
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(complete, server.client, prompt=large, max_tokens=2)
        answered = []
        while not pending.done() and len(answered) < 50:
            answered.append(httpx.get(f"{server.url}/health", timeout=30).status_code)
        assert pending.result().status_code == 400
    assert set(answered) <= {200}


@pytest.mark.slow
def test_api_description_needs_the_token(server: Any) -> None:
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        assert httpx.get(f"{server.url}{path}").status_code in (401, 404), path
    description = server.client.get("/openapi.json")
    assert description.status_code == 200 and "/v1/completions" in description.json()["paths"]


class CrashingEngine(Engine):
    """An engine whose thread dies (not a per-batch error) on the first work it takes."""

    def _serve(self, work: Any) -> None:
        raise SystemExit("simulated engine crash")


@pytest.fixture
def crashing_server(tiny: tuple[Any, Any], cfg: DictConfig) -> Iterator[str]:
    """build_app over a CrashingEngine, served by uvicorn on a thread at 127.0.0.1."""
    engine = CrashingEngine(*tiny, cfg, logging.getLogger("test"))
    engine.start()
    with served_in_thread(build_app(engine, TOKEN, 128)) as url:
        yield url


@pytest.mark.slow
def test_a_dead_engine_fails_health_and_requests(crashing_server: str) -> None:
    with httpx.Client(base_url=crashing_server, auth=token_auth(TOKEN), timeout=30) as client:
        first = complete(client, prompt="ab", max_tokens=2)
        assert first.status_code == 503 and "engine thread died" in first.json()["detail"]
        for _ in range(200):  # the thread records why it died just after failing the request
            if (health := httpx.get(f"{crashing_server}/health")).status_code == 503:
                break
            time.sleep(0.05)
        assert health.status_code == 503 and "simulated engine crash" in health.json()["detail"]
        later = complete(client, prompt="ab", max_tokens=2)
        assert later.status_code == 503 and "simulated engine crash" in later.json()["detail"]


@pytest.mark.slow
def test_server_concurrent_requests(server: Any) -> None:
    def one(i: int) -> dict:
        resp = complete(server.client, prompt=PROMPTS[i % 3], n=2, max_tokens=8 + i, logprobs=0)
        assert resp.status_code == 200, resp.text
        return resp.json()

    with ThreadPoolExecutor(20) as pool:
        bodies = list(pool.map(one, range(20)))
    for i, body in enumerate(bodies):
        assert len(body["choices"]) == 2
        assert all(len(c["token_ids"]) <= 8 + i for c in body["choices"])


@pytest.fixture(scope="module")
def step_1(server: Any, tiny: tuple[Any, Any], checkpoint: Path) -> Path:
    """The base weights with the final norm negated: every logit flips sign, so greedy changes."""
    model = load_model(checkpoint)
    with torch.no_grad():
        model.model.norm.weight.neg_()
    target = server.run_dir / "weights" / "step_1"
    publish_weights(model, tiny[1], target)
    return target


def load_version(client: httpx.Client, path: Path, version: int) -> dict:
    resp = client.post("/admin/load_weights", json={"path": str(path), "version": version})
    assert resp.status_code == 200, resp.text
    return resp.json()


def publish_as(server: Any, source: Path, version: int) -> Path:
    """`source` (a complete checkpoint) published as `version` of the server's run: a server
    loads only its run's published versions, and never an older one than it serves."""
    target = server.run_dir / "weights" / f"step_{version}"
    if not target.exists():
        shutil.copytree(source, target)
        write_checksums(target)  # as the trainer records them
    return target


@pytest.mark.slow
def test_server_weight_swap(server: Any, checkpoint: Path, step_1: Path) -> None:
    """Loading version 0 (base weights) and then changed weights changes the outputs."""
    greedy = {"prompt": PROMPTS, "max_tokens": 16, "temperature": 0, "logprobs": 1}
    assert load_version(server.client, publish_as(server, checkpoint, 0), 0)["policy_version"] == 0
    before = complete(server.client, **greedy).json()
    assert before["policy_version"] == 0
    loaded = load_version(server.client, step_1, 1)
    assert loaded["policy_version"] == 1 and loaded["load_s"] >= 0
    assert server.client.get("/admin/version").json() == {"policy_version": 1}
    assert httpx.get(f"{server.url}/health").json()["policy_version"] == 1
    after = complete(server.client, **greedy).json()
    assert after["policy_version"] == 1
    assert [c["token_ids"] for c in before["choices"]] != [c["token_ids"] for c in after["choices"]]


@pytest.mark.slow
def test_waking_serves_the_loaded_version_and_a_load_wakes(
    server: Any, tiny: tuple[Any, Any], checkpoint: Path, step_1: Path
) -> None:
    """After a load, waking reads back the published version served (step_1's weights, not the
    base); a load while asleep wakes the server on the weights it loads (a refused one leaves
    it asleep), and waking again reads those back."""
    load_version(server.client, step_1, 1)
    flipped = greedy_ids(server)
    sleep_and_wake(server)
    assert greedy_ids(server) == flipped
    model, tokenizer = tiny  # the base weights
    prompts = [encode_prompt(tokenizer, p) for p in PROMPTS]
    base = [s.token_ids for s in generate(model, tokenizer, prompts, 16, 0.0)]
    assert base != flipped
    server.client.post("/admin/sleep")
    missing = server.client.post("/admin/load_weights", json={"path": "/nope", "version": 3})
    assert missing.status_code == 400 and httpx.get(f"{server.url}/health").json()["asleep"]
    assert load_version(server.client, publish_as(server, checkpoint, 2), 2)["policy_version"] == 2
    assert httpx.get(f"{server.url}/health").json()["asleep"] is False
    assert greedy_ids(server) == base
    sleep_and_wake(server)
    assert greedy_ids(server) == base


@pytest.mark.slow
def test_swaps_under_load_report_the_version_used(
    server: Any, checkpoint: Path, step_1: Path
) -> None:
    """Weights swapped while requests stream: each answer is exactly its reported version's."""
    # Versions only grow: even ones hold the base weights, odd ones step_1's.
    paths = {v: publish_as(server, (checkpoint, step_1)[v % 2], v) for v in range(10, 18)}
    greedy = {"prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0}
    expected = {}
    for version in (10, 11):
        load_version(server.client, paths[version], version)
        expected[version % 2] = complete(server.client, **greedy).json()["choices"][0]["token_ids"]
    assert expected[0] != expected[1]

    with ThreadPoolExecutor(16) as pool:
        pending = [pool.submit(complete, server.client, **greedy) for _ in range(48)]
        for version in range(12, 18):
            load_version(server.client, paths[version], version)
        bodies = [f.result().json() for f in pending]
    for body in bodies:
        assert body["choices"][0]["token_ids"] == expected[body["policy_version"] % 2]
    assert {b["policy_version"] for b in bodies} <= set(range(11, 18))


def broadcaster(cfg: DictConfig, run_dir: Path, timeout_s: float = 60) -> InferenceBroadcaster:
    cfg = copy.deepcopy(cfg)
    cfg.inference.broadcast_timeout_s = timeout_s
    return InferenceBroadcaster(
        run_dir, cfg, logging.getLogger("test"), checkpoint_layout=engine_of(cfg).checkpoint_layout
    )


@pytest.mark.slow
def test_broadcast_serves_what_the_same_weights_from_disk_serve(
    server: Any, cfg: DictConfig, checkpoint: Path, step_1: Path
) -> None:
    """The trainer's side against the real server: greedy outputs after a broadcast equal those
    after loading the same weights from disk, and the version advances."""
    greedy = {"prompt": PROMPTS, "max_tokens": 16, "temperature": 0}
    load_version(server.client, publish_as(server, step_1, 20), 20)
    from_disk = complete(server.client, **greedy).json()
    load_version(server.client, publish_as(server, checkpoint, 21), 21)
    base = complete(server.client, **greedy).json()["choices"]
    sender = broadcaster(cfg, server.run_dir)
    sender.publish(22, load_model(step_1))
    assert server.client.get("/admin/version").json() == {"policy_version": 22}
    # Weights received by broadcast have no copy to read back: sleep on CPU would lose them.
    refused = server.client.post("/admin/sleep")
    assert refused.status_code == 409 and "broadcast" in refused.json()["detail"]
    after = complete(server.client, **greedy).json()
    assert after["policy_version"] == 22
    assert after["choices"] == from_disk["choices"] != base
    assert (server.run_dir / "weights" / "BROADCAST").read_text() == "22"
    group = server.client.get("/admin/weights/broadcast").json()["group"]
    sender.publish(23, load_model(checkpoint))  # the same group, base weights
    assert complete(server.client, **greedy).json()["choices"] == base
    status = server.client.get("/admin/weights/broadcast").json()
    assert status == {"policy_version": 23, "receivers": 1, "group": group, "busy": False,
                      "error": None}  # fmt: skip


@pytest.mark.slow
def test_only_the_trainers_announced_broadcast_is_taken(server: Any) -> None:
    """A weight group hosted by someone else, at version 10^9: refused with the API or admin
    key (401), and with the publish key unless the trainer announced that very update (403);
    the server serves on, /health saying so. Each role's process holds only its keys."""
    keys = derive(TOKEN)
    body = {
        "version": 10**9,
        "member": "inference-0",
        "group": {"host": "127.0.0.1", "port": 1, "world_size": 2, "backend": "gloo",
                  "timeout_s": 60.0, "group": "not-the-trainers"},
    }  # fmt: skip
    before = server.client.get("/admin/version").json()["policy_version"]

    def post(route: str, scope: str, payload: Any = None) -> httpx.Response:
        auth = {"Authorization": f"Bearer {keys[scope]}"}
        return httpx.post(f"{server.url}{route}", json=payload, headers=auth, timeout=30)

    for scope in ("rollout", "inference", "admin", "queue-push", "queue-pull"):
        assert post(BROADCAST_ROUTE, scope, body).status_code == 401, scope
    refused = post(BROADCAST_ROUTE, "publish", body)
    assert refused.status_code == 403 and "broadcast refused" in refused.json()["detail"]
    for route in ("/admin/load_weights", "/admin/sleep", "/admin/wake_up"):
        assert post(route, "inference", {"version": 0}).status_code == 401  # an API client
    health = httpx.get(f"{server.url}/health").json()
    assert health["policy_version"] == before and health["receiving"] is None
    assert complete(server.client, prompt="ab", max_tokens=2).status_code == 200
    env = role_env({"RELAY_TOKEN": TOKEN}, "orchestrator")
    assert "RELAY_TOKEN" not in env
    assert set(decode_keys(env["RELAY_KEYS"])) == {"rollout", "admin", "queue-push"}
    assert set(decode_keys(role_env({"RELAY_TOKEN": TOKEN}, "trainer")["RELAY_KEYS"])) == {
        "publish",
        "queue-pull",
    }


class MiscountingBroadcaster(InferenceBroadcaster):
    """Expects one receiver more than the server has: that one never joins."""

    def _statuses(self) -> dict[str, dict[str, Any]]:
        statuses = super()._statuses()
        return {name: {**s, "receivers": s["receivers"] + 1} for name, s in statuses.items()}


@pytest.mark.slow
def test_broadcast_to_a_missing_receiver_fails_naming_it_then_recovers(
    server: Any, cfg: DictConfig, checkpoint: Path
) -> None:

    cfg = copy.deepcopy(cfg)
    cfg.inference.broadcast_timeout_s = 2
    model = load_model(checkpoint)
    with pytest.raises(TimeoutError) as err:
        layout = engine_of(cfg).checkpoint_layout
        MiscountingBroadcaster(
            server.run_dir, cfg, logging.getLogger("test"), checkpoint_layout=layout
        ).publish(7, model)
    assert "inference-0 (1 of 2 receivers) did not join the gloo group within 2 s" in str(err.value)
    status = server.client.get("/admin/weights/broadcast", params={"wait": 30}).json()
    assert not status["busy"] and "TimeoutError" in status["error"]
    assert status["policy_version"] != 7
    broadcaster(cfg, server.run_dir).publish(8, model)  # a fresh group: the server is back
    assert server.client.get("/admin/version").json() == {"policy_version": 8}


@pytest.mark.slow
def test_vllm_backend_needs_plan_arguments(cfg: DictConfig, tmp_path: Path) -> None:
    cfg = copy.deepcopy(cfg)
    cfg.inference.backend = "vllm"
    OmegaConf.save(cfg, tmp_path / "config.yaml")
    proc = subprocess.run(
        [sys.executable, "-m", "rl.inference", "--run-dir", str(tmp_path), "--replica", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "inference.backend=vllm: no vLLM arguments" in proc.stderr


def test_the_vllm_front_says_when_it_sleeps_and_refuses_completions_meanwhile(
    tiny: tuple[Any, Any], cfg: DictConfig, checkpoint: Path, tmp_path: Path
) -> None:
    """The vLLM front's sleep is vLLM's sleep mode (GPU only: a stand-in takes vLLM's admin
    calls here). /health says whether it sleeps, completions are refused meanwhile, and a
    weight load wakes vLLM before it swaps."""
    from fastapi.testclient import TestClient

    from rl.inference.vllm.front import VllmBackend, VllmFrontend
    from rl.inference.vllm.front import build_app as front_app

    calls: list[str] = []
    vllm = SimpleNamespace(url="http://vllm.invalid")
    front = VllmFrontend(vllm, tiny[1], "tiny", logging.getLogger("test"))  # type: ignore[arg-type]

    async def admin(route: str, **_: Any) -> None:
        calls.append(route)

    async def swap(path: Path, version: int) -> dict:
        calls.append(f"swap {version}")
        return {"policy_version": version, "load_s": 0.0}

    front._admin, front._swap_weights = admin, swap  # type: ignore[method-assign]
    front.ready.set()
    backend = VllmBackend(front, 128, cfg.model.vocab_size, cfg.inference.api_rows_per_key)
    app = front_app(front, TOKEN, openai=backend)
    keys = token_auth(TOKEN)
    with TestClient(app, headers=keys.header("/admin/sleep")) as client:
        assert client.get("/health").json()["asleep"] is False
        assert client.post("/admin/sleep").json() == {"asleep": True}
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["asleep"] is True
        api = keys.header("/v1/completions")
        refused = client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "ab"}, headers=api
        )
        assert refused.status_code == 503 and "asleep" in refused.json()["detail"]
        assert client.post("/admin/wake_up").json() == {"asleep": False}
        client.post("/admin/sleep")
        published = shutil.copytree(checkpoint, tmp_path / "step_5")  # as the trainer does
        write_checksums(published)
        assert client.portal.call(front.load_weights, published, 5)["policy_version"] == 5
        assert client.get("/health").json()["asleep"] is False
    assert calls == ["/sleep", "/wake_up", "/sleep", "/wake_up", "swap 5"]
