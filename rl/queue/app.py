"""The rollout queue's HTTP routes: an HTTP service between the orchestrator and every trainer
rank, over the store (rl/queue/store.py).

The orchestrator pushes scored groups (`/push`, JSON or the binary wire format, checked against
rl/core/records.py and stored before they are acknowledged; a full queue answers 429); each
trainer rank long-polls `/batch` for its token-balanced shard of step N, packed into
micro-batches (rl/queue/shards.py); `/stats` reports depth and counts. Every route but /health
needs its key (rl/core/auth.py): the orchestrator's push key, the trainer's pull key. A pushed
sample must fit the run (`RunLimits`: token ids in the vocabulary, no longer than the served
length, a reward in the environment's range and an advantage within its estimator's bound),
come from a policy version the trainer has published, and a push may number its batch at most
`queue.batches_ahead` past the next: anything else is refused whole (422, naming the bound),
so that nothing the schedule did not ask for is stored, nor turns the real batch into a
duplicate.

Handlers are async; anything that touches SQLite or walks a batch (sharding, packing, encoding)
runs in a worker thread, so one large request never stalls the others.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

import numpy as np
from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response

from rl.core import wire
from rl.core.auth import scoped_guard
from rl.core.config import DEFAULT_MICRO_BATCH_TOKENS
from rl.core.records import INT64_MAX, Group, RecordError, RunLimits, ScoreBounds
from rl.core.rundir import RunDir
from rl.queue.shards import micro_batches
from rl.queue.store import Refused, Store

MAX_WORLD = 65536
"""Most trainer ranks a batch is sharded across; more is refused (400), not attempted."""
MAX_WAIT_S = 60.0
"""Longest a /batch request long-polls (`wait`); longer, negative, NaN or inf is refused (422)."""
RECENT_STEPS = 20
"""Steps whose assembly timings /stats reports."""
JSON = "application/json"
BINARY_BODY = {"content": {wire.CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}}}
GROUPS_JSON = {
    "type": "object",
    "required": ["groups"],
    "properties": {
        "groups": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["samples", "min_version", "max_version"],
                "properties": {
                    "min_version": {"type": "integer"},
                    "max_version": {"type": "integer"},
                    "samples": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["prompt_ids", "completion_ids", "logprobs", "advantage"],
                            "properties": {
                                "prompt_ids": {"type": "array", "items": {"type": "integer"}},
                                "completion_ids": {"type": "array", "items": {"type": "integer"}},
                                "logprobs": {"type": "array", "items": {"type": "number"}},
                                "advantage": {"type": "number"},
                                "reward": {"type": "number"},
                            },
                        },
                    },
                },
            },
        }
    },
}
PUSH_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": GROUPS_JSON},
            **BINARY_BODY["content"],
        },
    }
}


@dataclass
class Queue:
    """What the routes share: the store, the run's limits, the counters /stats reports, and
    the event that wakes long-polling ranks when groups arrive."""

    store: Store
    groups_per_step: int
    max_off_policy: int
    capacity: int
    max_request_bytes: int
    limits: RunLimits | None = None
    run: RunDir | None = None
    """The run whose published versions and declared score bounds a push must fit (None:
    only `limits`)."""
    newest: int = -1
    """The newest policy version the trainer published, as last read from `run`."""
    batches_ahead: int = 1
    """How far past the next batch a push may number its own."""
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("accepted", "served", "rejected_full", "rejected_bad"), 0
        )
    )
    step_timings: dict[int, dict[str, float]] = field(default_factory=dict)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


def create_app(store: Store, keys: Any, groups_per_step: int, max_off_policy: int,
               capacity: int, max_request_bytes: int,
               limits: RunLimits | None = None, run: RunDir | None = None,
               batches_ahead: int = 1) -> FastAPI:  # fmt: skip
    """The queue's HTTP routes over `store`; every route but /health needs its scope's key of
    `keys` (a mapping, or the run's token); pushed samples must fit `limits`, and with `run`,
    its published versions and the score bounds its orchestrator declared."""
    # The OpenAPI description is served behind a key like every route but /health.
    app = FastAPI(
        title="Relay rollout queue", version="1", openapi_url=None, docs_url=None, redoc_url=None
    )
    queue = Queue(store, groups_per_step, max_off_policy, capacity, max_request_bytes, limits,
                  run, batches_ahead=batches_ahead)  # fmt: skip
    guard = [Depends(scoped_guard(keys))]
    add_health(app)
    add_push(app, queue, guard)
    add_batch(app, queue, guard)
    add_stats(app, queue, guard)
    return app


def add_health(app: FastAPI) -> None:
    @app.get("/health", summary="Liveness; needs no token")
    def health() -> dict[str, str]:
        return {"status": "ok"}


def add_push(app: FastAPI, queue: Queue, guard: list[Any]) -> None:
    @app.post(
        "/push",
        dependencies=guard,
        summary="Store scored groups (JSON or relay-groups binary); 429 when full",
        openapi_extra=PUSH_BODY,
        responses={413: {}, 415: {}, 422: {}, 429: {}},
    )
    async def push(
        request: Request, batch: Annotated[int | None, Query(ge=0, le=INT64_MAX)] = None
    ) -> Response:
        body = await _read_limited(request, queue.max_request_bytes)
        content_type = request.headers.get("content-type", "")
        try:
            limits = _run_limits(queue)
            groups, stored = await asyncio.to_thread(_parse_groups, body, content_type, limits)
            _check_versions(queue, groups)
        except HTTPException:
            queue.counts["rejected_bad"] += 1
            raise
        ids = await asyncio.to_thread(
            queue.store.push, groups, batch, queue.capacity, stored, queue.batches_ahead
        )
        if ids is Refused.full:
            queue.counts["rejected_full"] += 1
            return Response(status_code=429, headers={"Retry-After": str(wire.RETRY_AFTER_S)})
        if ids is Refused.ahead:
            queue.counts["rejected_bad"] += 1
            allowed = queue.store.next_batch() + queue.batches_ahead
            raise HTTPException(
                422,
                f"batch {batch} is ahead of the schedule: a push numbers at most batch {allowed} "
                f"(queue.batches_ahead={queue.batches_ahead} past the next)",
            )
        if ids is Refused.duplicate:
            return Response(json.dumps({"ids": [], "duplicate": True}), media_type=JSON)
        queue.counts["accepted"] += len(groups)
        queue.arrived.set()
        return Response(json.dumps({"ids": ids}), media_type=JSON)


def _run_limits(queue: Queue) -> RunLimits | None:
    """The limits a push must fit: with a run, its score bounds too, once the orchestrator has
    declared them (before that nothing is taken: 503, to be tried again)."""
    if queue.run is None or queue.limits is None:
        return queue.limits
    if queue.limits.scores is None:
        raw = queue.run.read_scores()
        if raw is None:
            raise HTTPException(
                503,
                "the orchestrator has not declared the run's score bounds yet",
                headers={"Retry-After": str(wire.RETRY_AFTER_S)},
            )
        try:
            queue.limits = replace(queue.limits, scores=ScoreBounds.parse(raw))
        except RecordError as err:
            raise HTTPException(503, f"{queue.run.scores}: {err}") from None
    return queue.limits


def _check_versions(queue: Queue, groups: list[Group]) -> None:
    """422 for a group generated by a version newer than the newest the trainer published
    (re-read only when a group claims one newer than last seen)."""
    if queue.run is None:
        return
    claimed = max(g.max_version for g in groups)
    if claimed > queue.newest:
        queue.newest = queue.run.newest_policy()
    if claimed > queue.newest:
        raise HTTPException(
            422,
            f"a group claims policy version {claimed}, newer than the newest the trainer "
            f"published ({queue.newest})",
        )


def add_batch(app: FastAPI, queue: Queue, guard: list[Any]) -> None:
    @app.get(
        "/batch",
        dependencies=guard,
        summary="This rank's shard of step N's batch, packed into micro-batches; 204 if not ready",
        responses={200: BINARY_BODY, 204: {}, 409: {}},
    )
    async def batch(
        request: Request,
        step: int,
        rank: int = 0,
        world: int = 1,
        wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, allow_inf_nan=False)] = wire.LONG_POLL_S,
        micro_tokens: int = DEFAULT_MICRO_BATCH_TOKENS,
    ) -> Response:
        if not 0 <= rank < world or step < 0 or micro_tokens < 1:
            raise HTTPException(400, "need step >= 0, 0 <= rank < world, micro_tokens >= 1")
        if world > MAX_WORLD:
            raise HTTPException(400, f"world must be at most {MAX_WORLD}, got {world}")
        if not await _assembled(queue, step, wait):
            return Response(status_code=204)
        binary = wire.CONTENT_TYPE in request.headers.get("accept", "")
        reply = await asyncio.to_thread(
            _shard_reply, queue.store, step, rank, world, micro_tokens, binary
        )
        queue.counts["served"] += 1
        return reply


async def _assembled(queue: Queue, step: int, wait: float) -> bool:
    """Whether step `step` is assembled: at once, or as groups arrive within `wait` seconds
    (a 409 for a step asked before the one before it)."""
    t0 = time.monotonic()
    deadline = t0 + wait
    while True:
        last = queue.store.last_step()
        if step > last + 1:
            raise HTTPException(409, f"step {step} asked before step {last + 1} was assembled")
        if step <= last:
            return True
        queue.arrived.clear()
        assemble = queue.store.assemble
        done, _ = await asyncio.to_thread(
            assemble, step, queue.groups_per_step, queue.max_off_policy
        )
        if done:
            waited = time.monotonic() - t0
            queue.step_timings[step] = {"waited_s": waited, "assembled_at": time.time()}
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            await asyncio.wait_for(queue.arrived.wait(), timeout=remaining)
        except TimeoutError:
            return False


def add_stats(app: FastAPI, queue: Queue, guard: list[Any]) -> None:
    @app.get("/openapi.json", dependencies=guard, include_in_schema=False)
    def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.get("/stats", dependencies=guard, summary="Depth, counts, step timings")
    def get_stats() -> dict[str, Any]:
        store = queue.store
        recent = sorted(queue.step_timings)[-RECENT_STEPS:]
        return {
            "depth": store.count("ready"),
            "assigned": store.count("assigned"),
            "dropped": store.count("dropped"),
            "last_step": store.last_step(),
            "next_batch": store.next_batch(),
            "capacity": queue.capacity,
            "steps": {str(k): queue.step_timings[k] for k in recent},
            **queue.counts,
        }


def _shard_reply(
    store: Store, step: int, rank: int, world: int, micro_tokens: int, binary: bool
) -> Response:
    """Rank's shard of assembled step `step`, packed and encoded (blocking: run in a thread)."""
    groups = store.batch(step)
    everything = [s for g in groups for s in g.samples]
    samples = [everything[i] for i in store.partition(step, world)[rank]]
    meta = {
        "step": step,
        "groups": len(groups),
        "dropped": store.dropped(step),
        "depth": store.count("ready"),
        "micro_batches": micro_batches([s.tokens for s in samples], micro_tokens),
    }
    raw = [s.to_dict() for s in samples]
    if binary:
        return Response(wire.encode([{"samples": raw}], meta), media_type=wire.CONTENT_TYPE)
    return Response(json.dumps({**meta, "samples": wire.to_lists(raw)}), media_type=JSON)


async def _read_limited(request: Request, limit: int) -> bytes:
    """The body, refusing (413) anything over `limit` bytes before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise HTTPException(413, f"body over {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_groups(
    body: bytes, content_type: str, limits: RunLimits | None = None
) -> tuple[list[Group], bytes]:
    """Validate pushed groups (rl/core/records.py) and that they fit the run (`limits`), and
    encode them as they are stored (only the checked fields; a binary body keeps its arrays as
    sent). Any problem is a 4xx that names it, and nothing is stored."""
    binary = content_type.startswith(wire.CONTENT_TYPE)
    if binary:
        try:
            groups, _, ids, logprobs = wire.unpack(body)
        except wire.WireError as err:
            raise HTTPException(422, str(err)) from err
        data: Any = {"groups": groups}
        check_arrays = not _arrays_pass(groups, ids, logprobs)
    elif content_type.startswith("application/json"):
        check_arrays = True
        try:
            data = json.loads(body)
        except ValueError as err:
            raise HTTPException(422, f"body is not JSON: {err}") from err
        except RecursionError:  # arrays or objects nested thousands deep
            raise HTTPException(422, "body is nested too deeply to be groups") from None
    else:
        raise HTTPException(415, f"content type must be application/json or {wire.CONTENT_TYPE}")
    if not isinstance(data, dict) or not isinstance(data.get("groups"), list) or not data["groups"]:
        raise HTTPException(422, "body must be an object with a non-empty 'groups' list")
    try:
        groups = [
            Group.parse(group, f"groups[{i}]", check_arrays)
            for i, group in enumerate(data["groups"])
        ]
        if limits is not None:
            for i, group in enumerate(groups):
                for j, sample in enumerate(group.samples):
                    limits.check(sample, f"groups[{i}].samples[{j}]")
    except RecordError as err:
        raise HTTPException(422, str(err)) from err
    checked = [g.to_dict() for g in groups]
    return groups, wire.reheader(body, checked) if binary else wire.encode(checked)


def _arrays_pass(groups: list[dict[str, Any]], ids: Any, logprobs: Any) -> bool:
    """Whether a binary push's arrays pass rl/core/records.py's array checks (ids non-negative
    int32, logprobs finite, no empty prompt), tested in one vectorised pass over the message's
    flat arrays rather than per sample: a step of 512 samples parses 2x faster. When it fails,
    the per-sample checks run and name the first bad field."""
    prompts = all(len(s["prompt_ids"]) for g in groups for s in g["samples"])
    return prompts and bool((ids >= 0).all()) and bool(np.isfinite(logprobs).all())
