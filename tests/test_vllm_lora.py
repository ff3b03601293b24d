"""LoRA served by a real vLLM on this CPU (vLLM's CPU build runs LoRA): Relay's front starts it
with `--enable-lora`, loads each published adapter at runtime (in place, no restart, no reload
of the base) and asks vLLM for it by name. Greedy outputs equal what PEFT's model decodes.

Needs RELAY_VLLM_PYTHON, as tests/test_vllm.py; skipped without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from omegaconf import DictConfig

from rl.core.model import ensure_checkpoint, load_tokenizer
from rl.core.rundir import SERVICE, RunDir
from rl.trainer import lora as lora_trainer
from rl.weights import lora as lora_weights
from tests.support.lora import adapted, check_shared_service, greedy_ids, load, served_greedy
from tests.support.vllm import MARKS, vllm_config, vllm_server

pytestmark = MARKS  # slow; skipped without vLLM's CPU build


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DictConfig]:
    with vllm_config(tmp_path_factory, "model.lora.rank=8", "inference.max_loras=2") as config:
        yield config


@pytest.fixture(scope="module")
def server(cfg: DictConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    with vllm_server(cfg, tmp_path_factory.mktemp("run")) as running:
        running.cfg = cfg
        running.tokenizer = load_tokenizer(ensure_checkpoint(cfg.model))
        running.first, running.second = adapted(cfg, seed=1), adapted(cfg, seed=2)
        RunDir(running.run_dir).weights.mkdir(parents=True, exist_ok=True)
        yield running


def publish_and_load(server: SimpleNamespace, version: int, model: object, **extra: str) -> dict:
    lora_weights.publish(version, model, server.tokenizer, None, RunDir(server.run_dir))
    response = load(server, version, **extra)
    assert response.status_code == 200, response.text
    return response.json()


def test_vllm_serves_each_adapter_version_as_peft_decodes(server: SimpleNamespace) -> None:
    first = greedy_ids(server.first, server.tokenizer)
    second = greedy_ids(server.second, server.tokenizer)
    with server.first.disable_adapter():
        base = greedy_ids(server.first, server.tokenizer)
    assert first != base != second != first
    publish_and_load(server, 0, server.first)  # version 0: the base in full
    assert served_greedy(server) == (0, base)
    publish_and_load(server, 1, server.first)
    assert served_greedy(server) == (1, first)
    publish_and_load(server, 2, server.second)  # replaces version 1's adapter in place
    assert served_greedy(server) == (2, second)
    log = (server.run_dir / "logs" / "inference-0-vllm.log").read_text()
    assert "enable_lora" in log and log.count("Started server process") == 1  # no restart


def test_vllm_serves_a_second_adapter_under_its_name(server: SimpleNamespace) -> None:
    publish_and_load(server, 3, server.first)
    assert publish_and_load(server, 4, server.second, adapter="other")["policy_version"] == 4
    names = [m["id"] for m in server.client.get("/v1/models").json()["data"]]
    assert names == ["tiny", "other"]
    assert served_greedy(server) == (3, greedy_ids(server.first, server.tokenizer))
    assert served_greedy(server, "other") == (4, greedy_ids(server.second, server.tokenizer))


def test_vllm_refuses_an_adapter_above_its_rank_and_keeps_serving(
    server: SimpleNamespace,
) -> None:
    from rl.core.model import load_model
    from tests.support.runs import compose_run

    before = served_greedy(server)
    wide_cfg = compose_run("model.lora.rank=16")
    wide = lora_trainer.wrap(load_model(ensure_checkpoint(server.cfg.model)), wide_cfg.model)
    layout = RunDir(server.run_dir)
    lora_weights.publish(9, wide, server.tokenizer, None, layout)
    body = {"version": 9, "path": str(layout.weights_for(9))}
    response = server.client.post("/admin/load_weights", json=body)
    assert response.status_code == 400
    assert "vLLM refused the adapter" in response.json()["detail"]
    assert served_greedy(server) == before


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """vLLM as a sweep's shared inference service (`<sweep>/inference`)."""
    overrides = ("model.lora.rank=8", "inference.shared=true", "inference.max_loras=2")
    with vllm_config(tmp_path_factory, *overrides) as cfg:
        service = tmp_path_factory.mktemp("sweep") / SERVICE
        with vllm_server(cfg, service) as running:
            running.tokenizer = load_tokenizer(ensure_checkpoint(cfg.model))
            running.first, running.second = adapted(cfg, seed=1), adapted(cfg, seed=2)
            yield running


def test_vllm_as_a_shared_service_serves_each_point_by_name(
    shared_server: SimpleNamespace,
) -> None:
    check_shared_service(shared_server, shared_server.first, shared_server.second)
