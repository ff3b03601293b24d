"""Bodies of the spawned trainer ranks in tests/test_parallel.py (gloo on CPU): each builds the
real `rl.trainer.loop.Trainer` from a run directory and drives its steps on fixed samples."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from rl.core.records import Sample
from rl.trainer import parallel
from rl.trainer.checkpoint import full_state_dict, load_model_state
from rl.trainer.loading import local_region
from rl.trainer.loop import Trainer
from rl.trainer.parallel import local_tensor


def synthetic_samples(count: int, seed: int) -> list[Sample]:
    """Scored samples of different lengths over the tiny model's character ids."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        prompt = torch.randint(4, 40, (3 + i % 4,), generator=gen).tolist()
        completion = torch.randint(4, 40, (2 + (3 * i) % 7,), generator=gen).tolist()
        logprobs = (-torch.rand(len(completion), generator=gen) * 3 - 0.5).tolist()
        samples.append(
            Sample.parse(
                {
                    "prompt_ids": [1, *prompt],
                    "completion_ids": completion,
                    "logprobs": logprobs,
                    "advantage": float(torch.randn(1, generator=gen)),
                    "reward": 0.0,
                    "min_version": 0,
                    "max_version": 0,
                }
            )
        )
    return samples


def _trainer(rank: int, world: int, init_file: str, run_dir: str) -> Trainer:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    return Trainer(Path(run_dir))


@contextlib.contextmanager
def counting_reads() -> Iterator[list[str]]:
    """The checkpoints this process reads whole (transformers' `from_pretrained`, which
    `load_model` calls) while the block runs."""
    reads: list[str] = []
    real = AutoModelForCausalLM.from_pretrained

    def counted(path: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append(str(path))
        return real(path, *args, **kwargs)

    AutoModelForCausalLM.from_pretrained = counted
    try:
        yield reads
    finally:
        AutoModelForCausalLM.from_pretrained = real


def _mine(samples: list[dict[str, Any]], trainer: Trainer) -> list[dict[str, Any]]:
    """This rank's share of a batch (the ranks of a CP group get the same share)."""
    return samples[trainer.layout.dp_rank :: trainer.layout.dp_world]


def full_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).cpu()
        for name, p in trainer.model.named_parameters()
        if p.grad is not None
    }


def one_step(rank: int, world: int, init_file: str, run_dir: str, out: str) -> None:
    """One training step on this rank's share of 8 samples; rank 0 saves the whole batch's
    loss, the gradient norm, the full gradients and every rank's parameter bytes."""
    with counting_reads() as reads:
        trainer = _trainer(rank, world, init_file, run_dir)
    mine = _mine(synthetic_samples(8, seed=0), trainer)
    if trainer.cfg.algorithm.kl_coef > 0:
        # The reference, moved off the policy so that the KL term is not zero.
        trainer.reference = trainer.make_reference()
        with torch.no_grad():
            for p in trainer.reference.parameters():
                p.mul_(0.5)
        # Saved for a resume (each rank its shards) and read back into a fresh copy.
        trainer.save_reference()
        again = trainer.make_reference()
        with torch.no_grad():
            for p in again.parameters():
                p.zero_()
        load_model_state(again, trainer.run_dir.reference)
        pairs = zip(again.parameters(), trainer.reference.parameters(), strict=True)
        reloaded = all(torch.equal(local_tensor(a), local_tensor(b)) for a, b in pairs)
    kept = [0]  # elements of the tensors autograd keeps for the backward pass

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        kept[0] += tensor.numel()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        stats = trainer.train_step(mine, [list(range(len(mine)))], 0)
    # The trainer reports the whole batch's loss on every rank (not this rank's part).
    loss = torch.tensor([stats["loss"]])
    grads = full_gradients(trainer)
    sizes = [None] * world
    dist.all_gather_object(sizes, parallel.local_parameter_bytes(trainer.model))
    read_counts = [None] * world
    dist.all_gather_object(read_counts, len(reads))
    references = [None] * world
    held = trainer.reference and parallel.local_parameter_bytes(trainer.reference)
    dist.all_gather_object(references, held)
    if rank == 0:
        saved = {"loss": loss.item(), "grad_norm": stats["grad_norm"], "grads": grads}
        saved["reference_bytes"] = references
        saved["reference_reloaded"] = trainer.reference is not None and reloaded
        saved["device"] = trainer.device.type
        torch.save({**saved, "bytes": sizes, "kept": kept[0], "reads": read_counts}, out)
    dist.destroy_process_group()


def uneven_micro_batches(rank: int, world: int, init_file: str, run_dir: str, out: str) -> None:
    """Rank 0 takes its 4 samples in 4 micro-batches, rank 1 in one: the step completes and
    the gradients are the same as with even ones."""
    trainer = _trainer(rank, world, init_file, run_dir)
    mine = _mine(synthetic_samples(8, seed=0), trainer)
    parts = [[i] for i in range(len(mine))] if rank == 0 else [list(range(len(mine)))]
    trainer.train_step(mine, parts, 0)
    grads = full_gradients(trainer)
    if rank == 0:
        torch.save({"grads": grads}, out)
    dist.destroy_process_group()


def steps(
    rank: int, world: int, init_file: str, run_dir: str, out: str, first: int, last: int
) -> None:
    """Steps first..last (1-based) on fixed batches, resuming from the run's newest checkpoint
    when first > 1 and checkpointing after step 2; rank 0 saves the full weights after each
    step as `<out>_<step>.pt`."""
    trainer = _trainer(rank, world, init_file, run_dir)
    if first > 1:
        assert trainer.resume() == first - 1
    _train(trainer, rank, first, last, lambda step, state: torch.save(state, f"{out}_{step}.pt"))
    dist.destroy_process_group()


def _train(trainer: Trainer, rank: int, first: int, last: int, save: Callable) -> None:
    """Steps first..last on fixed batches, checkpointing and publishing after step 2; rank 0
    hands `save` each step's whole state."""
    for step in range(first, last + 1):
        batch = _mine(synthetic_samples(8, seed=step), trainer)
        trainer.train_step(batch, [list(range(len(batch)))], step - 1)
        if step == 2:
            trainer.checkpoint(step)
            trainer.publish(step)
        state = full_state_dict(trainer.model)
        if rank == 0:
            save(step, state)


def in_sequence(
    rank: int, world: int, jobs: list[tuple[Callable[..., None], str, str, tuple]]
) -> None:
    """Several of the bodies above, one after another in the same ranks: (body, init file, run
    directory, extra arguments) each; every body sets up and tears down its own process
    group. On CPU a spawn costs mostly imports (torch, transformers: seconds per rank), which
    this pays once per world size instead of once per layout."""
    for body, init_file, run_dir, args in jobs:
        body(rank, world, init_file, run_dir, *args)


def lora_steps(
    rank: int, world: int, init_file: str, run_dir: str, out: str, first: int, last: int
) -> None:
    """A LoRA run's steps first..last on fixed batches. From step 1: the warm-up (which trains
    the base) and version 0 published first; later: resumed from the newest checkpoint.
    Checkpoints and publishes after step 2; rank 0 saves, after each step, the whole state
    (base and adapter) and the names of the parameters the optimiser steps as
    `<out>_<step>.pt`."""
    trainer = _trainer(rank, world, init_file, run_dir)
    if first == 1:
        trainer.warmup()
        trainer.publish(0)
    else:
        assert trainer.resume() == first - 1
    stepped = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    names = [name for name, p in trainer.model.named_parameters() if id(p) in stepped]

    def save(step: int, state: dict) -> None:
        torch.save({"state": state, "stepped": names}, f"{out}_{step}.pt")

    _train(trainer, rank, first, last, save)
    dist.destroy_process_group()


def adam_steps(rank: int, world: int, init_file: str, run_dir: str, out: str, steps: int) -> None:
    """`steps` optimiser steps on one fixed batch. Rank 0 saves the trained parameters whole
    before and after, the dtypes the trainer keeps (parameters, gradients, AdamW's moments),
    every rank's bytes of each, and the dtype a published version's tensors have. A LoRA
    adapter's B starts random here (its own start is zero, which leaves A no gradient)."""
    trainer = _trainer(rank, world, init_file, run_dir)
    trained = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for name, param in trained.items():
            if ".lora_B." in name:
                gen = torch.Generator().manual_seed(len(name))
                whole = torch.randn(param.shape, generator=gen) * 0.02
                local_tensor(param).copy_(whole[local_region(param)])
    before = {n: _whole(p) for n, p in trained.items()}
    batch = _mine(synthetic_samples(8, seed=0), trainer)
    for step in range(steps):
        trainer.train_step(batch, [list(range(len(batch)))], step)
    after = {n: _whole(p) for n, p in trained.items()}
    moments = [s for state in trainer.optimizer.state.values() for s in state.values()]
    moments = [local_tensor(m) for m in moments if isinstance(m, torch.Tensor) and m.dim()]
    held = {
        "parameters": sum(_bytes(p) for p in trainer.model.parameters()),
        "gradients": sum(_bytes(p.grad) for p in trained.values()),
        "optimizer": sum(m.numel() * m.element_size() for m in moments),
    }
    every = [None] * world
    dist.all_gather_object(every, held)
    trainer.publish(1)
    if rank == 0:
        dtypes = {
            "parameters": {str(p.dtype) for p in trained.values()},
            "gradients": {str(p.grad.dtype) for p in trained.values()},
            "optimizer": {str(m.dtype) for m in moments},
        }
        torch.save({"before": before, "after": after, "dtypes": dtypes, "held": every}, out)
    dist.destroy_process_group()


def _whole(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().cpu().clone()


def _bytes(tensor: torch.Tensor) -> int:
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def checkpointed_steps(
    rank: int, world: int, init_file: str, run_dir: str, out: str, steps: int
) -> None:
    """Steps 1..`steps` on one fixed batch, a checkpoint after each (the trainer prunes them
    to `trainer.keep_checkpoints`); a LoRA run publishes version 0 first. Rank 0 saves, per
    step, the whole master weights and the model's logits for a fixed input."""
    trainer = _trainer(rank, world, init_file, run_dir)
    if trainer.cfg.model.lora.rank:
        trainer.publish(0)
    batch = _mine(synthetic_samples(8, seed=0), trainer)
    ids = torch.tensor([[1, 10, 11, 12, 13, 14]])
    saved = {}
    for step in range(1, steps + 1):
        trainer.train_step(batch, [list(range(len(batch)))], step - 1)
        trainer.checkpoint(step)
        weights = {n: _whole(p) for n, p in trainer.model.named_parameters()}
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits.float().cpu()
        saved[step] = {"weights": weights, "logits": logits}
    if rank == 0:
        torch.save(saved, out)
    dist.destroy_process_group()
