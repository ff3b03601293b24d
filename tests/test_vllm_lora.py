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

from rl import lora
from rl.model import ensure_checkpoint, load_tokenizer
from rl.rundir import RunDir
from tests.test_lora import PROMPTS, adapted, greedy_ids
from tests.test_vllm import VLLM_PYTHON, pytestmark, vllm_server  # noqa: F401


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DictConfig]:
    from rl.testing import compose_run

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RELAY_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield compose_run(
            "inference.backend=vllm",
            f"inference.vllm_python={VLLM_PYTHON}",
            "model.lora.rank=8",
            "inference.max_loras=2",
        )


@pytest.fixture(scope="module")
def server(cfg: DictConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    with vllm_server(cfg, tmp_path_factory.mktemp("run")) as running:
        running.cfg = cfg
        running.tokenizer = load_tokenizer(ensure_checkpoint(cfg.model, seed=cfg.seed))
        running.first, running.second = adapted(cfg, seed=1), adapted(cfg, seed=2)
        RunDir(running.run_dir).weights.mkdir(parents=True, exist_ok=True)
        yield running


def publish_and_load(server: SimpleNamespace, version: int, model: object, **extra: str) -> dict:
    layout = RunDir(server.run_dir)
    lora.publish(version, model, server.tokenizer, None, layout)
    body = {"version": version, "path": str(layout.weights_for(version)), **extra}
    response = server.client.post("/admin/load_weights", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def greedy(server: SimpleNamespace, model: str = "tiny") -> tuple[int, list[list[int]]]:
    body = {"model": model, "prompt": PROMPTS, "max_tokens": 12, "temperature": 0}
    response = server.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer["policy_version"], [c["token_ids"] for c in answer["choices"]]


def test_vllm_serves_each_adapter_version_as_peft_decodes(server: SimpleNamespace) -> None:
    first = greedy_ids(server.first, server.tokenizer)
    second = greedy_ids(server.second, server.tokenizer)
    with server.first.disable_adapter():
        base = greedy_ids(server.first, server.tokenizer)
    assert first != base != second != first
    publish_and_load(server, 0, server.first)  # version 0: the base in full
    assert greedy(server) == (0, base)
    publish_and_load(server, 1, server.first)
    assert greedy(server) == (1, first)
    publish_and_load(server, 2, server.second)  # replaces version 1's adapter in place
    assert greedy(server) == (2, second)
    log = (server.run_dir / "logs" / "inference-0-vllm.log").read_text()
    assert "enable_lora" in log and log.count("Started server process") == 1  # no restart


def test_vllm_serves_a_second_adapter_under_its_name(server: SimpleNamespace) -> None:
    publish_and_load(server, 3, server.first)
    assert publish_and_load(server, 4, server.second, adapter="other")["policy_version"] == 4
    names = [m["id"] for m in server.client.get("/v1/models").json()["data"]]
    assert names == ["tiny", "other"]
    assert greedy(server) == (3, greedy_ids(server.first, server.tokenizer))
    assert greedy(server, "other") == (4, greedy_ids(server.second, server.tokenizer))


def test_vllm_refuses_an_adapter_above_its_rank_and_keeps_serving(
    server: SimpleNamespace,
) -> None:
    from rl.model import load_model
    from rl.testing import compose_run

    before = greedy(server)
    wide_cfg = compose_run("model.lora.rank=16")
    wide = lora.wrap(load_model(ensure_checkpoint(server.cfg.model)), wide_cfg.model)
    layout = RunDir(server.run_dir)
    lora.publish(9, wide, server.tokenizer, None, layout)
    body = {"version": 9, "path": str(layout.weights_for(9))}
    response = server.client.post("/admin/load_weights", json=body)
    assert response.status_code == 400
    assert "vLLM refused the adapter" in response.json()["detail"]
    assert greedy(server) == before
