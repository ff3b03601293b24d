"""Mixed precision as the field keeps it: a bfloat16 model trains from float32 master weights.

At lr 1e-6 an Adam step moves a weight of ~1e-2 by ~1e-6, far below half a bfloat16 rounding
step there (~4e-5): a trainer that keeps its weights in bfloat16 drops almost every update. With
float32 master weights (and moments), each of 20 Adam steps on one fixed batch moves a weight
by lr times m/sqrt(v), which is 1 where the gradient keeps its sign and size from step to step
(the weights move by ~1e-5 in all: the gradient barely changes), and never more than 1 with
betas (0.9, 0.99): so after 20 steps most elements have moved by about 20 lr and none by more.
That bound and that count are what the maths fixes; the test holds one process, two FSDP2
ranks over gloo, and a LoRA adapter (whose B starts random here, so that A has a gradient) to
them. Also: the dtypes the trainer keeps, the bytes the planner's memory model counts for them,
and the published version, which stays in the model's dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open

from launcher.plan.costs.memory import GIB, trainer_memory
from rl.core.derive import trainer_dims
from rl.core.lora import ADAPTER_WEIGHTS, is_adapter_dir
from rl.core.safetensors_files import safetensors_files
from tests.support import dist_workers, parallel
from tests.support.runs import compose_run

cache = parallel.cache  # the module's model cache (a fixture)

LR = 1e-6
STEPS = 20
BF16 = ["model.dtype=bfloat16", f"algorithm.lr={LR}", "algorithm.max_grad_norm=1e9"]
# id -> (world, overrides)
LAYOUTS = {
    "single": (1, ["parallel=single"]),
    "fsdp2": (2, ["parallel=fsdp"]),
    "lora": (1, ["parallel=single", "model.lora.rank=8"]),
    "lora-fsdp2": (2, ["parallel=fsdp", "model.lora.rank=8"]),
}


@pytest.fixture(scope="module")
def trained(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each layout's 20 steps at lr 1e-6 on one fixed batch (dist_workers.adam_steps), ranks
    spawned once per world size."""
    tmp = tmp_path_factory.mktemp("bf16")
    jobs: dict[int, list[tuple]] = {}
    outs, runs = {}, {}
    for name, (world, overrides) in LAYOUTS.items():
        # Adam's own epsilon: the point is what a real run's steps do to its weights.
        run_dir = compose_and_prepare(tmp, name, *BF16, *overrides)
        runs[name] = run_dir
        outs[name] = tmp / f"{name}.pt"
        init = str(tmp / f"init_{name}")
        args = (str(outs[name]), STEPS)
        jobs.setdefault(world, []).append((dist_workers.adam_steps, init, str(run_dir), args))
    for world, todo in jobs.items():
        mp.spawn(dist_workers.in_sequence, args=(world, todo), nprocs=world, join=True)
    return {name: {**torch.load(out), "run_dir": runs[name]} for name, out in outs.items()}


def compose_and_prepare(tmp: Path, name: str, *overrides: str) -> Path:
    from tests.support.runs import TOKEN, write_run_dir

    cfg = compose_run("trainer.device=cpu", *overrides)
    return write_run_dir(tmp / name, cfg, TOKEN)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_updates_at_lr_1e6_reach_bf16_weights(trained: dict[str, Any], layout: str) -> None:
    got = trained[layout]
    before = torch.cat([got["before"][n].flatten() for n in got["before"]])
    after = torch.cat([got["after"][n].flatten() for n in got["before"]])
    steps = (after - before).abs() / LR
    # float32's rounding of each step's result: half its spacing at the weight's magnitude
    # (0.06 lr a step for a weight of 1, a norm's).
    rounding = STEPS * torch.finfo(torch.float32).eps / 2 * after.abs() / LR
    about = (steps >= 0.75 * STEPS) & (steps <= 1.05 * STEPS + rounding)
    share = about.float().mean().item()
    assert share > 0.5, f"{share:.1%} of the elements moved by about {STEPS} Adam steps"
    assert steps.median().item() == pytest.approx(STEPS, rel=0.05)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_master_weights_and_moments_are_float32(trained: dict[str, Any], layout: str) -> None:
    """And the version published from them is in the model's dtype (bfloat16)."""
    got = trained[layout]
    assert got["dtypes"] == {
        "parameters": {"torch.float32"},
        "gradients": {"torch.float32"},
        "optimizer": {"torch.float32"},
    }
    version = got["run_dir"] / "weights" / "step_1"
    files = [ADAPTER_WEIGHTS] if is_adapter_dir(version) else safetensors_files(version)
    dtypes = set()
    for file in files:
        with safe_open(version / file, "pt") as f:
            dtypes |= {str(f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118
    assert dtypes == {"BF16"}, dtypes


@pytest.mark.parametrize("layout", ["single", "fsdp2"])
def test_memory_model_counts_what_the_trainer_keeps(trained: dict[str, Any], layout: str) -> None:
    """The planner's trainer terms for parameters, gradients and AdamW's moments are the
    bytes each rank holds (float32 master copies: 4 + 4 + 8 bytes an element), within FSDP's
    padding of uneven shards."""
    world, overrides = LAYOUTS[layout]
    cfg = compose_run("trainer.device=cpu", *BF16, *overrides)
    mesh = trainer_dims(cfg.parallel.trainer, world).as_dict()
    terms = trainer_memory(cfg, mesh).terms
    for held in trained[layout]["held"]:
        for term in ("parameters", "gradients", "optimizer"):
            assert held[term] == pytest.approx(terms[term] * GIB, rel=0.02), (term, held)
