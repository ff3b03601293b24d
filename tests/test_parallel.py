"""The trainer's parallelism on CPU with gloo, ranks spawned as processes: FSDP2 and HSDP give
the loss and gradients of a single process, parameter bytes per rank shrink with the shard
degree, and DCP checkpoints resume (also onto another world size) into the same next steps.

Tolerance: ranks sum partial gradients in another order than one process summing over the
whole batch, so float32 results differ by rounding: a few ulps of the largest gradient, far
below 1e-5 of it (a wrong shard, scale or mask moves them by whole percents).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

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
def reference(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("reference")
    out = tmp / "one.pt"
    run_ranks(1, tmp, dist_workers.one_step, "parallel=single", args=(str(out),))
    return torch.load(out)


@pytest.mark.parametrize(
    ("world", "options", "shards"),
    [
        (2, ["parallel=fsdp"], 2),
        (4, ["parallel=fsdp"], 4),
        (4, ["parallel=hsdp"], 2),
        (2, ["parallel=fsdp", "trainer.activation_checkpointing=true"], 2),
        (2, ["parallel=fsdp", "trainer.packing=false"], 2),
    ],
    ids=["fsdp2", "fsdp4", "hsdp2x2", "fsdp2-checkpointing", "fsdp2-unpacked"],
)
def test_one_step_matches_a_single_process(
    reference: dict[str, Any], tmp_path: Path, world: int, options: list[str], shards: int
) -> None:
    out = tmp_path / "out.pt"
    run_ranks(world, tmp_path, dist_workers.one_step, *options, args=(str(out),))
    got = torch.load(out)
    if "trainer.activation_checkpointing=true" in options:  # blocks keep only their inputs
        assert got["kept"] < reference["kept"] / 4, (got["kept"], reference["kept"])
    assert got["loss"] == pytest.approx(reference["loss"], rel=RTOL)
    assert_same_gradients(got["grads"], reference["grads"])
    whole = reference["bytes"][0]
    for held in got["bytes"]:
        # Dim-0 shards are padded to a multiple of the degree: a little over whole / shards.
        assert whole / shards <= held <= whole / shards * 1.05 + 4096, (held, whole)


def test_ranks_with_different_micro_batch_counts_step_together(
    reference: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "out.pt"
    run_ranks(2, tmp_path, dist_workers.uneven_micro_batches, "parallel=fsdp", args=(str(out),))
    assert_same_gradients(torch.load(out)["grads"], reference["grads"])


def test_checkpoint_resumes_into_the_same_steps(cache: Path, tmp_path: Path) -> None:
    """Two ranks train steps 1-4, checkpointing after step 2; from that checkpoint two ranks
    train steps 3-4 again, and one process trains step 3: each lands on the same weights."""
    straight = tmp_path / "straight"
    run_dir = run_ranks(
        2, tmp_path, dist_workers.steps, "parallel=fsdp", args=(str(straight), 1, 4)
    )
    assert (run_dir / "checkpoints" / "step_2" / "COMPLETE").exists()
    assert (run_dir / "weights" / "step_2" / "model.safetensors").exists()  # HF export
    for world, last in ((2, 4), (1, 3)):
        again = tmp_path / f"again_{world}"
        args = (world, str(tmp_path / f"init_again_{world}"), str(run_dir), str(again), 3, last)
        mp.spawn(dist_workers.steps, args=args, nprocs=world, join=True)
        for step in range(3, last + 1):
            want, got = torch.load(f"{straight}_{step}.pt"), torch.load(f"{again}_{step}.pt")
            for name, tensor in want.items():
                # Same world: bit for bit; one process: float32 rounding of the other order.
                atol = 0.0 if world == 2 else 1e-5
                torch.testing.assert_close(got[name], tensor, rtol=0, atol=atol, msg=name)


def test_parallel_dims_are_checked_without_a_mesh() -> None:
    assert ParallelDims(2, 2, 1, 1, 4).fsdp_dims == ("dp_replicate", "dp_shard")
    assert ParallelDims(1, 4, 1, 2, 4).fsdp_dims == ("dp_shard",)
    with pytest.raises(ValueError, match="= 4, but the trainer has 8 ranks"):
        ParallelDims(2, 2, 1, 1, 8)
    with pytest.raises(ValueError, match=r"ep=3: must divide dp_shard x cp = 4 x 1"):
        ParallelDims(1, 4, 1, 3, 4)
    with pytest.raises(ValueError, match="dp_shard=0: must be >= 1"):
        ParallelDims(1, 0, 1, 1, 0)
    hsdp = compose_run("parallel=hsdp").parallel.trainer
    assert from_config(hsdp, 8) == ParallelDims(2, 4, 1, 1, 8)
