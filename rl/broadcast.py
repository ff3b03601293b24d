"""Weight broadcast between the trainer and the inference servers (weight_transport=broadcast).

Trainer rank 0 drives every update (`InferenceBroadcaster.update`):
1. asks each server (found through the run directory) for its receivers (the embedded engine
   has one, a vLLM server one per worker) and the weight group it holds;
2. makes a fresh group for all of them when any holds none or another one (the first update,
   a restarted server);
3. asks each server to receive version N: the server answers at once and, in the background,
   pauses generation, joins the group if needed, takes the weights, resumes;
4. forms the group (a server whose receivers never arrive fails the update by name),
   broadcasts (rl/weight_sync.py), and waits until every server reports version N;
5. records N in `weights/BROADCAST`: the orchestrator generates batch N once the recorded
   version allows it, as it waits for `weights/step_N` with the filesystem transport.
Every wait is bounded by `inference.broadcast_timeout_s`. vLLM is sent the tensors in the
layout `save_pretrained` writes (its loader's input: MoE experts one tensor each), the embedded
engine the module's own. Both inference backends serve the same two routes (`add_routes`) over
their own `ReceivingServer`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch
from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel

from rl.model import inference_state, record_broadcast
from rl.runtime import Peer, auth_headers, inference_names, run_token, server_host
from rl.weight_sync import GroupSpec, WeightSender

ROUTE = "/admin/weights/broadcast"
MAX_WAIT_S = 30.0  # longest a status request is held open


class ReceivingServer(Protocol):
    """An inference server's end of the broadcast."""

    version: int
    weight_group: str | None

    async def weight_receivers(self) -> int:
        """Processes that each take the whole update (they shard it themselves)."""
        ...

    async def receive_broadcast(self, spec: GroupSpec, member: str, version: int) -> None:
        """Join `spec` unless already in it, take one update, serve it as `version`."""
        ...


class BroadcastRequest(BaseModel):
    version: int
    member: str
    group: dict[str, Any]


def add_routes(app: FastAPI, guard: Any, server: ReceivingServer, log: logging.Logger) -> None:
    """GET: the server's broadcast status, after waiting up to `wait` seconds for an update
    being received to end; POST: start receiving an update (answered at once, 409 while one is
    still being received)."""
    receiving: dict[str, Any] = {"task": None, "error": None}

    def busy() -> bool:
        return receiving["task"] is not None and not receiving["task"].done()

    @app.get(ROUTE, dependencies=[Depends(guard)])
    async def status(wait: float = 0.0) -> dict:
        if busy() and wait > 0:
            await asyncio.wait({receiving["task"]}, timeout=min(wait, MAX_WAIT_S))
        try:
            receivers, error = await server.weight_receivers(), receiving["error"]
        except Exception as exc:  # e.g. vLLM started without Relay's worker extension
            receivers, error = 0, f"{type(exc).__name__}: {exc}"
        return {
            "policy_version": server.version,
            "receivers": receivers,
            "group": server.weight_group,
            "busy": busy(),
            "error": error,
        }

    async def receive(spec: GroupSpec, member: str, version: int) -> None:
        try:
            await server.receive_broadcast(spec, member, version)
        except Exception as exc:
            log.exception("broadcast of version %d failed", version)
            receiving["error"] = f"{type(exc).__name__}: {exc}"

    @app.post(ROUTE, dependencies=[Depends(guard)])
    async def start(body: BroadcastRequest) -> dict:
        if busy():
            raise HTTPException(409, "still receiving the previous broadcast")
        try:
            spec = GroupSpec(**body.group)
        except TypeError as exc:
            raise HTTPException(400, f"group: {exc}") from exc
        receiving["error"] = None
        receiving["task"] = asyncio.create_task(receive(spec, body.member, body.version))
        return {"accepted": True}


def default_backend(cfg: Any) -> str:
    """NCCL where the cluster has GPUs and this process sees CUDA, gloo otherwise."""
    gpus = cfg.cluster.gpus_per_node and torch.cuda.is_available()
    return str(cfg.inference.broadcast_backend or ("nccl" if gpus else "gloo"))


class InferenceBroadcaster:
    """Trainer rank 0's side: one weight group with every inference server, each new version
    sent through it (see the module docstring for the order of an update)."""

    def __init__(self, run_dir: Path, cfg: Any, log: logging.Logger) -> None:
        self.run_dir, self.log = run_dir, log
        self.timeout_s = float(cfg.inference.broadcast_timeout_s)
        self.sender = WeightSender(server_host(), default_backend(cfg), self.timeout_s)
        self.servers = [Peer(run_dir, name) for name in inference_names(cfg)]
        self.http = httpx.Client(headers=auth_headers(run_token(run_dir)), timeout=60.0)
        self.spec: GroupSpec | None = None
        # vLLM loads checkpoint-format tensors; the embedded engine holds the module's layout.
        backend = cfg.inference.backend or ("vllm" if cfg.cluster.gpus_per_node else "embedded")
        self.checkpoint_layout = str(backend) == "vllm"

    def publish(self, version: int, model: Any, state: dict[str, Any] | None = None) -> None:
        """Send `model`'s weights (or its gathered `state`) as `version`, in the layout the
        servers load."""
        self.update(version, inference_state(model, state, self.checkpoint_layout))

    def update(self, version: int, tensors: dict[str, Any]) -> None:
        """Send `tensors` as `version` to every server and wait until each serves it."""
        t0 = time.monotonic()
        statuses = self._statuses()
        fresh = self.spec is None or any(s["group"] != self.spec.group for s in statuses.values())
        if fresh:
            counts = {name: int(s["receivers"]) for name, s in statuses.items()}
            broken = [f"{name}: {s['error']}" for name, s in statuses.items() if not counts[name]]
            if broken:
                raise RuntimeError(f"weight broadcast: no receivers on {'; '.join(broken)}")
            self.spec = self.sender.new_group(sum(counts.values()))
        body = {"version": version, "group": asdict(self.spec)}
        for server in self.servers:
            response = self._request(server, "POST", json={**body, "member": server.name})
            if response.status_code != 200:
                raise RuntimeError(
                    f"weight broadcast: {server.name} refused version {version}: "
                    f"{response.status_code} {response.text}"
                )
        try:
            if fresh:
                self.sender.join(self.spec, counts)
            sent = self.sender.send(version, tensors)
        except Exception:
            self.spec = None  # the next update starts over with a fresh group
            raise
        t_sent = time.monotonic()
        self._wait_for(version)
        record_broadcast(self.run_dir / "weights", version)
        self.log.info(
            "broadcast version %d over %s: %.1f MB to %d receivers in %.3f s (+%.3f s until "
            "every server served it)%s",
            version,
            self.spec.backend,
            sent / 1e6,
            self.spec.world_size - 1,
            t_sent - t0,
            time.monotonic() - t_sent,
            " (new group)" if fresh else "",
        )

    def _request(self, server: Peer, method: str, **kwargs: Any) -> httpx.Response:
        return server.request(self.http, method, ROUTE, **kwargs)

    def _statuses(self) -> dict[str, dict[str, Any]]:
        out = {}
        for server in self.servers:
            response = self._request(server, "GET")
            response.raise_for_status()
            out[server.name] = response.json()
        return out

    def _wait_for(self, version: int) -> None:
        """Until every server serves `version`; fails naming a server that reports an error,
        ended on another version (it restarted), or is still busy after the timeout."""
        deadline = time.monotonic() + self.timeout_s
        for server in self.servers:
            while True:
                wait = max(min(deadline - time.monotonic(), MAX_WAIT_S), 0.0)
                response = self._request(server, "GET", params={"wait": wait})
                response.raise_for_status()
                status = response.json()
                if status["error"]:
                    raise RuntimeError(
                        f"{server.name} did not take version {version}: {status['error']}"
                    )
                if not status["busy"]:
                    if status["policy_version"] != version:
                        raise RuntimeError(
                            f"{server.name} serves version {status['policy_version']} after the "
                            f"broadcast of version {version} (did it restart?)"
                        )
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"weight broadcast: {server.name} did not report version {version} "
                        f"within {self.timeout_s:g} s"
                    )
