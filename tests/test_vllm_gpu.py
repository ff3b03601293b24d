"""The vllm backend on GPUs: weights broadcast over NCCL into vLLM, and FP8 serving.

Marked `gpu` (skipped without CUDA). Needs a GPU build of vLLM: RELAY_VLLM_PYTHON pointing at
its interpreter, or vLLM installed in this environment (`uv sync --extra vllm`). The NCCL test
needs two GPUs (NCCL refuses two ranks on one device): this process sends from GPU 1 to a vLLM
server on GPU 0, as trainer rank 0 would from its own GPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import DictConfig

from rl.core.model import load_model
from rl.inference.engines import engine_of
from rl.weights.broadcast import InferenceBroadcaster
from tests.support.runs import compose_run
from tests.support.vllm import complete, greedy, trained_checkpoint, vllm_server

VLLM_PYTHON = os.environ.get("RELAY_VLLM_PYTHON") or (
    sys.executable if importlib.util.find_spec("vllm") else ""
)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON, reason="needs a GPU build of vLLM (RELAY_VLLM_PYTHON or --extra vllm)"
    ),
]


@contextlib.contextmanager
def gpu_server(tmp_path: Path, *overrides: str) -> Iterator[SimpleNamespace]:
    """The tiny model served by vLLM on GPU 0, with the plan's GPU arguments."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RELAY_CACHE", str(tmp_path / "cache"))
        mp.setenv("CUDA_VISIBLE_DEVICES", "0")  # for the server; this process keeps its view
        cfg = compose_run(
            "inference.backend=vllm",
            f"inference.vllm_python={VLLM_PYTHON}",
            "inference.weight_transport=broadcast",
            "cluster.gpus_per_node=1",
            "model.inference.gpu_memory_utilization=0.3",
            *overrides,
        )
        with vllm_server(cfg, tmp_path / "run") as server:
            server.cfg = cfg
            yield server


def trained(cfg: DictConfig, tmp_path: Path) -> tuple[torch.nn.Module, list[list[int]]]:
    """A checkpoint trained on this task and the embedded engine's greedy ids with it."""
    path = tmp_path / "trained"
    expected = trained_checkpoint(cfg, path, steps=150)
    return load_model(path), expected


def vllm_log(server: SimpleNamespace) -> str:
    return (server.run_dir / "logs" / "inference-0-vllm.log").read_text()


def test_nccl_broadcast_into_vllm_matches_embedded_engine(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs the sender and vLLM on different GPUs: this machine has one")
    with gpu_server(tmp_path, "inference.broadcast_backend=nccl") as server:
        model, expected = trained(server.cfg, tmp_path)
        before = greedy(server)
        torch.cuda.set_device(1)  # the sender's GPU, as a trainer rank's own
        sender = InferenceBroadcaster(
            server.run_dir,
            server.cfg,
            logging.getLogger("test"),
            checkpoint_layout=engine_of(server.cfg).checkpoint_layout,
        )
        sender.publish(1, model.to("cuda:1"))
        assert sender.spec is not None and sender.spec.backend == "nccl"
        after = greedy(server)
        assert after == expected != before
        assert server.client.get("/admin/version").json() == {"policy_version": 1}
        status = server.client.get("/admin/weights/broadcast").json()
        assert status["receivers"] >= 1 and status["error"] is None
        assert "Injected <class 'rl.weights.sync.VllmWorkerExtension'>" in vllm_log(server)


def test_fp8_server_serves_and_takes_broadcast_weights(tmp_path: Path) -> None:
    """`--quantization fp8` (as model=glm5 and minimax_m2 serve): completions with logprobs,
    and broadcast checkpoint-format weights are quantised as they load (gloo from this
    process's CPU tensors, so one GPU suffices)."""
    fp8 = ("model.inference.quantization=fp8", "model.dtype=bfloat16")
    with gpu_server(tmp_path, *fp8, "inference.broadcast_backend=gloo") as server:
        assert "quantization=fp8" in vllm_log(server)
        body = complete(server, prompt=["reverse: hello\n"], n=4, max_tokens=6, logprobs=1)
        for choice in body["choices"]:
            assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) > 0
            assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
        model, expected = trained(server.cfg, tmp_path)
        before = greedy(server)
        InferenceBroadcaster(
            server.run_dir,
            server.cfg,
            logging.getLogger("test"),
            checkpoint_layout=engine_of(server.cfg).checkpoint_layout,
        ).publish(1, model)
        after = greedy(server)
        assert server.client.get("/admin/version").json() == {"policy_version": 1}
        assert after != before
        # FP8 rounds the weights, so only the confident start of each answer must agree with
        # the float32 engine's.
        agree = sum(a[:3] == e[:3] for a, e in zip(after, expected, strict=True))
        assert agree >= len(expected) - 1, (after, expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="prefill and decode need a GPU each")
@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="NIXL needs the nixl package")
def test_a_nixl_prefill_decode_pair_answers_as_one_server(tmp_path: Path) -> None:
    """The GPU default connector: prefill on GPU 0, decode on GPU 1, behind Relay's router."""
    from tests.support.pd import greedy as pd_greedy
    from tests.support.pd import long_prompts, pd_replica, same_choices

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RELAY_CACHE", str(tmp_path / "cache"))
        cfg = compose_run(
            "inference.backend=vllm",
            f"inference.vllm_python={VLLM_PYTHON}",
            "cluster.gpus_per_node=2",
            "model.inference.pd_disaggregation=true",
            "model.inference.gpu_memory_utilization=0.3",
        )
        with pd_replica(cfg, tmp_path / "run", devices=("0", "1")) as replica:
            direct = pd_greedy(replica.prefill, long_prompts())
            same_choices(pd_greedy(replica.router, long_prompts()), direct)
