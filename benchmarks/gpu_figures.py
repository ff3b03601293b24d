"""The GPU figures the planner relies on, measured on the GPU at hand; one JSON report.

For a model of `model=`'s shape (Qwen3-0.6B by default) with random weights:
- **trainer**: a full fine-tuning step (forward, backward, AdamW) of one sample of each length
  in `--tokens` (2k and 8k), as one trainer process keeps it (rl/trainer/parallel.py): float32
  master weights and moments, forward under autocast in the model's dtype, the loss from float32
  log-probabilities; with and without `torch.compile`: tokens/s, and MFU against the GPU's dense
  bf16 peak, counting FLOPs as launcher/plan/costs/step_time.py does (3 x (2 x active parameters +
  attention over half the sample) per token); the peak memory allocated against
  launcher/plan/costs/memory.py's estimate for one process (master weights, gradients, AdamW's
  moments, autocast's copy, activations, attention, logits; the CUDA context is not the
  allocator's);
- **decode**: the embedded engine's `generate` for `--batch` prompts (64) of `--prompt` tokens,
  `--new` tokens each: tokens/s against the HBM bound (every step reads the weights once:
  batch / (weight bytes / bandwidth)); the peak memory against weights plus
  launcher/plan/costs/memory.py's KV cache for the batch's tokens;
- **colocated**: the bytes the embedded engine's sleep gives back, and its wake takes again.

    python benchmarks/gpu_figures.py [--out report.json] [--model qwen3_0_6b]
        [--tokens 2048 8192] [--batch 64] [--no-compile] [overrides ...]

On a CPU (the script's own test) the same code runs with small shapes; the GPU-only figures
(peak memory, MFU, the HBM bound) are then null. `.ci/gpu-check` runs it on the lent device.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from launcher.plan.costs.fit import ONE_PROCESS, decide
from launcher.plan.costs.memory import GIB, kv_bytes_per_token, trainer_memory
from launcher.plan.costs.step_time import active_params, attention_flops_per_token
from launcher.plan.gpus import SPECS, kind_of
from rl.core.derive import ParallelDims, precision
from rl.core.model import ensure_checkpoint, hf_config, load_tokenizer
from rl.inference.engine import Engine, MemoryJob
from rl.inference.generation import generate
from rl.trainer.parallel import compute_context
from tests.support.runs import compose_run

SPECIALS = SimpleNamespace(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def spec(device: torch.device) -> tuple[float, float] | None:
    """The GPU's dense bf16 TFLOP/s and memory GB/s, as the planner knows them."""
    if device.type != "cuda":
        return None
    kind = kind_of(torch.cuda.get_device_name(device))
    return (SPECS[kind].tflops, SPECS[kind].bandwidth_gbs) if kind else None


def random_model(cfg: Any, device: torch.device, dtype: str | None = None) -> Any:
    """The model's shape with random weights, in `dtype` (default: the model's)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(cfg.model, SPECIALS))
    return model.to(getattr(torch, dtype or cfg.model.dtype))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def trainer_figures(
    cfg: Any, device: torch.device, tokens: int, compiled: bool, steps: int
) -> dict[str, Any]:
    dtypes = precision(cfg)
    model = random_model(cfg, device, dtypes.master).train()
    forward = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(3, cfg.model.vocab_size, (1, tokens), device=device)
    one = ParallelDims()

    def step() -> None:
        with compute_context(dtypes, one, device):
            logits = forward(input_ids=ids).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    reset_peak(device)
    t0 = time.perf_counter()
    step()  # the first step allocates the moments (and compiles)
    synchronize(device)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    seconds = (time.perf_counter() - t0) / steps
    m = cfg.model
    flops = 3 * (2 * active_params(m) + attention_flops_per_token(m, tokens / 2)) * tokens
    peak = spec(device)
    decide(cfg.trainer, "micro_batch_tokens", tokens)
    terms = trainer_memory(cfg, ONE_PROCESS, served=tokens).terms
    # One sample alone: no packed rows' mask (its attention is causal); the allocator holds
    # neither the CUDA context nor NCCL's buffers (one process has none).
    unseen = ("context", "NCCL communicators", "attention")
    estimate = sum(v for k, v in terms.items() if k not in unseen)
    measured = peak_gib(device)
    return {
        "tokens": tokens,
        "compiled": compiled,
        "first_step_s": first_s,
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "mfu": flops / seconds / (peak[0] * 1e12) if peak else None,
        "peak_gib": measured,
        "estimate_gib": estimate,
        "estimate_over_peak": estimate / measured if measured else None,
    }


def decode_figures(
    cfg: Any, device: torch.device, tokenizer: Any, batch: int, prompt: int, new: int
) -> dict[str, Any]:
    model = random_model(cfg, device).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.model.vocab_size, (prompt,), generator=gen).tolist()] * batch
    generate(model, tokenizer, prompts[:2], 2, 1.0)  # kernels warmed up
    reset_peak(device)
    synchronize(device)
    t0 = time.perf_counter()
    samples = generate(model, tokenizer, prompts, new, 1.0)
    synchronize(device)
    seconds = time.perf_counter() - t0
    decoded = sum(len(s.token_ids) for s in samples)
    peak = spec(device)
    bound = batch / (weights / (peak[1] * 1e9)) if peak else None
    kv = kv_bytes_per_token(cfg, tp=1) * batch * (prompt + new)
    measured = peak_gib(device)
    del model
    return {
        "batch": batch,
        "prompt_tokens": prompt,
        "new_tokens": new,
        "tokens_per_s": decoded / seconds,
        "hbm_bound_tokens_per_s": bound,
        "of_bound": decoded / seconds / bound if bound else None,
        "peak_gib": measured,
        "estimate_gib": (weights + kv) / GIB,
        "estimate_over_peak": (weights + kv) / GIB / measured if measured else None,
    }


def sleep_wake(cfg: Any, device: torch.device, tokenizer: Any) -> dict[str, Any]:
    """What the embedded engine's sleep gives back and its wake takes again: GPU memory
    allocated (on CPU, the bytes its weights hold: sleep frees them, wake reads them again)."""
    model = random_model(cfg, device).eval()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        engine = Engine(model, tokenizer, cfg, logging.getLogger("gpu-figures"), Path(tmp))
        engine.start()
        try:
            key = "device_bytes" if device.type == "cuda" else "weight_bytes"
            awake = engine.memory()[key]
            asleep = engine.submit(MemoryJob(asleep=True)).result()[key]
            woken = engine.submit(MemoryJob(asleep=False)).result()[key]
        finally:
            engine.stop()
    return {
        "measured": key,
        "awake_gib": awake / GIB,
        "released_gib": (awake - asleep) / GIB,
        "taken_back_gib": (woken - asleep) / GIB,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--model", default="qwen3_0_6b", help="a model option: its shape")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true")
    args, overrides = parser.parse_known_args(argv)
    cfg = compose_run(f"model={args.model}", "model.source=random", *overrides)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(ensure_checkpoint(compose_run().model))  # ids only: any will do
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "spec_tflops_hbm_gbs": spec(device),
        "model": cfg.model.name,
        "overrides": overrides,
        "trainer": [],
    }
    for compiled in (False,) if args.no_compile else (False, True):
        for tokens in args.tokens:
            report["trainer"].append(trainer_figures(cfg, device, tokens, compiled, args.steps))
            print(json.dumps(report["trainer"][-1]), file=sys.stderr, flush=True)
    decode = decode_figures(cfg, device, tokenizer, args.batch, args.prompt, args.new)
    report["decode"] = decode
    report["colocated"] = sleep_wake(cfg, device, tokenizer)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
