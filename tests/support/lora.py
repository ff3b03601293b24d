"""What the LoRA tests share: adapted models, greedy decoding through a server, and loading a
version into it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx
import torch

from rl.core.model import encode_prompt, ensure_checkpoint, load_model
from rl.core.rundir import RunDir
from rl.inference.generation import generate
from rl.trainer import lora as lora_trainer
from rl.weights import lora as lora_weights

PROMPTS = ["hello world", "ab", "the quick brown fox"]


def adapted(cfg: Any, seed: int) -> Any:
    """The tiny model with a rank-8 adapter whose B is random (from `seed`), not zero."""
    model = lora_trainer.wrap(load_model(ensure_checkpoint(cfg.model)), cfg.model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return model.eval()


def greedy_ids(model: Any, tokenizer: Any) -> list[list[int]]:
    """What the model itself decodes greedily for PROMPTS (the engine's reference)."""
    prompts = [encode_prompt(tokenizer, p) for p in PROMPTS]
    gens = [torch.Generator(next(model.parameters()).device)] * len(prompts)
    with torch.no_grad():
        samples = generate(model, tokenizer, prompts, [12] * 3, [0.0] * 3, gens)
    return [s.token_ids for s in samples]


def load(server: SimpleNamespace, version: int, **extra: str) -> httpx.Response:
    """Ask the server to load the run's published `version` (`extra`: an `adapter` name)."""
    body = {"version": version, "path": str(RunDir(server.run_dir).weights_for(version))}
    return server.client.post("/admin/load_weights", json={**body, **extra})


def served_greedy(server: SimpleNamespace, model: str = "tiny") -> tuple[int, list[list[int]]]:
    body = {"model": model, "prompt": PROMPTS, "max_tokens": 12, "temperature": 0}
    response = server.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer["policy_version"], [c["token_ids"] for c in answer["choices"]]


def check_shared_service(server: SimpleNamespace, first: Any, second: Any) -> None:
    """Two sweep points on one shared service (`server.run_dir` is the sweep's `inference/`):
    each served under its name on the base until its first adapter, then with its own adapter,
    side by side, with its own version; loads that name no point, another point's weights or a
    point the sweep lacks are refused, changing nothing."""
    sweep, tokenizer = server.run_dir.parent, server.tokenizer
    points = [RunDir(sweep / "0-lr=1"), RunDir(sweep / "1-lr=2")]
    for point, model in zip(points, (first, second), strict=True):
        point.weights.mkdir(parents=True)
        point.config.write_text("{}")
        for version in (0, 1):  # the base in full, then the point's adapter
            lora_weights.publish(version, model, tokenizer, None, point)

    def load(point: RunDir, name: str, version: int) -> httpx.Response:
        body = {"version": version, "path": str(point.weights_for(version)), "adapter": name}
        return server.client.post("/admin/load_weights", json=body)

    with first.disable_adapter():
        base = greedy_ids(first, tokenizer)
    assert load(points[0], "point-0", 0).json()["policy_version"] == 0
    assert served_greedy(server, "point-0") == (0, base)  # the shared base, until its adapter
    for point, name in zip(points, ("point-0", "point-1"), strict=True):
        if name == "point-1":
            assert load(point, name, 0).status_code == 200
        assert load(point, name, 1).json()["policy_version"] == 1
    first_ids, second_ids = greedy_ids(first, tokenizer), greedy_ids(second, tokenizer)
    assert first_ids != second_ids != base
    assert served_greedy(server, "point-0") == (1, first_ids)
    assert served_greedy(server, "point-1") == (1, second_ids)
    version = server.client.get("/admin/version", params={"model": "point-1"})
    assert version.json() == {"policy_version": 1}
    names = [m["id"] for m in server.client.get("/v1/models").json()["data"]]
    assert names == ["tiny", "point-0", "point-1"]
    unnamed = {"version": 1, "path": str(points[1].weights_for(1))}
    assert server.client.post("/admin/load_weights", json=unnamed).status_code == 400
    assert load(points[0], "point-1", 1).status_code == 400  # point 0's weights as point 1
    assert load(points[1], "point-7", 1).status_code == 400
    assert served_greedy(server, "point-1") == (1, second_ids)
