"""The trainer's parallelism on CPU with gloo, ranks spawned as processes: FSDP2, HSDP, expert
parallelism (a tiny random model of each MoE family: Qwen3-MoE, GlmMoeDsa for GLM-5,
MiniMax-M2) and context parallelism give the loss, gradient norm and gradients of a single
process; parameter bytes per rank shrink with the shard degree; DCP checkpoints resume (also
onto another world size) into the same next steps.

Tolerance: ranks sum partial gradients in another order than one process summing over the
whole batch, experts run token by token where the reference groups them, and CP's attention
sums over gathered keys: float32 results differ by rounding, a few ulps of the largest
gradient, far below 1e-5 of it (a wrong shard, scale, routing or mask moves them by whole
percents).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from rl.model import load_model
from rl.parallel import ParallelDims, from_config
from tests import dist_workers
from tests.conftest import TOKEN, compose_run, write_run_dir

RTOL = 1e-5


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("relay_cache")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("RELAY_CACHE", str(path))
        yield path


def run_ranks(
    world: int, tmp: Path, fn: Callable[..., None], *overrides: str, args: tuple = ()
) -> Path:
    """Spawn `world` ranks of `fn` on a fresh run directory; returns the run directory."""
    cfg = compose_run(*overrides, "algorithm.max_grad_norm=1e9")
    run_dir = write_run_dir(tmp / f"run_{world}_{len(list(tmp.iterdir()))}", cfg, TOKEN)
    init = tmp / f"init_{run_dir.name}"
    mp.spawn(fn, args=(world, str(init), str(run_dir), *args), nprocs=world, join=True)
    return run_dir


def assert_same_gradients(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    scale = max(g.abs().max().item() for g in want.values())
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=RTOL * scale, msg=name)


@pytest.fixture(scope="module")
def references(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    """One step of a single process, per model (computed once, on first use)."""
    done: dict[str, Any] = {}

    def reference(model: str) -> Any:
        if model not in done:
            tmp = tmp_path_factory.mktemp(f"reference_{model}")
            out = tmp / "one.pt"
            run_ranks(1, tmp, dist_workers.one_step, f"model={model}", "parallel=single",
                      args=(str(out),))  # fmt: skip
            done[model] = torch.load(out)
        return done[model]

    return reference


@pytest.fixture(scope="module")
def reference(references: Callable[[str], Any]) -> Any:
    return references("tiny")


EP = "parallel.trainer.ep=2"


@pytest.mark.parametrize(
    ("world", "model", "options", "shards"),
    [
        (2, "tiny", ["parallel=fsdp"], 2),
        (4, "tiny", ["parallel=hsdp"], 2),
        (2, "tiny", ["parallel=fsdp", "trainer.activation_checkpointing=true"], 2),
        (2, "tiny_qwen3_moe", ["parallel=fsdp", EP], 2),
        (4, "tiny_glm5", ["parallel=fsdp", EP], 4),
        (4, "tiny_minimax_m2", ["parallel=hsdp", EP], 2),
        (2, "tiny", ["parallel=cp2"], 2),
        (4, "tiny", ["parallel=cp2", "trainer.packing=false"], 4),
    ],
    ids=[
        "fsdp2",
        "hsdp2x2",
        "fsdp2-checkpointing",
        "ep2-qwen3moe",
        "efsdp2xep2-glm5",
        "hsdp2-ep2-minimax",
        "cp2",
        "fsdp2xcp2-unpacked",
    ],
)
def test_one_step_matches_a_single_process(
    references: Callable[[str], Any],
    tmp_path: Path,
    world: int,
    model: str,
    options: list[str],
    shards: int,
) -> None:
    want = references(model)
    out = tmp_path / "out.pt"
    run_ranks(world, tmp_path, dist_workers.one_step, f"model={model}", *options,
              args=(str(out),))  # fmt: skip
    got = torch.load(out)
    if "trainer.activation_checkpointing=true" in options:  # blocks keep only their inputs
        assert got["kept"] < want["kept"] / 4, (got["kept"], want["kept"])
    assert got["loss"] == pytest.approx(want["loss"], rel=RTOL)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL)
    assert_same_gradients(got["grads"], want["grads"])
    whole = want["bytes"][0]
    assert sum(got["bytes"]) >= whole * (world // shards)  # every weight held somewhere
    for held in got["bytes"]:
        # Dim-0 shards are padded to a multiple of the degree, and a tensor's rows split
        # unevenly when they do not divide: within a few percent of whole / shards.
        assert whole / shards * 0.95 - 4096 <= held <= whole / shards * 1.05 + 4096, held


def test_ranks_with_different_micro_batch_counts_step_together(
    reference: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "out.pt"
    run_ranks(2, tmp_path, dist_workers.uneven_micro_batches, "parallel=fsdp", args=(str(out),))
    assert_same_gradients(torch.load(out)["grads"], reference["grads"])


@pytest.mark.parametrize(
    ("model", "options"),
    [("tiny", ["parallel=fsdp"]), ("tiny_qwen3_moe", ["parallel=fsdp", EP])],
    ids=["fsdp2", "ep2-qwen3moe"],
)
def test_checkpoint_resumes_into_the_same_steps(
    cache: Path, tmp_path: Path, model: str, options: list[str]
) -> None:
    """Two ranks train steps 1-4, checkpointing after step 2; from that checkpoint two ranks
    train steps 3-4 again, and one process (parallel=single: whole experts) trains step 3:
    each lands on the same weights."""
    straight = tmp_path / "straight"
    run_dir = run_ranks(
        2, tmp_path, dist_workers.steps, f"model={model}", *options, args=(str(straight), 1, 4)
    )
    assert (run_dir / "checkpoints" / "step_2" / "COMPLETE").exists()
    # The HF export (per-expert tensors, as published checkpoints store them) loads back into
    # the step's whole weights.
    exported = load_model(run_dir / "weights" / "step_2", dtype="float32").state_dict()
    whole = torch.load(f"{straight}_2.pt")
    assert exported.keys() == whole.keys()
    assert all(torch.equal(exported[k], whole[k]) for k in whole), "export differs"
    single = write_run_dir(
        tmp_path / "single",
        compose_run(f"model={model}", "parallel=single", "algorithm.max_grad_norm=1e9"),
        TOKEN,
    )
    shutil.copytree(run_dir / "checkpoints", single / "checkpoints")
    for world, last, resumed in ((2, 4, run_dir), (1, 3, single)):
        again = tmp_path / f"again_{world}"
        args = (world, str(tmp_path / f"init_again_{world}"), str(resumed), str(again), 3, last)
        mp.spawn(dist_workers.steps, args=args, nprocs=world, join=True)
        for step in range(3, last + 1):
            want, got = torch.load(f"{straight}_{step}.pt"), torch.load(f"{again}_{step}.pt")
            assert want.keys() == got.keys()
            for name, tensor in want.items():
                # Same world: bit for bit; one process: float32 rounding of the other order.
                atol = 0.0 if world == 2 else 1e-5
                torch.testing.assert_close(got[name], tensor, rtol=0, atol=atol, msg=name)


def test_parallel_dims_are_checked_without_a_mesh() -> None:
    assert ParallelDims(2, 2, 1, 1, 4).fsdp_dims == ("dp_replicate", "dp_shard_cp")
    assert ParallelDims(1, 4, 1, 2, 4).expert_fsdp_dims == ("efsdp_cp",)
    assert ParallelDims(1, 2, 2, 1, 4).dp == 2
    with pytest.raises(ValueError, match="= 4, but the trainer has 8 ranks"):
        ParallelDims(2, 2, 1, 1, 8)
    with pytest.raises(ValueError, match=r"ep=3: must divide dp_shard=4"):
        ParallelDims(1, 4, 1, 3, 4)
    with pytest.raises(ValueError, match="dp_shard=0: must be >= 1"):
        ParallelDims(1, 0, 1, 1, 0)
    hsdp = compose_run("parallel=hsdp").parallel.trainer
    assert from_config(hsdp, 8) == ParallelDims(2, 4, 1, 1, 8)
