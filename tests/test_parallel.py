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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from rl.core.model import load_model
from tests.support import dist_workers, parallel
from tests.support.parallel import RTOL, assert_same_gradients, prepare

cache = parallel.cache  # the module's model cache (a fixture)

EP = "parallel.trainer.ep=2"
AC = "trainer.activation_checkpointing=true"
OFFLOAD = "trainer.activation_offload=true"
CHUNK = "trainer.lm_head_chunk=5"
KL = ["algorithm=grpo", "algorithm.kl_coef=1.0"]  # GRPO's loss is the one with a KL term
# Layouts whose one step is compared with a single process: id -> (world, model, options,
# shards: the degree each weight is split over).
LAYOUTS = {
    "fsdp2": (2, "tiny", ["parallel=fsdp"], 2),
    "fsdp4": (4, "tiny", ["parallel=fsdp"], 4),
    "hsdp2x2": (4, "tiny", ["parallel=hsdp"], 2),
    "fsdp2-checkpointing": (2, "tiny", ["parallel=fsdp", AC], 2),
    "ep2-qwen3moe": (2, "tiny_qwen3_moe", ["parallel=fsdp", EP], 2),
    "ep2-glm5": (2, "tiny_glm5", ["parallel=fsdp", EP], 2),
    "ep2-minimax": (2, "tiny_minimax_m2", ["parallel=fsdp", EP], 2),
    "efsdp2xep2-qwen3moe": (4, "tiny_qwen3_moe", ["parallel=fsdp", EP], 4),
    "efsdp2xep2-glm5": (4, "tiny_glm5", ["parallel=fsdp", EP], 4),
    "hsdp2-ep2-minimax": (4, "tiny_minimax_m2", ["parallel=hsdp", EP], 2),
    "cp2": (2, "tiny", ["parallel=cp2"], 2),
    # One sample a row: CP's causal attention without a mask.
    "fsdp2xcp2-unpacked": (4, "tiny", ["parallel=cp2", "trainer.packing=false"], 4),
    # The LM head in chunks (of 5 positions: several per micro-batch), alone, under CP, with
    # expert parallelism and with activation checkpointing whose block inputs are offloaded.
    "single-chunked-head": (1, "tiny", ["parallel=single", CHUNK], 1),
    "cp2-chunked-head": (2, "tiny", ["parallel=cp2", CHUNK], 2),
    "ep2-glm5-chunked-head": (2, "tiny_glm5", ["parallel=fsdp", EP, CHUNK], 2),
    "fsdp2-offloaded-checkpoints": (2, "tiny", ["parallel=fsdp", AC, OFFLOAD, CHUNK], 2),
}


@pytest.fixture(scope="module")
def steps(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What every layout's step produced (and one process's, per model, as `single-<model>`;
    and two ranks with uneven micro-batches, as `uneven`): ranks spawned once per world size."""
    tmp = tmp_path_factory.mktemp("steps")
    runs: dict[int, list[tuple[Callable[..., None], str, str, tuple]]] = {}
    outs: dict[str, Path] = {}

    def add(world: int, name: str, body: Callable[..., None], *overrides: str) -> None:
        run_dir, init = prepare(tmp, name, *overrides)
        outs[name] = tmp / f"{name}.pt"
        runs.setdefault(world, []).append((body, str(init), str(run_dir), (str(outs[name]),)))

    for model in sorted({model for _, model, _, _ in LAYOUTS.values()}):
        add(1, f"single-{model}", dist_workers.one_step, f"model={model}", "parallel=single")
    for name, (world, model, options, _) in LAYOUTS.items():
        add(world, name, dist_workers.one_step, f"model={model}", *options)
    add(2, "uneven", dist_workers.uneven_micro_batches, "parallel=fsdp")
    add(1, "single-grpo", dist_workers.one_step, "parallel=single", KL[0])
    add(1, "single-kl", dist_workers.one_step, "parallel=single", *KL)
    add(2, "fsdp2-kl", dist_workers.one_step, "parallel=fsdp", *KL)
    for world, jobs in runs.items():
        mp.spawn(dist_workers.in_sequence, args=(world, jobs), nprocs=world, join=True)
    return {name: torch.load(out) for name, out in outs.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_step_matches_a_single_process(steps: dict[str, Any], layout: str) -> None:
    world, model, options, shards = LAYOUTS[layout]
    want, got = steps[f"single-{model}"], steps[layout]
    if AC in options:  # blocks keep only their inputs
        assert got["kept"] < want["kept"] / 4, (got["kept"], want["kept"])
    # No rank reads the checkpoint whole: each reads its own shards (tests/test_sharded_load.py).
    assert want["reads"] == [0] and got["reads"] == [0] * world, got["reads"]
    assert got["loss"] == pytest.approx(want["loss"], rel=RTOL)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL)
    assert_same_gradients(got["grads"], want["grads"])
    whole = want["bytes"][0]
    assert sum(got["bytes"]) >= whole * (world // shards)  # every weight held somewhere
    for held in got["bytes"]:
        # Dim-0 shards are padded to a multiple of the degree, and a tensor's rows split
        # unevenly when they do not divide: within a few percent of whole / shards.
        assert whole / shards * 0.95 - 4096 <= held <= whole / shards * 1.05 + 4096, held


def test_kl_reference_on_sharded_ranks(steps: dict[str, Any]) -> None:
    """With `algorithm.kl_coef > 0` the reference is a copy of the sharded policy, sharded as
    it is: each rank holds half of it (it held the whole model on every rank before), and the
    step equals one process's."""
    want, got = steps["single-kl"], steps["fsdp2-kl"]
    whole = want["reference_bytes"][0]
    assert whole == want["bytes"][0]
    for held in got["reference_bytes"]:
        assert whole / 2 * 0.95 - 4096 <= held <= whole / 2 * 1.05 + 4096, (held, whole)
    assert got["reference_reloaded"] and want["reference_reloaded"]  # saved, then read back
    no_kl = steps["single-grpo"]["loss"]
    assert abs(want["loss"] - no_kl) > 1e-3  # the KL term counts
    assert got["loss"] == pytest.approx(want["loss"], rel=RTOL)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL)
    assert_same_gradients(got["grads"], want["grads"])


def test_ranks_with_different_micro_batch_counts_step_together(steps: dict[str, Any]) -> None:
    assert_same_gradients(steps["uneven"]["grads"], steps["single-tiny"]["grads"])


# Checkpointed layouts: id -> (model, options).
CHECKPOINTED = {
    "fsdp2": ("tiny", ["parallel=fsdp"]),
    "ep2-qwen3moe": ("tiny_qwen3_moe", ["parallel=fsdp", EP]),
}


@pytest.fixture(scope="module")
def resumed(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per checkpointed layout, its run directory and files `<run>/<phase>_<step>.pt` of the
    whole weights after each step: `straight` (two ranks, steps 1-4, checkpoint after 2),
    `again_2` (two ranks resuming, steps 3-4), `again_1` (one process, parallel=single, step
    3). Each phase runs every layout in one spawn."""
    tmp = tmp_path_factory.mktemp("resumed")
    runs: dict[str, Path] = {}
    straight, again, single = [], [], []
    steps = dist_workers.steps
    for name, (model, options) in CHECKPOINTED.items():
        run_dir, init = prepare(tmp, name, f"model={model}", *options)
        runs[name] = run_dir
        straight.append(
            (dist_workers.steps, str(init), str(run_dir), (f"{run_dir}/straight", 1, 4))
        )
        again.append(
            (dist_workers.steps, f"{init}_again", str(run_dir), (f"{run_dir}/again_2", 3, 4))
        )
        one, one_init = prepare(tmp, f"{name}_single", f"model={model}", "parallel=single")
        single.append((steps, str(one_init), str(one), (f"{run_dir}/again_1", 3, 3)))
    mp.spawn(dist_workers.in_sequence, args=(2, straight), nprocs=2, join=True)
    for name, run_dir in runs.items():  # the single process resumes the 2-rank checkpoint
        shutil.copytree(run_dir / "checkpoints", tmp / f"{name}_single" / "checkpoints")
    mp.spawn(dist_workers.in_sequence, args=(2, again), nprocs=2, join=True)
    mp.spawn(dist_workers.in_sequence, args=(1, single), nprocs=1, join=True)
    return runs


@pytest.mark.parametrize("layout", list(CHECKPOINTED))
def test_checkpoint_resumes_into_the_same_steps(resumed: dict[str, Path], layout: str) -> None:
    """Two ranks train steps 1-4, checkpointing after step 2; from that checkpoint two ranks
    train steps 3-4 again, and one process (parallel=single: whole experts) trains step 3:
    each lands on the same weights."""
    run_dir = resumed[layout]
    assert (run_dir / "checkpoints" / "step_2" / "COMPLETE").exists()
    # The HF export (per-expert tensors, as published checkpoints store them) loads back into
    # the step's whole weights.
    exported = load_model(run_dir / "weights" / "step_2", dtype="float32").state_dict()
    whole = torch.load(run_dir / "straight_2.pt")
    assert exported.keys() == whole.keys()
    assert all(torch.equal(exported[k], whole[k]) for k in whole), "export differs"
    for world, last in ((2, 4), (1, 3)):
        for step in range(3, last + 1):
            want = torch.load(run_dir / f"straight_{step}.pt")
            got = torch.load(run_dir / f"again_{world}_{step}.pt")
            assert want.keys() == got.keys()
            for name, tensor in want.items():
                # Same world: bit for bit; one process: float32 rounding of the other order.
                atol = 0.0 if world == 2 else 1e-5
                torch.testing.assert_close(got[name], tensor, rtol=0, atol=atol, msg=name)


GPU_MODELS = ("tiny", "tiny_qwen3_moe")


@pytest.fixture(scope="module")
def cpu_steps(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process's CPU step per model, the GPU test's reference (without the many-rank
    layouts of `steps`, which the GPU test does not need)."""
    tmp = tmp_path_factory.mktemp("cpu_steps")
    jobs, outs = [], {}
    for model in GPU_MODELS:
        run_dir, init = prepare(tmp, model, f"model={model}", "parallel=single")
        outs[model] = tmp / f"{model}.pt"
        jobs.append((dist_workers.one_step, str(init), str(run_dir), (str(outs[model]),)))
    mp.spawn(dist_workers.in_sequence, args=(1, jobs), nprocs=1, join=True)
    return {f"single-{model}": torch.load(out) for model, out in outs.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("model", GPU_MODELS)
def test_one_step_on_a_gpu_matches_the_cpu(
    cpu_steps: dict[str, Any], tmp_path: Path, model: str
) -> None:
    """The trainer on this machine's GPU (one process): the loss and gradients of the CPU's
    step. GPU kernels sum in other orders (SDPA, matmul tiling): 1e-4 of the largest gradient."""
    cuda = ("trainer.device=cuda",)
    run_dir, init = prepare(tmp_path, "gpu", f"model={model}", "parallel=single", *cuda)
    out = tmp_path / "gpu.pt"
    mp.spawn(dist_workers.one_step, args=(1, str(init), str(run_dir), str(out)), nprocs=1)
    got, want = torch.load(out), cpu_steps[f"single-{model}"]
    assert got["device"] == "cuda" and want["device"] == "cpu"
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
    scale = max(g.abs().max().item() for g in want["grads"].values())
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=1e-4 * scale, msg=name)
