"""The router in front of a prefill/decode replica: one inference server to its clients.

A replica with `model.inference.pd_disaggregation` is two vLLM-backed Relay servers, a prefill
instance (`inference-<i>-prefill`) and a decode instance (`inference-<i>-decode`), whose vLLMs
hand the KV cache over through a KV connector. This router serves Relay's inference contract as
`inference-<i>`, so the orchestrator and agents see one server:

- each completion is routed twice: to prefill with one token to draw and
  `kv_transfer_params={"do_remote_decode": true}` (vLLM keeps the prompt's KV for transfer and
  answers where to find it), then to decode with the `kv_transfer_params` prefill returned
  (its vLLM loads that KV instead of computing it). The decode answer is the answer: token
  ids, logprobs and policy versions as from one server. A request of several prompts is routed
  prompt by prompt (the hand-over is per request) and the answers merged;
- a streamed request streams decode's answer;
- a weight update reaches both instances before either serves a new request: new requests
  wait while both instances load, and both must report the same version. A version loaded
  from `weights/step_N` waits for the requests in flight to finish first; one broadcast by
  the trainer (the router answers rl/weights/routes.py's routes as one server whose receivers
  are both instances' workers, and passes the update on to both) lets them go on through it,
  as one server does, so that a long generation cannot hold the trainer's weight group past
  its timeout;
- /health answers 200 only while both instances do;
- a request whose client goes away is cancelled here, and so on the instances (which abort it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rl.core.auth import ScopedAuth, as_keys, scoped_guard
from rl.core.derive import FILE_KV_CONNECTOR, kv_connector
from rl.core.rundir import RunDir
from rl.core.runtime import (
    inference_name,
    listen_socket,
    load_run_config,
    read_address,
    role_args,
    run_keys,
    run_role,
    server_host,
    setup_logging,
    start_heartbeat,
    wait_for_address,
    write_address,
)
from rl.inference.admin import LoadWeightsRequest, add_admin_routes
from rl.inference.openai_api import unless_gone
from rl.weights.base import BROADCAST_ROUTE, MAX_STATUS_WAIT_S
from rl.weights.routes import add_routes
from rl.weights.sync import WeightGroupSpec

# What prefill is asked to keep for a decode elsewhere (vLLM's P/D proxy protocol; connectors
# that find the KV by prompt, such as ExampleConnector, answer None and need nothing back).
PREFILL_HANDOVER = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
REQUEST_TIMEOUT_S = 600.0
PARTS = ("prefill", "decode")


class RouteError(Exception):
    """An instance answered an error: passed on to the client with its status."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(status)
        self.status, self.body = status, body


class Gate:
    """Requests pass while open; a weight update closes it, waits for those in flight, and
    opens it again after both instances hold the new version."""

    def __init__(self) -> None:
        self.inflight = 0
        self.updating = False
        self.changed = asyncio.Condition()

    async def enter(self) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: not self.updating)
            self.inflight += 1

    async def leave(self) -> None:
        async with self.changed:
            self.inflight -= 1
            self.changed.notify_all()

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        await self.enter()
        try:
            yield
        finally:
            await self.leave()

    @contextlib.asynccontextmanager
    async def update(self, drain: bool = True) -> AsyncIterator[None]:
        """Closed to new requests while the block runs; with `drain`, once those in flight
        have ended (else they go on through the update, as on one server)."""
        async with self.changed:
            await self.changed.wait_for(lambda: not self.updating)
            self.updating = True
            if drain:
                await self.changed.wait_for(lambda: self.inflight == 0)
        try:
            yield
        finally:
            async with self.changed:
                self.updating = False
                self.changed.notify_all()


class Router:
    """Relay's inference routes over a replica's prefill and decode instances."""

    def __init__(
        self,
        run_dir: Path,
        replica: int,
        keys: Any,
        logger: logging.Logger,
        kv_files: Path | None = None,
    ) -> None:
        self.run_dir, self.logger = run_dir, logger
        # The file connector's KV, found by prompt alone: computed by older weights once a
        # new version loads, so it is dropped with every update.
        self.kv_files = kv_files
        self.names = {part: inference_name(replica, part) for part in PARTS}
        # Each call goes on with the key of its route's scope (rl/core/auth.py).
        self.http = httpx.AsyncClient(
            auth=ScopedAuth(as_keys(keys)), timeout=httpx.Timeout(REQUEST_TIMEOUT_S)
        )
        self.gate = Gate()
        self.urls: dict[str, str] = {}
        # The broadcast status both instances last reported (rl/weights/routes.py reads it).
        self.version = 0
        self.weight_group: str | None = None

    def url(self, part: str) -> str:
        """An instance's address, read from the run directory once and again after it was
        unreachable (a restarted instance writes its new one)."""
        if part not in self.urls:
            url = read_address(self.run_dir, self.names[part])
            if url is None:
                raise RouteError(503, {"error": f"{self.names[part]} has not started"})
            self.urls[part] = url
        return self.urls[part]

    async def send(self, part: str, method: str, route: str, **kwargs: Any) -> httpx.Response:
        try:
            return await self.http.request(method, f"{self.url(part)}{route}", **kwargs)
        except httpx.TransportError as err:
            self.urls.pop(part, None)
            raise RouteError(503, {"error": f"{self.names[part]} unreachable: {err!r}"}) from err

    async def call(self, part: str, method: str, route: str, **kwargs: Any) -> Any:
        response = await self.send(part, method, route, **kwargs)
        if response.status_code != 200:
            try:
                body = response.json()
            except ValueError:
                body = {"error": response.text[:1000]}
            raise RouteError(response.status_code, body)
        return response.json()

    # --- generation ------------------------------------------------------------------------

    async def prefill(self, route: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """Prefill's pass over the prompt: one token drawn, the KV kept for decode; what it
        answers for decode to find that KV."""
        first = {**body, "n": 1, "stream": False, "kv_transfer_params": PREFILL_HANDOVER}
        first.pop("stream_options", None)
        first["max_tokens"] = 1
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        answer = await self.call("prefill", "POST", route, json=first)
        return answer.get("kv_transfer_params")

    async def complete(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        handover = await self.prefill(route, body)
        return await self.call(
            "decode", "POST", route, json={**body, "kv_transfer_params": handover}
        )

    async def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        prompts = body.get("prompt")
        several = isinstance(prompts, list) and prompts and not isinstance(prompts[0], int)
        if not several or len(prompts) == 1:
            return await self.complete("/v1/completions", body)
        answers = await asyncio.gather(
            *(self.complete("/v1/completions", {**body, "prompt": p}) for p in prompts)
        )
        return merge(answers, body.get("n", 1))

    async def stream(self, route: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        handover = await self.prefill(route, body)
        request = self.http.build_request(
            "POST",
            f"{self.url('decode')}{route}",
            json={**body, "kv_transfer_params": handover},
        )
        response = await self.http.send(request, stream=True)
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            await response.aclose()
            raise RouteError(response.status_code, {"error": text[:1000]})
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            await response.aclose()

    # --- weights and health ----------------------------------------------------------------

    async def both(self, method: str, route: str, **kwargs: Any) -> list[Any]:
        return list(
            await asyncio.gather(*(self.call(part, method, route, **kwargs) for part in PARTS))
        )

    async def load_weights(self, request: LoadWeightsRequest) -> dict[str, Any]:
        body = request.model_dump(exclude_none=True)
        async with self.gate.update():
            prefill, decode = await self.both("POST", "/admin/load_weights", json=body)
            if self.kv_files is not None:
                await asyncio.to_thread(shutil.rmtree, self.kv_files, True)
        if prefill["policy_version"] != decode["policy_version"]:
            raise RouteError(
                502,
                {"error": f"prefill holds version {prefill['policy_version']} and decode "
                 f"{decode['policy_version']} after the update"},
            )  # fmt: skip
        load_s = max(prefill.get("load_s", 0.0), decode.get("load_s", 0.0))
        self.logger.info("both instances hold version %d", decode["policy_version"])
        return {"policy_version": decode["policy_version"], "load_s": load_s}

    async def weight_receivers(self) -> int:
        """Both instances' receivers (0 when either has none); records the version and weight
        group they share (none when they differ: a restarted instance needs a fresh group)."""
        answers = await self.both("GET", BROADCAST_ROUTE)
        self.version = min(a["policy_version"] for a in answers)
        groups = {a["group"] for a in answers}
        self.weight_group = groups.pop() if len(groups) == 1 else None
        answered = zip(PARTS, answers, strict=True)
        broken = [f"{self.names[p]}: {a['error']}" for p, a in answered if a["error"]]
        if broken:
            raise RuntimeError("; ".join(broken))
        counts = [int(a["receivers"]) for a in answers]
        return sum(counts) if all(counts) else 0

    async def receive_broadcast(self, spec: WeightGroupSpec, member: str, version: int) -> None:
        """Pass the trainer's update on to both instances at once; new requests wait until
        both serve `version`, while those in flight go on through it, each instance pausing
        them as one server does (a long generation does not hold the trainer's group past its
        timeout). The instances' receivers count in under this router's name, the one server
        the trainer sees."""
        body = {"version": version, "member": member, "group": asdict(spec)}
        async with self.gate.update(drain=False):
            await self.both("POST", BROADCAST_ROUTE, json=body)
            deadline = time.monotonic() + spec.timeout_s
            for part in PARTS:
                while True:
                    wait = max(min(deadline - time.monotonic(), MAX_STATUS_WAIT_S), 0.0)
                    status = await self.call(part, "GET", BROADCAST_ROUTE, params={"wait": wait})
                    if status["error"]:
                        raise RuntimeError(f"{self.names[part]}: {status['error']}")
                    if not status["busy"]:
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"{self.names[part]} did not take version {version} within "
                            f"{spec.timeout_s:g} s"
                        )
            if self.kv_files is not None:
                await asyncio.to_thread(shutil.rmtree, self.kv_files, True)
            versions = [
                (await self.call(part, "GET", BROADCAST_ROUTE))["policy_version"] for part in PARTS
            ]
        if versions != [version, version]:
            raise RuntimeError(
                f"prefill holds version {versions[0]} and decode {versions[1]} after the "
                f"broadcast of version {version}"
            )
        self.version, self.weight_group = version, spec.group
        self.logger.info("both instances hold version %d (broadcast)", version)

    async def sleep(self) -> dict[str, Any]:
        await self.both("POST", "/admin/sleep")
        return {"asleep": True}

    async def wake_up(self) -> dict[str, Any]:
        await self.both("POST", "/admin/wake_up")
        return {"asleep": False}

    async def served_version(self, model: str) -> dict[str, Any]:
        answers = await self.both("GET", "/admin/version", params={"model": model})
        return {"policy_version": min(a["policy_version"] for a in answers)}

    async def health(self) -> tuple[int, dict[str, Any]]:
        states = {}
        for part in ("prefill", "decode"):
            try:
                response = await self.send(part, "GET", "/health", timeout=5.0)
                states[part] = response.status_code
            except RouteError:
                states[part] = 503
        if all(code == 200 for code in states.values()):
            return 200, {"status": "ok", "backend": "vllm", "router": states}
        return 503, {"status": "starting", "detail": f"instances answered {states}"}


def merge(answers: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """One completions answer from one answer per prompt (choice index = prompt x n + k)."""
    merged = dict(answers[0])
    choices = []
    for p, answer in enumerate(answers):
        for choice in answer["choices"]:
            choices.append({**choice, "index": p * n + choice["index"]})
    merged["choices"] = choices
    merged["policy_version"] = min(a["policy_version"] for a in answers)
    merged["policy_version_max"] = max(a["policy_version_max"] for a in answers)
    usage = [a.get("usage") or {} for a in answers]
    merged["usage"] = {k: sum(u.get(k) or 0 for u in usage) for k in usage[0]}
    merged.pop("kv_transfer_params", None)
    return merged


def build_app(router: Router, keys: Any) -> FastAPI:
    authorized = scoped_guard(keys)
    guard = [Depends(authorized)]
    app = FastAPI(title="relay-inference (prefill/decode router)")

    @app.exception_handler(RouteError)
    async def passed_on(_: Request, exc: RouteError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status)

    add_admin_routes(app, authorized, router)
    add_routes(app, authorized, router, router.logger, router.run_dir)

    @app.get("/v1/models", dependencies=guard)
    async def models() -> Any:
        return await router.call("decode", "GET", "/v1/models")

    async def generate(route: str, request: Request) -> Any:
        body = await request.json()
        if not isinstance(body, dict):
            return JSONResponse({"error": "the body must be a JSON object"}, status_code=400)
        if not body.get("stream"):
            async with router.gate.request():  # cancelled (on to the instances) when it goes
                if route == "/v1/completions":
                    return await unless_gone(request, router.completions(body))
                return await unless_gone(request, router.complete(route, body))
        await router.gate.enter()  # left when the stream ends
        try:
            chunks = router.stream(route, body)
            first = await anext(chunks)  # prefill's errors answer before the stream starts
        except BaseException:
            await router.gate.leave()
            raise
        stream = _chain(first, chunks, router.gate)
        return StreamingResponse(stream, media_type="text/event-stream")

    @app.post("/v1/completions", dependencies=guard)
    async def completions(request: Request) -> Any:
        return await generate("/v1/completions", request)

    @app.post("/v1/chat/completions", dependencies=guard)
    async def chat(request: Request) -> Any:
        return await generate("/v1/chat/completions", request)

    return app


async def _chain(first: bytes, rest: AsyncIterator[bytes], gate: Gate) -> AsyncIterator[bytes]:
    try:
        yield first
        async for chunk in rest:
            yield chunk
    finally:
        await gate.leave()


def main() -> None:
    import uvicorn

    args = role_args("inference")
    cfg = load_run_config(args.run_dir)
    name = inference_name(args.replica)
    logger = setup_logging(f"{name}-router")
    start_heartbeat(args.run_dir, cfg.timeouts.hung_s)
    for part in ("prefill", "decode"):  # both instances up before this one is announced
        wait_for_address(args.run_dir, inference_name(args.replica, part), cfg.timeouts.ready_s)
    keys = run_keys(args.run_dir)
    files = RunDir(args.run_dir).kv_files(name) if kv_connector(cfg) == FILE_KV_CONNECTOR else None
    app = build_app(Router(args.run_dir, args.replica, keys, logger, files), keys)
    sock = listen_socket(server_host(), 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        write_address(args.run_dir, name, server_host(), port)
        logger.info("routing %s through prefill then decode on port %d", name, port)
        yield

    app.router.lifespan_context = lifespan
    server.run(sockets=[sock])


if __name__ == "__main__":
    run_role(main)
