"""Trainer benchmark: padding waste with and without sequence packing, and trainer tokens/s for
world size 1 vs 2 (FSDP2 over gloo) on this CPU, as ratios measured in one run.

Samples have the shapes of two environments: reverse-text (short prompts, completions of 1-12
tokens) and a multi-turn tool episode mix (prompts of 100-400 tokens, 20-300 after). Each
configuration runs the real `rl.trainer.loop.Trainer.train_step` on the same batches; the first step
is a warm-up and is not timed. Both world sizes use all the cores: one rank with N threads, or
two ranks with N/2 threads each.

    uv run python benchmarks/trainer_scaling.py [--steps 6] [--samples 64]
        [--shapes reverse_text,tool_episodes]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl.core.binpack import first_fit_decreasing
from tests.support.runs import TOKEN, compose_run, write_run_dir

MODEL = [  # a Qwen3 of 3.2M parameters (12.7 MB): arithmetic, not overhead, dominates
    "model.num_layers=4",
    "model.hidden_size=256",
    "model.intermediate_size=768",
    "model.num_attention_heads=8",
    "model.num_kv_heads=4",
    "model.context_length=1024",
]
SHAPES = {"reverse_text": ((4, 12), (1, 12)), "tool_episodes": ((100, 400), (20, 300))}


def samples(shape: str, count: int, seed: int) -> list[dict[str, Any]]:
    (p_lo, p_hi), (c_lo, c_hi) = SHAPES[shape]
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [1] + [rng.randint(4, 40) for _ in range(rng.randint(p_lo, p_hi))]
        completion = [rng.randint(4, 40) for _ in range(rng.randint(c_lo, c_hi))]
        out.append(
            {
                "prompt_ids": prompt,
                "completion_ids": completion,
                "logprobs": [-1.0] * len(completion),
                "advantage": rng.uniform(-1, 1),
                "reward": 0.0,
                "min_version": 0,
                "max_version": 0,
            }
        )
    return out


def micro_batches(batch: list[dict[str, Any]], budget: int) -> list[list[int]]:
    """Consecutive samples under `budget` padded tokens per micro-batch (as the queue cuts)."""
    parts: list[list[int]] = [[]]
    width = 0
    for i, s in enumerate(batch):
        n = len(s["prompt_ids"]) + len(s["completion_ids"])
        if parts[-1] and max(width, n) * (len(parts[-1]) + 1) > budget:
            parts.append([])
            width = 0
        parts[-1].append(i)
        width = max(width, n)
    return parts


def waste(batch: list[dict[str, Any]], parts: list[list[int]]) -> tuple[float, float]:
    padded = packed = real = 0
    for part in parts:
        lengths = [len(batch[i]["prompt_ids"]) + len(batch[i]["completion_ids"]) for i in part]
        width = max(lengths)
        padded += len(lengths) * width
        packed += len(first_fit_decreasing(lengths, width)) * width
        real += sum(lengths)
    return 1 - real / padded, 1 - real / packed


def rank_main(
    rank: int, world: int, init: str, run_dir: str, shape: str, n: int, steps: int, out: str
) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from rl.core.records import Sample
    from rl.trainer.loop import Trainer

    trainer = Trainer(Path(run_dir))
    budget = trainer.cfg.trainer.micro_batch_tokens
    elapsed, tokens = 0.0, 0
    for step in range(steps + 1):
        batch = samples(shape, n, seed=step)[rank::world]
        parts = micro_batches(batch, budget)
        dist.barrier()
        t0 = time.perf_counter()
        trainer.train_step([Sample.parse(s) for s in batch], parts, step)
        dist.barrier()
        if step:  # step 0 warms up
            elapsed += time.perf_counter() - t0
            tokens += sum(len(s["prompt_ids"]) + len(s["completion_ids"]) for s in batch)
    total = torch.tensor([float(tokens)])
    dist.all_reduce(total)
    if rank == 0:
        Path(out).write_text(f"{total.item() / elapsed}")
    dist.destroy_process_group()


def tokens_per_s(tmp: Path, shape: str, world: int, packing: bool, n: int, steps: int) -> float:
    option = "parallel=single" if world == 1 else "parallel=fsdp"
    overrides = [f"trainer.packing={packing}", "trainer.micro_batch_tokens=4096"]
    cfg = compose_run(*MODEL, option, *overrides)
    run_dir = write_run_dir(tmp / f"{shape}_{world}_{packing}", cfg, TOKEN)
    out = tmp / f"out_{shape}_{world}_{packing}"
    args = (world, str(tmp / f"init_{out.name}"), str(run_dir), shape, n, steps, str(out))
    mp.spawn(rank_main, args=args, nprocs=world, join=True)
    return float(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per configuration")
    parser.add_argument("--samples", type=int, default=64, help="samples per step")
    parser.add_argument(
        "--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}"
    )
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    if unknown := [shape for shape in shapes if shape not in SHAPES]:
        parser.error(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
    print(f"{args.samples} samples/step, {args.steps} timed steps, {os.cpu_count()} CPUs")
    print(f"{'shape':<14} {'waste padded':>12} {'waste packed':>12}")
    for shape in shapes:
        batch = samples(shape, args.samples, seed=1)
        padded, packed = waste(batch, micro_batches(batch, 4096))
        print(f"{shape:<14} {padded:>12.3f} {packed:>12.3f}")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["RELAY_CACHE"] = str(Path(tmp) / "cache")
        head = f"{'world 1 tok/s':>14} {'world 2 tok/s':>14} {'2/1':>6}"
        print(f"\n{'shape':<14} {'packing':>7} {head}")
        rates = {}
        for shape in shapes:
            for packing in (False, True):
                one = tokens_per_s(Path(tmp), shape, 1, packing, args.samples, args.steps)
                two = tokens_per_s(Path(tmp), shape, 2, packing, args.samples, args.steps)
                rates[shape, packing] = one
                print(f"{shape:<14} {packing!s:>7} {one:>14.0f} {two:>14.0f} {two / one:>6.2f}")
        for shape in shapes:
            ratio = rates[shape, True] / rates[shape, False]
            print(f"{shape}: packed/padded tokens/s at world 1: {ratio:.2f}")


if __name__ == "__main__":
    main()
