"""A prefill/decode replica behind Relay's router, started for tests, and what they compare."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from omegaconf import DictConfig

from launcher.clusters.processes import expand
from rl.core.auth import token_auth
from rl.core.runtime import wait_for_address
from rl.inference.vllm.args import PD_INSTANCES, vllm_args
from tests.support.runs import start_role, stop_role, write_run_dir

TOKEN = "pd-test"


def greedy(client: httpx.Client, prompts: list[list[int]]) -> list[dict[str, Any]]:
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 12, "temperature": 0.0,
            "logprobs": 1}  # fmt: skip
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"]


def long_prompts() -> list[list[int]]:
    """Token-id prompts of 40, 70 and 100 tokens: whole 32-token KV blocks to hand over."""
    rng = random.Random(0)
    return [[rng.randrange(3, 60) for _ in range(n)] for n in (40, 70, 100)]


@contextlib.contextmanager
def pd_replica(
    cfg: DictConfig, run_dir: Path, devices: tuple[str, str] | None = None
) -> Iterator[SimpleNamespace]:
    """A prefill and a decode instance (on GPUs `devices`, when given) and the router, as the
    plan starts them, with a client for each; ended by their process groups."""
    write_run_dir(run_dir, cfg, TOKEN)
    values = {"RELAY_RUN_DIR": str(run_dir)}
    procs = []
    try:
        for k, (part, kv_role) in enumerate(PD_INSTANCES.items()):
            args = expand(vllm_args(cfg, 1, kv_role, f"inference-0-{part}"), values)
            role = ("--replica", "0", "--instance", part, "--", *args)
            with pytest.MonkeyPatch.context() as mp:
                if devices:
                    mp.setenv("CUDA_VISIBLE_DEVICES", devices[k])
                procs.append(start_role("inference", run_dir, *role))
        procs.append(start_role("router", run_dir, "--replica", "0"))
        urls = {}
        for name in ("inference-0-prefill", "inference-0-decode", "inference-0"):
            try:
                urls[name] = wait_for_address(run_dir, name, timeout=600)
            except TimeoutError:
                logs = [(run_dir / f"{r}.log").read_text()[-3000:] for r in ("inference", "router")]
                pytest.fail("\n".join(logs))
        clients = {
            name: httpx.Client(base_url=url, auth=token_auth(TOKEN), timeout=300)
            for name, url in urls.items()
        }
        yield SimpleNamespace(
            router=clients["inference-0"],
            prefill=clients["inference-0-prefill"],
            decode=clients["inference-0-decode"],
            run_dir=run_dir,
        )
    finally:
        for proc in procs:
            stop_role(proc)


def same_choices(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert [c["index"] for c in a] == [c["index"] for c in b]
    for x, y in zip(a, b, strict=True):
        assert x["token_ids"] == y["token_ids"]
        got, want = x["logprobs"]["token_logprobs"], y["logprobs"]["token_logprobs"]
        assert got == pytest.approx(want, abs=1e-4)
