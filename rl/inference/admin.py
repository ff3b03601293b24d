"""The admin routes of every inference server, declared once: the embedded engine's server,
the vLLM front and the prefill/decode router each mount them over their own `Admin`.

- `GET /health` (no token): the server's state; 200 when it serves, 503 while it starts or
  after it failed.
- `GET /admin/version?model=`: the version served as `model` (a LoRA adapter's name; "": the
  run's policy).
- `POST /admin/load_weights` (`LoadWeightsRequest`): load a version this run published; a
  version or path it did not publish, or weights that do not fit the model, answer 400.
- `POST /admin/sleep`, `POST /admin/wake_up`: give the device's memory back while the trainer
  has it (colocated placement), and take it again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from rl.core.lora import ADAPTER_NAME
from rl.weights.published import loading_from, published_dir


class LoadWeightsRequest(BaseModel):
    """A published version of this run; `path`, if sent, must be its `weights/step_N`."""

    version: int
    path: str | None = None
    adapter: str | None = Field(default=None, pattern=f"^{ADAPTER_NAME.pattern}$")
    """In a LoRA run, the name to serve this version's adapter under (None: the run's own
    policy); requests then ask for it as their `model`."""


class Admin(Protocol):
    """What a server answers its admin routes with. `load_weights` raises ValueError for
    weights it refuses; the rest raise HTTPException where they refuse."""

    async def health(self) -> tuple[int, dict[str, Any]]: ...

    async def served_version(self, model: str) -> dict[str, Any]: ...

    async def load_weights(self, request: LoadWeightsRequest) -> dict[str, Any]: ...

    async def sleep(self) -> dict[str, Any]: ...

    async def wake_up(self) -> dict[str, Any]: ...


def add_admin_routes(app: FastAPI, authorized: Callable[..., Any], admin: Admin) -> None:
    """Mount the admin routes on `app`, every one but /health behind `authorized`."""
    guard = [Depends(authorized)]

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = await admin.health()
        return JSONResponse(body, status_code=status)

    @app.get("/admin/version", dependencies=guard)
    async def version(model: str = "") -> dict[str, Any]:
        """The version served as `model` (a LoRA adapter's name; "": the run's policy)."""
        return await admin.served_version(model)

    @app.post("/admin/load_weights", dependencies=guard)
    async def load_weights(request: LoadWeightsRequest) -> dict[str, Any]:
        try:
            return await admin.load_weights(request)
        except ValueError as exc:  # RefusedWeights, or weights that do not fit the model
            raise HTTPException(400, str(exc)) from exc

    @app.post("/admin/sleep", dependencies=guard)
    async def sleep() -> dict[str, Any]:
        return await admin.sleep()

    @app.post("/admin/wake_up", dependencies=guard)
    async def wake_up() -> dict[str, Any]:
        return await admin.wake_up()


async def requested_weights(
    run_dir: Path | None, shared: bool, request: LoadWeightsRequest
) -> Path:
    """The published directory `request` names (of the run, or of a sweep point's adapter
    under the shared service); RefusedWeights (a ValueError) for anything else."""
    source = loading_from(run_dir, shared, request.adapter)
    return await asyncio.to_thread(published_dir, source, request.version, request.path)
