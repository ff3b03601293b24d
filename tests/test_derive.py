"""Values derived from a run config (rl/core/derive.py): each decided in one place, used by the
planner and by the roles. No torch here."""

from __future__ import annotations

import pytest

from rl.core.derive import (
    LayoutError,
    ParallelDims,
    broadcast_backend,
    learning_rate,
    lr_factor,
    max_model_len,
    trainer_dims,
)
from rl.inference.engines import engine_name
from tests.support.runs import compose_run


def test_parallel_dims_are_checked_without_a_mesh() -> None:
    assert ParallelDims(2, 2, 1, 1, 4).fsdp_dims == ("dp_replicate", "dp_shard_cp")
    assert ParallelDims(1, 4, 1, 2, 4).expert_fsdp_dims == ("efsdp_cp",)
    assert ParallelDims(1, 2, 2, 1, 4).dp == 2
    with pytest.raises(LayoutError, match="= 4, but the trainer has 8 ranks"):
        ParallelDims(2, 2, 1, 1, 8)
    with pytest.raises(LayoutError, match=r"ep=3: must divide dp_shard=4"):
        ParallelDims(1, 4, 1, 3, 4)
    with pytest.raises(LayoutError, match="dp_shard=0: must be >= 1"):
        ParallelDims(1, 0, 1, 1, 0)


def test_trainer_dims_fill_dp_shard_from_the_ranks() -> None:
    hsdp = compose_run("parallel=hsdp").parallel.trainer
    assert hsdp.dp_shard == -1
    assert trainer_dims(hsdp, 8) == ParallelDims(hsdp.dp_replicate, 8 // hsdp.dp_replicate, 1, 1, 8)
    # Nothing says how many processes a CPU cluster has: -1 means one shard per replica.
    assert trainer_dims(hsdp) == ParallelDims(hsdp.dp_replicate, 1, 1, 1, hsdp.dp_replicate)
    fixed = compose_run("parallel=fsdp", "parallel.trainer.dp_shard=2").parallel.trainer
    assert trainer_dims(fixed, 8).world == 2


def test_trainer_tensor_parallelism_is_refused_not_turned_into_fsdp() -> None:
    """The trainer has no TP: asking for it fails naming the key, instead of its ranks quietly
    becoming FSDP ranks."""
    par = compose_run("parallel=fsdp", "parallel.trainer.tp=2").parallel.trainer
    with pytest.raises(LayoutError, match=r"^parallel.trainer.tp=2: the trainer has no tensor"):
        trainer_dims(par, 8)


def test_backend_length_lr_and_broadcast_backend() -> None:
    cpu = compose_run()
    assert engine_name(cpu) == "embedded"
    assert broadcast_backend(cpu) == "gloo"
    gpu = compose_run("cluster.gpus_per_node=8")
    assert engine_name(gpu) == "vllm"
    assert broadcast_backend(gpu) == "nccl"
    assert (
        engine_name(compose_run("cluster.gpus_per_node=8", "inference.backend=embedded"))
        == "embedded"
    )
    assert broadcast_backend(compose_run("inference.broadcast_backend=nccl")) == "nccl"
    assert max_model_len(cpu) == (cpu.model.inference.max_model_len or cpu.model.context_length)
    assert max_model_len(compose_run("model.inference.max_model_len=77")) == 77
    assert learning_rate(cpu) == cpu.model.lr
    assert learning_rate(compose_run("algorithm.lr=1e-5")) == 1e-5
    # LoRA trains at ten times the model's rate unless a rate is given (the README's 3e-3).
    assert learning_rate(compose_run("model.lora.rank=8")) == 3e-3  # model=tiny: 3e-4
    assert learning_rate(compose_run("model.lora.rank=8", "algorithm.lr=1e-3")) == 1e-3


def test_the_learning_rate_rises_over_its_warm_up_then_follows_its_schedule() -> None:
    """algorithm.lr_schedule and lr_warmup_steps over max_steps=10: a straight rise to lr at
    the last warm-up step, then constant, or down to zero at max_steps (linear: in equal
    steps; cosine: symmetric about the midpoint of what is left)."""
    factors = {
        kind: [lr_factor(step, compose_run(f"algorithm.lr_schedule={kind}",
                                           "algorithm.lr_warmup_steps=2", "max_steps=10"))
               for step in range(10)]
        for kind in ("constant", "linear", "cosine")
    }  # fmt: skip
    for kind, f in factors.items():
        assert f[:3] == [0.5, 1.0, 1.0], kind
    assert factors["constant"][2:] == [1.0] * 8
    linear = factors["linear"][2:]
    assert linear == pytest.approx([1 - k / 8 for k in range(8)])
    cosine = factors["cosine"][2:]
    assert all(a > b for a, b in zip(cosine, cosine[1:], strict=False))
    assert [a + b for a, b in zip(cosine[1:], reversed(cosine[1:]), strict=True)] == pytest.approx(
        [1.0] * 7
    )
    assert lr_factor(0, compose_run("max_steps=10")) == 1.0  # the default: constant, no rise
