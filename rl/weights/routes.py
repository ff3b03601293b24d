"""The inference servers' end of weight broadcast: two HTTP routes over a `ReceivingServer`.

Both inference backends (the embedded engine, the vLLM front) add these routes to their app;
the trainer's client is rl/weights/broadcast.py. GET reports the server's broadcast status
(after waiting up to `wait` seconds for an update being received to end); POST starts receiving
an update, answered at once, while the server pauses, joins the weight group if needed, takes
the weights and resumes in the background.

Both routes need the trainer's publish key (rl/core/auth.py). A POST must also name the update
the trainer announced in the run directory (`weights/BROADCAST_NEXT`: its version, and the
weight group it hosts): no one else's group is joined, and no version but the one the trainer
sends next is taken. The update's bytes are checked against the
trainer's digest, and each tensor for NaN and Inf, before it is served (rl/weights/sync.py).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Protocol

from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel

from rl.core.rundir import RunDir
from rl.weights.base import BROADCAST_ROUTE, MAX_STATUS_WAIT_S
from rl.weights.sync import WeightGroupSpec


class ReceivingServer(Protocol):
    """An inference server's end of the broadcast."""

    version: int
    weight_group: str | None

    async def weight_receivers(self) -> int:
        """Processes that each take the whole update (they shard it themselves)."""
        ...

    async def receive_broadcast(self, spec: WeightGroupSpec, member: str, version: int) -> None:
        """Join `spec` unless already in it, take one update, serve it as `version`."""
        ...


class BroadcastRequest(BaseModel):
    version: int
    member: str
    group: dict[str, Any]


def announced(run_dir: Path | None, body: BroadcastRequest, spec: WeightGroupSpec) -> str | None:
    """Why the update `body` asks for is not the one the trainer announced (None: it is)."""
    if run_dir is None:
        return "this server has no run directory: it takes no broadcast"
    update = RunDir(run_dir).announced_broadcast()
    if update is None:
        return "the trainer announced no update"
    asked = {"version": body.version, "group": spec.group, "host": spec.host, "port": spec.port}
    if asked != update:
        return f"not the update the trainer announced (version {update['version']})"
    return None


def add_routes(
    app: FastAPI, guard: Any, server: ReceivingServer, log: logging.Logger, run_dir: Path | None
) -> dict[str, Any]:
    """GET: the server's broadcast status, after waiting up to `wait` seconds for an update
    being received to end; POST: start receiving the update the trainer announced in `run_dir`
    (answered at once; 409 while one is still being received, 403 for any other). Returns the
    state of the update being received (`receiving`: its version, or None), which /health
    reports."""
    receiving: dict[str, Any] = {"task": None, "error": None, "version": None}

    def busy() -> bool:
        return receiving["task"] is not None and not receiving["task"].done()

    @app.get(BROADCAST_ROUTE, dependencies=[Depends(guard)])
    async def status(wait: float = 0.0) -> dict:
        if busy() and wait > 0:
            await asyncio.wait({receiving["task"]}, timeout=min(wait, MAX_STATUS_WAIT_S))
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

    async def receive(spec: WeightGroupSpec, member: str, version: int) -> None:
        receiving["version"] = version
        try:
            await server.receive_broadcast(spec, member, version)
        except Exception as exc:
            log.exception("broadcast of version %d failed", version)
            receiving["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            receiving["version"] = None

    @app.post(BROADCAST_ROUTE, dependencies=[Depends(guard)])
    async def start(body: BroadcastRequest) -> dict:
        if busy():
            raise HTTPException(409, "still receiving the previous broadcast")
        try:
            spec = WeightGroupSpec(**body.group)
        except TypeError as exc:
            raise HTTPException(400, f"group: {exc}") from exc
        if refusal := announced(run_dir, body, spec):
            log.warning("refused a broadcast of version %d: %s", body.version, refusal)
            raise HTTPException(403, f"broadcast refused: {refusal}")
        receiving["error"] = None
        receiving["task"] = asyncio.create_task(receive(spec, body.member, body.version))
        return {"accepted": True}

    return receiving
