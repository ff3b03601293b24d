"""Where a Relay run's time goes, from its metrics.jsonl, and what one trainer step and one
batch of generation cost in-process on this CPU.

For each run directory: the RL loop's seconds (first trainer step to last), and per step the
trainer's phases (train = forward, backward and optimiser step; waiting for its batch; publishing
weights) and the inference side's (generating and scoring a batch; loading new weights; idle,
the rest of the loop), plus the samples generated against those trained.

`--micro` adds, in this process with one thread (as a split-placement role has): forward and
backward of one 256-sample reverse-text batch with and without shared prompts
(`trainer.share_prompts`), and one batch of generation with the embedded engine's `generate`,
with the first run's version-0 weights (after its warm-up; else an untrained model).

    uv run python benchmarks/step_profile.py RUN_DIR [RUN_DIR ...] [--micro]
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import OmegaConf

from rl.core.model import encode_prompt, ensure_checkpoint, load_model, load_tokenizer
from rl.envs import make_environment
from rl.inference.generation import generate
from rl.trainer.packing import packed_logprobs
from tests.support.runs import compose_run


def run_profile(run_dir: Path) -> None:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = sorted((r for r in records if r.get("kind") == "train"), key=lambda r: r["step"])
    rollouts = [r for r in records if r.get("kind") == "rollout"]
    evals = [r for r in records if r.get("kind") == "eval"]
    span = train[-1]["timestamp"] - train[0]["timestamp"] + train[0]["time/step"]
    steps = len(train)
    mean = lambda key, rs: statistics.mean(r[key] for r in rs)  # noqa: E731
    generate_s, load_s = mean("time/generate", rollouts), mean("time/weight_load", rollouts)
    trained = sum(r["samples"] for r in train)
    filtered = sum(r["filter/zero_advantage_groups"] for r in train)
    group = OmegaConf.load(run_dir / "config.yaml").environment.group_size
    print(f"{run_dir}: {steps} steps in {span:.1f} s of RL, {1000 * span / steps:.0f} ms a step")
    rows = [
        ("trainer: train (fwd, bwd, optimiser)", mean("time/train", train)),
        ("trainer: wait for its batch", mean("time/wait_batch", train)),
        ("trainer: publish weights", mean("time/weight_sync", train)),
        ("inference: generate and score a batch", generate_s),
        ("inference: load new weights", load_s),
        ("inference: idle or between batches", span / steps - generate_s - load_s),
    ]
    for name, seconds in rows:
        print(f"  {name:40} {1000 * seconds:7.1f} ms  {100 * seconds * steps / span:5.1f}%")
    if all("samples/generated" in r for r in rollouts):  # counted by the orchestrator
        generated = sum(r["samples/generated"] for r in rollouts)
        surplus = group * sum(r["filter/surplus_groups"] for r in rollouts)
        carried = group * sum(r.get("filter/carried_groups", 0) for r in rollouts)
    else:  # older runs: the zero-advantage groups were the only ones not trained on
        generated, surplus, carried = trained + group * filtered, 0, 0
    print(
        f"  samples trained {trained}, generated {generated} ({generated / trained:.3f} per "
        f"trained; {group * filtered} in zero-advantage groups, {surplus} in surplus groups, "
        f"{carried} of them trained by the next batch)"
    )
    if evals:
        last = max(evals, key=lambda r: r["step"])
        print(f"  held-out exact match at version {last['step']}: {last['eval/exact_match']:.3f}")


def micro(weights: Path | None) -> None:
    torch.set_num_threads(1)
    cfg = compose_run()
    path = weights or ensure_checkpoint(cfg.model)
    model, tokenizer = load_model(path, dtype=cfg.model.dtype), load_tokenizer(path)
    env_cfg = cfg.environment
    examples = make_environment(env_cfg).train_examples()[: env_cfg.prompts_per_step]
    prompts = [encode_prompt(tokenizer, e.prompt) for e in examples]
    rng = random.Random(0)
    sequences, prompt_lens = [], []
    for prompt, example in zip(prompts, examples, strict=True):
        for _ in range(env_cfg.group_size):  # completions as long as the answers, plus EOS
            n = len(example.answer) + 1 + rng.randint(-1, 1)
            sequences.append(prompt + [rng.randrange(4, cfg.model.vocab_size) for _ in range(n)])
            prompt_lens.append(len(prompt))

    def fwd_bwd(shared: bool) -> float:
        t0 = time.perf_counter()
        sharing_args = {"prompt_lens": prompt_lens} if shared else {}
        logp, _ = packed_logprobs(model, sequences, **sharing_args)
        logp.sum().backward()
        model.zero_grad()
        return time.perf_counter() - t0

    def best(fn: Callable[[], float], repeat: int = 7) -> float:
        times = [fn() for _ in range(repeat)]
        return statistics.median(times[2:])  # the first two warm up

    print(f"in-process, 1 thread, {len(sequences)} samples ({env_cfg.prompts_per_step} prompts):")
    # An older checkout has no shared prompts: its figure is the unshared one.
    sharing = "prompt_lens" in inspect.signature(packed_logprobs).parameters
    for shared in (False, True) if sharing else (False,):
        ms = 1000 * best(lambda s=shared: fwd_bwd(s))
        print(f"  trainer forward+backward, shared prompts {shared!s:5}    {ms:7.1f} ms")
    model.eval()
    rows = [p for p in prompts for _ in range(env_cfg.group_size)]

    def one_batch() -> float:
        t0 = time.perf_counter()
        generate(model, tokenizer, rows, env_cfg.max_tokens, 1.0)
        return time.perf_counter() - t0

    ms = 1000 * best(one_batch)
    print(f"  generate one batch (embedded engine's generate)   {ms:7.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path, help="run directories")
    parser.add_argument("--micro", action="store_true", help="also time one step in-process")
    args = parser.parse_args()
    for run_dir in args.runs:
        run_profile(run_dir)
    if args.micro:  # the first run's warmed-up weights: completions of trained lengths
        micro(args.runs[0] / "weights" / "step_0" if args.runs else None)


if __name__ == "__main__":
    main()
