"""The embedded inference server: OpenAI's completions and chat API (rl/inference/openai_api.py)
over the embedded engine (rl/inference/engine.py), with Relay's admin routes to load, receive
and report weights and to sleep and wake.

Every handler awaits the engine thread's future, never the model, so /health answers while a
batch decodes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from rl.core.auth import scoped_guard
from rl.core.config import RunConfig
from rl.core.derive import max_model_len
from rl.core.lora import is_adapter_dir
from rl.core.model import ensure_checkpoint, load_model, load_tokenizer
from rl.core.rundir import RunDir, point_dirs, point_name
from rl.core.runtime import (
    deterministic_cuda,
    listen_socket,
    run_keys,
    server_host,
    write_address,
)
from rl.inference.admin import LoadWeightsRequest, add_admin_routes, requested_weights
from rl.inference.engine import (
    CompletionJob,
    Engine,
    EngineAsleep,
    EngineStopped,
    LoadJob,
    MemoryJob,
    SleepRefused,
)
from rl.inference.openai_api import APIError, Deltas, Params, Result, add_openai_routes
from rl.weights.routes import add_routes
from rl.weights.sync import WeightGroupSpec, WeightReceiver


class EngineBackend:
    """The engine as the OpenAI routes' backend (rl/inference/openai_api.py): requests become
    jobs, and a streamed one gets its tokens from the engine thread step by step."""

    def __init__(self, engine: Engine, max_len: int) -> None:
        self.engine, self.max_len = engine, max_len
        self.model_name, self.tokenizer = engine.model_name, engine.tokenizer
        self.max_rows, self.vocab_size = engine.max_batch_size, engine.vocab_size
        self.rows_per_key = engine.api_rows_per_key

    @property
    def asleep(self) -> bool:
        return self.engine.asleep

    def served(self) -> list[str]:
        adapters = self.engine.adapters.loaded if self.engine.adapters else {}
        return [self.model_name, *sorted(n for n in adapters if n != self.model_name)]

    def _job(self, prompts: list[list[int]], params: Params, sink: Any = None) -> CompletionJob:
        return CompletionJob(
            prompts, params.n, params.max_tokens, params.temperature, params.seed,
            params.limits, sink, params.model, params.seeds, rollout=params.rollout,
        )  # fmt: skip

    async def generate(self, prompts: list[list[int]], params: Params) -> Result:
        job = self._job(prompts, params)
        try:
            version, samples = await asyncio.wrap_future(self.engine.submit(job))
        except asyncio.CancelledError:  # the client went away (openai_api.unless_gone)
            self.engine.cancel(job)
            raise
        except (EngineStopped, EngineAsleep) as exc:
            raise APIError(503, str(exc)) from exc
        return Result(version, version, samples)

    async def stream(
        self, prompts: list[list[int]], params: Params
    ) -> AsyncIterator[Deltas | Result]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Deltas | None] = asyncio.Queue()

        def sink(deltas: Deltas) -> None:  # on the engine thread
            loop.call_soon_threadsafe(queue.put_nowait, deltas)

        job = self._job(prompts, params, sink)
        future = self.engine.submit(job)
        # Queued after every step's tokens, from the same thread: it arrives last.
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
        try:
            while (deltas := await queue.get()) is not None:
                yield deltas
        finally:  # left early: the client went away (the response stops iterating)
            if not future.done():
                self.engine.cancel(job)
        try:
            version, samples = future.result()
        except (EngineStopped, EngineAsleep) as exc:
            raise APIError(503, str(exc)) from exc
        yield Result(version, version, samples)


class EmbeddedReceiver:
    """The engine's end of weight broadcast: joins a group on a worker thread, receives on the
    engine thread between batches, as a load from disk does."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.receiver: WeightReceiver | None = None
        self.weight_group: str | None = None

    @property
    def version(self) -> int:
        return self.engine.version

    async def weight_receivers(self) -> int:
        return 1

    async def receive_broadcast(self, spec: WeightGroupSpec, member: str, version: int) -> None:
        if self.weight_group != spec.group:
            self.receiver = self.weight_group = None
            self.receiver = await asyncio.to_thread(WeightReceiver, spec, member)
            self.weight_group = spec.group
        await asyncio.wrap_future(self.engine.submit(LoadJob(None, version, self.receiver)))


# Generous for any servable request: a token costs at most a few bytes as a JSON id, and text
# averages a few characters a token (more when JSON-escaped).
BYTES_PER_TOKEN = 16
BODY_SLACK = 64 * 1024  # the request's other fields


def body_limit(max_len: int, max_rows: int) -> int:
    """The largest request body accepted: max_rows prompts of max_len tokens each, and slack."""
    return max_rows * max_len * BYTES_PER_TOKEN + BODY_SLACK


class BodyLimit:
    """ASGI middleware refusing (413) a body over `limit` bytes before it is read whole: by its
    Content-Length at once, or as its streamed size passes the limit."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    def _too_large(self) -> str:
        return f"request body over {self.limit} bytes (inference.max_batch_size x context length)"

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        from fastapi import HTTPException
        from fastapi.responses import JSONResponse

        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.limit:
            return await JSONResponse({"detail": self._too_large()}, 413)(scope, receive, send)
        received = 0

        async def counted() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:  # raised inside the route: answered as a 413
                raise HTTPException(413, self._too_large())
            return message

        await self.app(scope, counted, send)


class EmbeddedAdmin:
    """The admin routes' answers (rl/inference/admin.py) for the embedded engine: each job
    runs on the engine's thread, between its batches."""

    def __init__(self, engine: Engine, run_dir: Path | None, receiving: dict[str, Any]) -> None:
        self.engine, self.run_dir, self.receiving = engine, run_dir, receiving

    async def health(self) -> tuple[int, dict[str, Any]]:
        engine = self.engine
        if reason := engine.failure():
            return 503, {"status": "failed", "detail": reason}
        return 200, {
            "status": "ok",
            "policy_version": engine.version,
            "asleep": engine.asleep,  # up, but serving no completions until woken
            # the version a broadcast is bringing in (generation pauses to copy it), or None
            "receiving": self.receiving["version"],
            "tokens_decoded": engine.tokens_decoded,
            "requests_dropped": engine.requests_dropped,  # their clients went away
        }

    async def served_version(self, model: str) -> dict[str, Any]:
        return {"policy_version": self.engine.held(model)}

    async def load_weights(self, request: LoadWeightsRequest) -> dict[str, Any]:
        path = await requested_weights(self.run_dir, self.engine.shared, request)
        job = LoadJob(path, request.version, adapter=request.adapter or "")
        return await asyncio.wrap_future(self.engine.submit(job))

    async def sleep(self) -> dict[str, Any]:
        from fastapi import HTTPException

        try:
            return await asyncio.wrap_future(self.engine.submit(MemoryJob(asleep=True)))
        except SleepRefused as exc:
            raise HTTPException(409, str(exc)) from exc

    async def wake_up(self) -> dict[str, Any]:
        from fastapi import HTTPException

        try:
            return await asyncio.wrap_future(self.engine.submit(MemoryJob(asleep=False)))
        except (OSError, ValueError) as exc:  # the weights could not be read again
            raise HTTPException(500, f"still asleep: {exc}") from exc


def build_app(engine: Engine, keys: Any, max_len: int, run_dir: Path | None = None) -> Any:
    """The HTTP routes; every handler awaits the engine thread's future, never the model.
    Each route needs its scope's key of `keys` (a mapping, or the run's token: rl/core/auth.py).
    Weights load from `run_dir`'s published versions only (none without one)."""
    from fastapi import Depends, FastAPI

    authorized = scoped_guard(keys)

    # The OpenAPI description is served behind the token like every route but /health.
    app = FastAPI(title="relay-inference", openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=body_limit(max_len, engine.max_batch_size))
    add_openai_routes(app, EngineBackend(engine, max_len), authorized)
    receiving = add_routes(app, authorized, EmbeddedReceiver(engine), engine.logger, run_dir)

    @app.get("/openapi.json", dependencies=[Depends(authorized)], include_in_schema=False)
    async def openapi() -> dict:
        return app.openapi()

    add_admin_routes(app, authorized, EmbeddedAdmin(engine, run_dir, receiving))
    return app


def restored(run_dir: Path, shared: bool) -> list[tuple[str, Path, int]]:
    """What a restarted server loads before it answers, as (adapter name, directory, version):
    the newest published version (a LoRA run's adapter after its base, version 0), or for a
    sweep's shared inference each point's newest under the point's name ("": the policy)."""
    if shared:
        return [
            (point_name(point), RunDir(point).weights_for(newest), newest)
            for point in point_dirs(Path(run_dir).parent)
            if (newest := RunDir(point).newest_version()) >= 0
        ]
    run = RunDir(run_dir)
    newest = run.newest_version()
    if newest < 0:
        return []
    loads = [("", run.weights_for(newest), newest)]
    if is_adapter_dir(run.weights_for(newest)):
        loads.insert(0, ("", run.weights_for(0), 0))
    return loads


def _announce(server: Any, run_dir: Path, name: str, port: int, logger: logging.Logger) -> None:
    """Publish the address only once uvicorn accepts connections, so clients never race it."""
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    write_address(run_dir, name, server_host(), port)
    logger.info("listening on http://%s:%d", server_host(), port)


def serve(cfg: RunConfig, run_dir: Path, name: str, logger: logging.Logger) -> None:
    """Load the model, start the engine and serve until SIGTERM."""
    import torch
    import uvicorn
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keeps the role's log one line per event
    path = ensure_checkpoint(cfg.model)
    device = "cuda" if (cfg.cluster.gpus_per_node or 0) > 0 and torch.cuda.is_available() else "cpu"
    if device == "cuda":
        deterministic_cuda()
    model = load_model(path, dtype=cfg.model.dtype, device=device).eval()
    engine = Engine(model, load_tokenizer(path), cfg, logger, weights_from=path)
    # A restarted server: back on the newest policy (or each sweep point's) before it answers.
    for adapter, weights, version in restored(run_dir, cfg.inference.shared):
        engine.submit(LoadJob(weights, version, adapter=adapter))
    app = build_app(engine, run_keys(run_dir), max_model_len(cfg), run_dir)
    sock = listen_socket(server_host(), cfg.inference.port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_config=None, log_level="warning", access_log=False)
    )
    engine.start()
    announce = (server, run_dir, name, port, logger)
    threading.Thread(target=_announce, args=announce, daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
