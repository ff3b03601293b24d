"""Weight broadcast over gloo between real processes: the test is rank 0, spawned processes
receive. Bytes must arrive bit-identical for every dtype, across bucket boundaries, and a
receiver that never joins must end in a timeout naming it. Also what the trainer sends, and
which `weights/step_N` it keeps."""

from __future__ import annotations

import io
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rl.core.model import (
    ensure_checkpoint,
    inference_state,
    load_model,
    load_tokenizer,
    publish_weights,
)
from rl.core.rundir import COMPLETE, RunDir
from rl.weights.published import RefusedWeights, published_dir
from rl.weights.sync import (
    CorruptUpdate,
    TensorSpec,
    WeightGroupSpec,
    WeightReceiver,
    WeightSender,
    buckets,
    specs_of,
)
from tests.support.runs import compose_run


def updates(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of several dtypes and shapes (a 0-d one, a non-contiguous one, one larger
    than the test's bucket)."""
    gen = torch.Generator().manual_seed(seed)
    big = torch.randn(40, 50, generator=gen)
    return {
        "layers.0.weight": torch.randn(7, 3, generator=gen).to(torch.bfloat16),
        "layers.0.half": torch.randn(5, generator=gen).half(),
        "layers.0.scale": torch.tensor(3.25, dtype=torch.float64),
        "layers.1.big": big,
        "layers.1.transposed": big[:9, :4].t(),
        "ids": torch.randint(-(2**40), 2**40, (11,), generator=gen),
        "mask": torch.rand(13, generator=gen) > 0.5,
        "fp8": torch.randn(17, generator=gen).to(torch.float8_e4m3fn),
        "bytes": torch.randint(0, 256, (3, 3), dtype=torch.uint8, generator=gen),
    }


def receive_twice(spec: WeightGroupSpec, member: str, out: Any) -> None:
    receiver = WeightReceiver(spec, member)
    got: dict[str, torch.Tensor] = {}
    first = receiver.receive(lambda tensors: got.update((n, t.clone()) for n, t in tensors))

    def fail_after_one(tensors: Any) -> None:
        next(iter(tensors))
        raise ValueError("load failed")

    try:  # a failing consumer: the rest is still received, so the group stays in step
        receiver.receive(fail_after_one)
    except ValueError as err:
        failed = str(err)
    third: dict[str, torch.Tensor] = {}
    last = receiver.receive(lambda tensors: third.update((n, t.clone()) for n, t in tensors))
    try:  # the sender's fourth update is altered on the way: its digest gives it away
        receiver.receive(lambda tensors: dict(tensors))
        corrupt = ""
    except CorruptUpdate as err:
        corrupt = str(err)
    out.put(pickled((receiver.rank, first, got, failed, last, third, corrupt)))


class AlteringSender(WeightSender):
    """A sender whose buckets, once `alter` is set, arrive with one byte flipped (after it
    hashed them): a transfer corrupted on the way."""

    alter = False
    sent_bytes = 0  # uint8 broadcasts since `alter` was set: the header, then the buckets

    def broadcast(self, buffer: torch.Tensor) -> None:
        if self.alter and buffer.dtype == torch.uint8:
            self.sent_bytes += 1
            if self.sent_bytes == 2:  # the first bucket
                buffer = buffer.clone()
                buffer[0] ^= 1
        super().broadcast(buffer)


def pickled(result: Any) -> bytes:
    """`result` as bytes: a queue would pass tensors as shared-memory file descriptors, which
    are lost when this process exits before the test has read them."""
    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def unpickled(data: bytes) -> Any:
    return torch.load(io.BytesIO(data))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_updates_arrive_bit_identical_over_gloo() -> None:
    sender = AlteringSender("127.0.0.1", "gloo", timeout_s=60)
    sender.bucket_bytes = 1024  # several buckets, and one tensor larger than a bucket
    spec = sender.new_group(receivers=2)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=receive_twice, args=(spec, member, out)) for member in ("a", "b")]
    for proc in procs:
        proc.start()
    try:
        sender.join(spec, {"a": 1, "b": 1})
        sent = sender.send(5, updates(0))
        sender.send(6, updates(1))
        # Announced from shapes alone (meta tensors), each tensor made only when its bucket
        # fills: how a sharded trainer sends a version it gathers block by block.
        streamed = updates(2)
        made: list[str] = []
        meta = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in streamed.items()}

        def lazily() -> Any:
            for name, tensor in streamed.items():
                made.append(name)
                yield tensor

        values = lazily()
        sender.send_stream(7, specs_of(meta), values)
        assert made == list(streamed) and next(values, None) is None
        sender.alter = True
        sender.send(8, updates(3))
        results = [unpickled(out.get(timeout=120)) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
    assert sorted(r[0] for r in results) == [1, 2]
    expected, last = updates(0), updates(2)
    for _, first, got, failed, final, third, corrupt in results:
        assert "version 8: its bytes' SHA-256 is not the one the trainer sent" in corrupt
        assert first["version"] == 5 and final["version"] == 7
        assert first["bytes"] == sent > sum(bits(t).numel() for t in expected.values())
        assert first["tensors"] == len(expected) and failed == "load failed"
        for reference, received in ((expected, got), (last, third)):
            assert list(received) == list(reference)
            for name, tensor in reference.items():
                assert received[name].dtype == tensor.dtype, name
                assert received[name].shape == tensor.shape, name
                assert torch.equal(bits(received[name]), bits(tensor)), name
    assert all(proc.exitcode == 0 for proc in procs)


def test_receiver_that_never_joins_times_out_naming_it() -> None:
    sender = WeightSender("127.0.0.1", "gloo", timeout_s=2)
    spec = sender.new_group(receivers=2)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    present = ctx.Process(target=receive_twice, args=(spec, "inference-0", out))
    present.start()
    try:
        while not sender.joined(spec, ["inference-0"])["inference-0"]:
            assert present.is_alive()
            time.sleep(0.05)
        start = time.monotonic()
        with pytest.raises(TimeoutError) as err:
            sender.join(spec, {"inference-0": 1, "inference-1": 1})
        assert time.monotonic() - start < 10
    finally:
        present.join(timeout=30)  # its own group formation times out too
        if present.is_alive():
            present.kill()
    message = str(err.value)
    assert "inference-1 (0 of 1 receivers) did not join the gloo group within 2 s" in message
    assert "inference-0" not in message


def test_bucket_layout_is_aligned_and_bounded() -> None:
    specs = [TensorSpec(f"t{i}", "float32", (n,)) for i, n in enumerate([3, 100, 1, 500, 2])]
    layout = buckets(specs, limit=512)
    # 12, 400 and 4 bytes share a bucket; the 2000-byte tensor travels alone.
    assert [offsets for _, offsets in layout] == [[0, 16, 416], [0], [0]]
    assert [size for size, _ in layout] == [420, 2000, 8]
    assert all(o % 16 == 0 for _, offsets in layout for o in offsets)


def test_inference_state_names_and_tied_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the trainer sends: HF names (no activation-checkpointing wrapper), and the tied
    embedding once, as `save_pretrained` writes it."""
    monkeypatch.setenv("RELAY_CACHE", str(tmp_path))
    model = load_model(ensure_checkpoint(compose_run().model))
    state = inference_state(model)
    assert "model.embed_tokens.weight" in state and "lm_head.weight" not in state
    wrapped = {k.replace(".mlp.", "._checkpoint_wrapped_module.mlp."): v
               for k, v in model.state_dict().items()}  # fmt: skip
    assert list(inference_state(model, wrapped)) == list(state)


def test_checkpoint_layout_is_what_publish_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What vLLM is sent equals what `weights/step_N` holds, MoE experts (stacked in the
    module, one tensor each on disk) included; the embedded engine gets the module's layout."""
    from safetensors.torch import load_file

    monkeypatch.setenv("RELAY_CACHE", str(tmp_path))
    base = ensure_checkpoint(compose_run("model=tiny_qwen3_moe").model)
    model = load_model(base)
    publish_weights(model, load_tokenizer(base), tmp_path / "step_1")
    on_disk = load_file(tmp_path / "step_1" / "model.safetensors")
    sent = inference_state(model, checkpoint_layout=True)
    assert sorted(sent) == sorted(on_disk) and any(".experts.0." in k for k in sent)
    assert all(torch.equal(sent[k], on_disk[k]) for k in sent)
    assert set(inference_state(model)) <= set(model.state_dict())


def test_pruning_keeps_version_0_and_the_newest(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    for version in (0, 2, 4, 5, 6, 8):
        run_dir.weights_for(version).mkdir(parents=True)
        (run_dir.weights_for(version) / COMPLETE).touch()
    run_dir.weights_for(9).mkdir()  # being written: not complete, not counted
    run_dir.prune_versions(keep=3)
    assert run_dir.published_versions() == [0, 5, 6, 8]
    assert run_dir.weights_for(9).exists()


def test_only_versions_the_trainer_recorded_are_published(tmp_path: Path) -> None:
    """A complete `step_N` the trainer did not record (a stray, or planted) is neither the
    newest version, nor loaded, nor counted when pruning: it is reported and left alone."""
    run_dir = RunDir(tmp_path)
    for version in (0, 2, 4, 5, 777000):
        run_dir.weights_for(version).mkdir(parents=True)
        (run_dir.weights_for(version) / COMPLETE).touch()
        if version != 777000:
            run_dir.record_published(version)
    assert run_dir.published_versions() == [0, 2, 4, 5]
    assert run_dir.newest_version() == 5
    assert run_dir.prune_versions(keep=2) == [run_dir.weights_for(777000)]
    assert run_dir.published_versions() == [0, 4, 5]
    assert run_dir.weights_for(777000).exists() and not run_dir.weights_for(2).exists()
    assert "version 777000 is not published" in str(
        pytest.raises(RefusedWeights, published_dir, run_dir.root, 777000).value
    )
