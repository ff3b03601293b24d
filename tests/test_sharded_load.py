"""Sharded loading on CPU with gloo, four trainer ranks spawned as processes: every rank reads
only its own shards from the checkpoint (rl/trainer/loading.py), its resident memory grows by
those shards plus a bounded overhead, never by the whole model, and the loaded weights and
buffers are exactly what transformers loads in one process.

The overhead allowed: the slice in flight (read, then converted, then copied: at most twice the
largest local shard of one tensor), the allocator's and the process group's bookkeeping, and the
model's modules and FSDP's metadata: 48 MB in all. Loading the whole model on rank 0, as the
trainer did before, grows rank 0 by the whole model (about four times its shard here).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open

from rl.core.auth import TOKEN_ENV
from rl.core.model import (
    empty_model,
    ensure_checkpoint,
    inference_state,
    load_tokenizer,
    publish_weights,
)
from rl.core.rundir import RunDir
from rl.core.runtime import load_run_config
from rl.inference.engines import engine_of
from rl.trainer.loading import load_shards
from rl.trainer.lora import adapter_start
from rl.trainer.streaming import GatheredBlocks
from rl.weights.broadcast import InferenceBroadcaster
from tests.support import dist_workers, loading, parallel
from tests.support.parallel import prepare
from tests.support.runs import compose_run

cache = parallel.cache  # the module's model cache (a fixture)

WORLD = 4
EP = ("parallel=fsdp", "parallel.trainer.ep=2")  # efsdp 2 x ep 2
# GLM-5's shape (MLA with DSA, a dense block, then MoE blocks of routed and shared experts) at
# small widths: about 250 MB of float32 weights, 62 MB per rank.
MEDIUM_GLM5 = (
    "model=tiny_glm5",
    "model.num_layers=6",
    "model.hidden_size=512",
    "model.intermediate_size=1024",
    "model.num_experts=16",
    "model.moe_intermediate_size=512",
)
OVERHEAD = 48e6
# GLM-5's shape at widths that are not multiples of FP8's 128 x 128 blocks (shards start
# inside a block, edge blocks are partial), trained in bfloat16 like GLM-5.
FP8_GLM5 = (
    "model=tiny_glm5",
    "model.num_layers=3",
    "model.hidden_size=320",
    "model.intermediate_size=384",
    "model.moe_intermediate_size=160",
    "model.dtype=bfloat16",
)
# id -> overrides
LOADS = {
    "medium-glm5-efsdp2xep2": (*MEDIUM_GLM5, *EP),
    "tiny-glm5-efsdp2xep2": ("model=tiny_glm5", *EP),
    "tiny-fsdp4": ("model=tiny", "parallel=fsdp"),  # tied embeddings
    "tiny-fsdp4-checkpointing": (
        "model=tiny",
        "parallel=fsdp",
        "trainer.activation_checkpointing=true",
    ),
}


@pytest.fixture(scope="module")
def loaded(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What each load measured and found, all in one spawn of four ranks."""
    tmp = tmp_path_factory.mktemp("loads")
    jobs: list[tuple[Callable[..., None], str, str, tuple]] = []
    outs = {}

    def add(name: str, reference: Path | None, *overrides: str) -> None:
        run_dir, init = prepare(tmp, name, *overrides)
        reference = reference or ensure_checkpoint(load_run_config(run_dir).model)
        outs[name] = tmp / f"{name}.pt"
        args = (str(outs[name]), str(reference))
        jobs.append((loading.build_and_compare, str(init), str(run_dir), args))

    for name, overrides in LOADS.items():
        add(name, None, *overrides)
    # An FP8 block checkpoint of a random model, and what it dequantizes to (reference).
    source = ensure_checkpoint(compose_run(*FP8_GLM5).model)
    fp8_dir, dequantized = tmp / "fp8", tmp / "dequantized"
    loading.write_fp8_checkpoint(source, fp8_dir, dequantized)
    add("fp8-efsdp2xep2", dequantized, *FP8_GLM5, f"model.path={fp8_dir}", *EP)
    with pytest.MonkeyPatch.context() as env:
        # The test's tensors are a few MB: glibc would keep their freed pages in its heap and
        # count them resident (GLM-5's, hundreds of MB, are mapped and unmapped each time).
        env.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
        mp.spawn(dist_workers.in_sequence, args=(WORLD, jobs), nprocs=WORLD, join=True)
    return {name: torch.load(out) for name, out in outs.items()}


@pytest.mark.parametrize("name", [*LOADS, "fp8-efsdp2xep2"])
def test_sharded_load_equals_the_whole_load(loaded: dict[str, Any], name: str) -> None:
    assert loaded[name]["wrong"] == []


@pytest.mark.parametrize("name", [*LOADS, "fp8-efsdp2xep2"])
def test_a_version_published_block_by_block_equals_the_whole_gathered_one(
    loaded: dict[str, Any], name: str
) -> None:
    """The trainer's publish (every block gathered, converted and written in turn; FP8
    re-quantized for the FP8 base) writes the same tensors, bit for bit, as the whole gathered
    state written at once, but a tied LM head: it is the embedding, left out as the
    checkpoints themselves leave it."""
    assert loaded[name]["unlike"] == []


def test_publishing_grows_rank_0_by_a_block_not_the_model(loaded: dict[str, Any]) -> None:
    """Before, rank 0 gathered every weight to publish a version: it grew by the whole model
    (~276 MB here) and then by the file written from it. Block by block it holds one decoder
    layer (54 MB here), its converted copy and the bytes of the file being written: measured
    ~170 MB."""
    measured = loaded["medium-glm5-efsdp2xep2"]
    whole = sum(held for _, held in measured["measured"])
    assert measured["published"] < 0.8 * whole, (measured["published"], whole)


def test_each_rank_grows_by_its_shard_not_the_model(loaded: dict[str, Any]) -> None:
    measured = loaded["medium-glm5-efsdp2xep2"]["measured"]
    whole = sum(held for _, held in measured)
    assert whole > 200e6  # the model is large enough for the bound to tell
    for rank, (growth, held) in enumerate(measured):
        assert held < whole / WORLD * 1.1, (rank, held)
        assert growth <= held + OVERHEAD, (rank, growth / 1e6, held / 1e6)


def test_fp8_versions_are_published_in_the_base_format(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version of an FP8 base is re-quantized into the base's format: the same files,
    names, dtypes and shapes, and each weight's values and block scales those of the reference
    quantizer; broadcast, the same tensors; loaded again, it dequantizes to what the reference
    arithmetic gives."""
    source = ensure_checkpoint(compose_run(*FP8_GLM5).model)
    fp8_dir, dequantized = tmp_path / "fp8", tmp_path / "dequantized"
    loading.write_fp8_checkpoint(source, fp8_dir, dequantized)
    model = empty_model(fp8_dir, dtype="bfloat16").eval()
    load_shards(model, fp8_dir, torch.device("cpu"), partial(adapter_start, seed=0))
    state = inference_state(model, checkpoint_layout=True)
    target = tmp_path / "step_1"
    publish_weights(model, load_tokenizer(source), target, fp8_base=fp8_dir)
    for extra in ("config.json", "model.safetensors.index.json"):
        assert (target / extra).read_text() == (fp8_dir / extra).read_text()
    published: dict[str, torch.Tensor] = {}
    for file in sorted(p.name for p in fp8_dir.glob("*.safetensors")):
        with safe_open(fp8_dir / file, "pt") as want, safe_open(target / file, "pt") as got:
            assert sorted(got.keys()) == sorted(want.keys())
            for key in want.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                old, new = want.get_slice(key), got.get_slice(key)
                assert (new.get_dtype(), new.get_shape()) == (old.get_dtype(), old.get_shape())
                published[key] = got.get_tensor(key)
    quantized = [k for k in state if f"{k}_scale_inv" in published]
    for key, tensor in state.items():
        if key not in quantized:
            assert torch.equal(published[key], tensor), key
            continue
        values, scales = loading.quantize_blocks(tensor)
        assert torch.equal(published[key].view(torch.uint8), values.view(torch.uint8)), key
        assert torch.equal(published[f"{key}_scale_inv"], scales), key
    assert len(quantized) > 20
    # Broadcast to vLLM, the same version travels as the same tensors, bit for bit.
    cfg = compose_run(*FP8_GLM5, f"model.path={fp8_dir}", "inference.backend=vllm",
                      "inference.weight_transport=broadcast")  # fmt: skip
    sent: dict[str, torch.Tensor] = {}
    monkeypatch.setenv(TOKEN_ENV, "fp8-test")
    RunDir(tmp_path).write_address("inference-0", "127.0.0.1", 9)  # never called
    broadcaster = InferenceBroadcaster(
        tmp_path, cfg, logging.getLogger("test"), checkpoint_layout=engine_of(cfg).checkpoint_layout
    )
    monkeypatch.setattr(broadcaster, "update", lambda version, tensors: sent.update(tensors))
    broadcaster.publish(1, model)
    # Block by block (a sharded trainer's way): announced from meta shapes, then streamed.
    streamed: dict[str, torch.Tensor] = {}

    def stream(version: int, update: Any) -> None:
        specs, values = update
        for spec, value in zip(specs, values, strict=True):
            assert (spec.dtype, spec.shape) == (str(value.dtype)[6:], tuple(value.shape))
            streamed[spec.name] = value

    monkeypatch.setattr(broadcaster, "update", stream)
    broadcaster.publish(1, model, GatheredBlocks(model, rank=0))
    for received in (sent, streamed):
        assert sorted(received) == sorted(published)
        for key, tensor in published.items():
            assert received[key].dtype == tensor.dtype, key
            assert torch.equal(received[key].view(torch.uint8), tensor.view(torch.uint8)), key
    reloaded = empty_model(target, dtype="bfloat16").eval()
    load_shards(reloaded, target, torch.device("cpu"), partial(adapter_start, seed=0))
    again = inference_state(reloaded, checkpoint_layout=True)
    for key in quantized:
        want = loading.dequantize_blocks(*loading.quantize_blocks(state[key]))
        assert torch.equal(again[key], want.to(torch.bfloat16)), key
