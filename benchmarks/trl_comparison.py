"""Relay against TRL's GRPOTrainer on this machine: same model, task, batch and sample budget.

Both systems train Relay's tiny model on reverse_text for `--steps` optimiser steps of 32
prompts x 8 completions (256 samples), max 12 completion tokens, temperature 1, the model's
learning rate, AdamW betas (0.9, 0.99), gradient clipping at 1.0, no KL term, and both start RL
from the same weights: Relay's supervised warm-up (`warmup.*`, as in rl/trainer.py) is run
once here and saved, then Relay gets `model.path=<those weights> warmup.steps=0` and TRL loads
the same directory.

- Relay runs as the real `rl` command (async_level 1, embedded inference, its default loss).
- TRL runs `GRPOTrainer` in this process on the CPU, generating with transformers. Its loss is
  `dapo` (token-level, normalised by the batch's completion tokens: Relay's `token`
  normalisation) with `scale_rewards="none"` (Relay's `group_mean` advantages); with one
  optimiser step per generation batch, TRL is on-policy and both losses have the gradient of
  -A * log pi.

Prints, for each: seconds of the RL loop per trained sample (Relay: first trainer step to last,
less the eval at version 0 inside it; TRL: `train()`), held-out exact match (greedy, the eval
words of the environment) before and after RL, scored by one function for both, and the
ratios Relay/TRL.

    uv run --group bench python benchmarks/trl_comparison.py [--steps 100] [relay overrides ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from rl.derive import learning_rate
from rl.envs import Environment, Example, make_environment
from rl.generation import generate
from rl.model import ensure_checkpoint, load_model, load_tokenizer
from rl.records import is_eval, is_train
from rl.rundir import RunDir, mark_complete
from rl.testing import ROOT, compose_run
from rl.trainer import sft_batch, token_logprobs

RECENT = 10  # train steps the "last reward" column averages over


def warm_up(cfg: DictConfig, target: Path) -> Path:
    """Relay's supervised warm-up (rl/trainer.py `Trainer.warmup`, one process), saved to target
    in HF layout: the weights both systems start RL from."""
    base = ensure_checkpoint(cfg.model, seed=cfg.seed)
    model, tokenizer = load_model(base, dtype=cfg.model.dtype), load_tokenizer(base)
    examples = make_environment(cfg.environment).train_examples()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.warmup.lr)
    picker = torch.Generator().manual_seed(cfg.seed + 1)
    for _ in range(cfg.warmup.steps):
        picks = torch.randint(len(examples), (cfg.warmup.batch_size,), generator=picker).tolist()
        ids, attention, completion = sft_batch(tokenizer, [examples[i] for i in picks])
        logp, _ = token_logprobs(model, ids, attention)
        loss = -(logp * completion).sum() / completion.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    mark_complete(target)
    return target


def exact_match(model: Any, tokenizer: Any, env: Environment, max_tokens: int) -> float:
    """Greedy held-out exact match, decoded the way Relay's inference server decodes."""
    examples = env.eval_examples()
    prompts = [
        [tokenizer.bos_token_id, *tokenizer.encode(e.prompt, add_special_tokens=False)]
        for e in examples
    ]
    was_training = model.training
    model.eval()
    samples = generate(model, tokenizer, prompts, max_tokens, 0.0)
    model.train(was_training)
    texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
    hits = [env.exact_match(e, t) for e, t in zip(examples, texts, strict=True)]
    return sum(hits) / len(hits)


def run_relay(
    cfg: DictConfig, start: Path, steps: int, run_dir: Path, extra: list[str]
) -> dict[str, Any]:
    """The real `rl` command from the warmed-up weights; its figures from metrics.jsonl."""
    cmd = [
        sys.executable, "-m", "launcher.cli", f"hydra.run.dir={run_dir}",
        f"max_steps={steps}", "warmup.steps=0", f"model.path={start}",
        f"environment.eval_every={steps}", *extra,
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled"}
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"relay run failed:\n{out.stderr[-3000:]}")
    layout = RunDir(run_dir)
    records = layout.read_metrics()
    train = sorted(filter(is_train, records), key=lambda r: r["step"])
    evals = {r["step"]: r for r in filter(is_eval, records)}
    # The eval at version 0 runs while the first trainer step waits for its batch.
    span = train[-1]["timestamp"] - (train[0]["timestamp"] - train[0]["time/step"])
    rl_seconds = span - evals[0]["time/eval"]
    model = load_model(layout.weights_for(steps), dtype=cfg.model.dtype)
    return {
        "rl_seconds": rl_seconds,
        "wall_seconds": wall,
        "samples": sum(r["samples"] for r in train),
        # Groups whose completions all scored alike are dropped and their prompts resampled.
        "generated": sum(r["samples"] for r in train)
        + cfg.environment.group_size * sum(r["filter/zero_advantage_groups"] for r in train),
        "reward_last": statistics.mean(r["reward/mean"] for r in train[-RECENT:]),
        "logged_exact_before": evals[0]["eval/exact_match"],
        "logged_exact_after": evals[steps]["eval/exact_match"],
        "model": model,
    }


def run_trl(cfg: DictConfig, start: Path, steps: int, output_dir: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer, on this CPU, from the warmed-up weights, with Relay's batch."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    started = time.perf_counter()
    env_cfg = cfg.environment
    env = make_environment(env_cfg)
    tokenizer = load_tokenizer(start)
    model = load_model(start, dtype=cfg.model.dtype)
    # The char tokenizer adds no specials by itself; Relay's server prepends BOS to every prompt.
    dataset = Dataset.from_dict(
        {
            "prompt": [tokenizer.bos_token + e.prompt for e in env.train_examples()],
            "answer": [e.answer for e in env.train_examples()],
        }
    )
    batch_rewards: list[float] = []
    scored = [0]

    def lcs_reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        rewards = [env.reward(Example("", a), c) for c, a in zip(completions, answer, strict=True)]
        batch_rewards.append(sum(rewards) / len(rewards))
        scored[0] += len(rewards)
        return rewards

    batch = env_cfg.prompts_per_step * env_cfg.group_size
    args = GRPOConfig(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=batch,  # one optimiser step per generation batch
        gradient_accumulation_steps=1,
        num_generations=env_cfg.group_size,
        max_completion_length=env_cfg.max_tokens,
        temperature=cfg.algorithm.temperature,
        learning_rate=learning_rate(cfg),
        lr_scheduler_type="constant",
        adam_beta1=cfg.algorithm.betas[0],
        adam_beta2=cfg.algorithm.betas[1],
        weight_decay=cfg.algorithm.weight_decay,
        max_grad_norm=cfg.algorithm.max_grad_norm,
        loss_type="dapo",
        scale_rewards="none",
        beta=0.0,
        num_iterations=1,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=cfg.seed,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lcs_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.remove_callback(PrinterCallback)  # one log dict per step otherwise
    t0 = time.perf_counter()
    trainer.train()
    rl_seconds = time.perf_counter() - t0
    return {
        "rl_seconds": rl_seconds,
        "wall_seconds": time.perf_counter() - started,
        "samples": scored[0],
        "generated": scored[0],
        "reward_last": statistics.mean(batch_rewards[-RECENT:]),
        "model": trainer.model,
    }


def load_average() -> str:
    """The 1- and 5-minute load averages: other work on the machine skews both sides' times."""
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min), {os.cpu_count()} CPUs"


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = [cell.rjust(width) for cell, width in zip(row, widths, strict=True)]
        print("  ".join([row[0].ljust(widths[0]), *cells[1:]]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="RL steps for each system")
    parser.add_argument("overrides", nargs="*", help="extra rl overrides (both sides' config)")
    args = parser.parse_args()
    cfg = compose_run(*args.overrides)
    env = make_environment(cfg.environment)
    max_tokens = cfg.environment.max_tokens
    batch = cfg.environment.prompts_per_step * cfg.environment.group_size
    print(
        f"{args.steps} steps x {batch} samples ({cfg.environment.prompts_per_step} prompts x "
        f"{cfg.environment.group_size}), lr {learning_rate(cfg)}, max_tokens {max_tokens}, "
        f"{len(env.eval_examples())} eval words, torch threads {torch.get_num_threads()}; "
        f"{load_average()}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ.setdefault("RELAY_CACHE", str(root / "cache"))
        start = warm_up(cfg, root / "warm")
        tokenizer = load_tokenizer(start)
        before = exact_match(load_model(start, dtype=cfg.model.dtype), tokenizer, env, max_tokens)
        print(f"warm-up: {cfg.warmup.steps} SFT steps, exact match {before:.3f}", flush=True)
        relay = run_relay(cfg, start, args.steps, root / "relay", args.overrides)
        relay["exact"] = exact_match(relay.pop("model"), tokenizer, env, max_tokens)
        print(
            f"relay done: {relay['wall_seconds']:.1f} s for the whole command; its own evals: "
            f"exact match {relay['logged_exact_before']:.3f} -> {relay['logged_exact_after']:.3f}; "
            f"{load_average()}",
            flush=True,
        )
        trl = run_trl(cfg, start, args.steps, root / "trl")
        trl["exact"] = exact_match(trl.pop("model"), tokenizer, env, max_tokens)
        print(
            f"trl done: {trl['wall_seconds']:.1f} s to load, build the trainer and train; "
            f"{load_average()}",
            flush=True,
        )
    print()
    print_table(
        ["system", "trained", "generated", "RL s", "ms/sample", f"reward last {RECENT}",
         "exact before", "exact after"],
        [
            [name, str(r["samples"]), str(r["generated"]), f"{r['rl_seconds']:.1f}",
             f"{1000 * r['rl_seconds'] / r['samples']:.2f}", f"{r['reward_last']:.3f}",
             f"{before:.3f}", f"{r['exact']:.3f}"]
            for name, r in (("relay", relay), ("trl", trl))
        ],
    )  # fmt: skip
    time_ratio = (relay["rl_seconds"] / relay["samples"]) / (trl["rl_seconds"] / trl["samples"])
    exact_ratio = relay["exact"] / trl["exact"] if trl["exact"] else float("inf")
    print(f"ratio relay/trl: time per sample {time_ratio:.2f}, exact match {exact_ratio:.2f}")


if __name__ == "__main__":
    main()
