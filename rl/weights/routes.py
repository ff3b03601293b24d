"""The inference servers' end of weight broadcast: two HTTP routes over a `ReceivingServer`.

Both inference backends (the embedded engine, the vLLM front) add these routes to their app;
the trainer's client is rl/weights/broadcast.py. GET reports the server's broadcast status
(after waiting up to `wait` seconds for an update being received to end); POST starts receiving
an update, answered at once, while the server pauses, joins the weight group if needed, takes
the weights and resumes in the background.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel

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


def add_routes(app: FastAPI, guard: Any, server: ReceivingServer, log: logging.Logger) -> None:
    """GET: the server's broadcast status, after waiting up to `wait` seconds for an update
    being received to end; POST: start receiving an update (answered at once, 409 while one is
    still being received)."""
    receiving: dict[str, Any] = {"task": None, "error": None}

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
        try:
            await server.receive_broadcast(spec, member, version)
        except Exception as exc:
            log.exception("broadcast of version %d failed", version)
            receiving["error"] = f"{type(exc).__name__}: {exc}"

    @app.post(BROADCAST_ROUTE, dependencies=[Depends(guard)])
    async def start(body: BroadcastRequest) -> dict:
        if busy():
            raise HTTPException(409, "still receiving the previous broadcast")
        try:
            spec = WeightGroupSpec(**body.group)
        except TypeError as exc:
            raise HTTPException(400, f"group: {exc}") from exc
        receiving["error"] = None
        receiving["task"] = asyncio.create_task(receive(spec, body.member, body.version))
        return {"accepted": True}
