"""The rollout queue: an HTTP service between the orchestrator and every trainer rank.

Scored groups are pushed by the orchestrator and persisted in SQLite (WAL, synchronous=FULL)
before the push is acknowledged. Step N's batch is assembled exactly once, from the oldest
fresh groups (stale ones are dropped and counted), and recorded, so a rank that asks for the
same step again gets the same shard. Every route but /health needs the run's bearer token.

Every write is one locked transaction that commits or rolls back whole (`Store.transaction`),
so a failed request leaves nothing behind, and the capacity check happens inside the push's
own transaction, so concurrent pushes cannot overfill the queue. Handlers are async; anything
that touches SQLite or walks a batch (sharding, packing, encoding) runs in a worker thread, so
one large request never stalls the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response

from rl import wire
from rl.auth import bearer_guard
from rl.records import INT64_MAX, Group, RecordError

MAX_WORLD = 65536
"""Most trainer ranks a batch is sharded across; more is refused (400), not attempted."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    min_version INTEGER NOT NULL,
    max_version INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    payload BLOB NOT NULL,
    state TEXT NOT NULL DEFAULT 'ready',
    step INTEGER
);
CREATE INDEX IF NOT EXISTS groups_state ON groups(state, id);
CREATE TABLE IF NOT EXISTS batches (batch INTEGER PRIMARY KEY);
"""


class Refused(Enum):
    """Why `Store.push` stored nothing."""

    duplicate = "duplicate"
    """The batch number was pushed before (a retry whose answer was lost)."""
    full = "full"
    """The groups would take the queue past its capacity."""


class Store:
    """Durable group storage and batch assembly; every method is one transaction."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One locked write transaction: committed when the block ends (returns included),
        rolled back on any error, so a failure never leaves the connection mid-transaction."""
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def push(
        self, groups: list[Group], batch: int | None = None, capacity: int | None = None
    ) -> list[int] | Refused:
        """Store groups in one transaction (one fsync) and return their ids; or store nothing
        and say why: `batch` was pushed before, or the ready groups would exceed `capacity`."""
        rows = [
            (g.min_version, g.max_version, g.tokens, wire.encode([g.to_dict()])) for g in groups
        ]
        with self.transaction() as db:
            if batch is not None:
                if db.execute("SELECT 1 FROM batches WHERE batch=?", (batch,)).fetchone():
                    return Refused.duplicate
            ready = db.execute("SELECT COUNT(*) FROM groups WHERE state='ready'").fetchone()[0]
            if capacity is not None and ready + len(rows) > capacity:
                return Refused.full
            if batch is not None:
                db.execute("INSERT INTO batches (batch) VALUES (?)", (batch,))
            insert = (
                "INSERT INTO groups (min_version, max_version, tokens, payload) VALUES (?,?,?,?)"
            )
            return [int(db.execute(insert, row).lastrowid or 0) for row in rows]

    def next_batch(self) -> int:
        """One past the highest batch number pushed (0 before any)."""
        with self.lock:
            row = self.db.execute("SELECT MAX(batch) FROM batches").fetchone()
            return 0 if row[0] is None else int(row[0]) + 1

    def count(self, state: str) -> int:
        with self.lock:
            return self.db.execute(
                "SELECT COUNT(*) FROM groups WHERE state=?", (state,)
            ).fetchone()[0]

    def last_step(self) -> int:
        with self.lock:
            row = self.db.execute("SELECT MAX(step) FROM groups WHERE state='assigned'").fetchone()
            return -1 if row[0] is None else int(row[0])

    def assemble(self, step: int, groups: int, max_off_policy: int) -> tuple[bool, int]:
        """Assign `groups` fresh groups to `step` if enough are ready; returns (done, dropped)."""
        with self.transaction() as db:
            assembled = db.execute(
                "SELECT COUNT(*) FROM groups WHERE state='assigned' AND step=?", (step,)
            ).fetchone()[0]
            if assembled:  # another rank assembled it first
                return True, 0
            dropped = db.execute(
                "UPDATE groups SET state='dropped', step=? WHERE state='ready' "
                "AND ? - min_version > ?",
                (step, step, max_off_policy),
            ).rowcount
            ids = [
                r[0]
                for r in db.execute(
                    "SELECT id FROM groups WHERE state='ready' ORDER BY id LIMIT ?", (groups,)
                )
            ]
            done = len(ids) == groups
            if done:
                marks = ",".join("?" * len(ids))
                db.execute(
                    f"UPDATE groups SET state='assigned', step=? WHERE id IN ({marks})",
                    (step, *ids),
                )
            return done, dropped

    def batch(self, step: int) -> list[dict[str, Any]]:
        with self.lock:
            rows = self.db.execute(
                "SELECT payload FROM groups WHERE state='assigned' AND step=? ORDER BY id", (step,)
            ).fetchall()
        return [wire.decode(r[0], lists=False)[0][0] for r in rows]

    def dropped(self, step: int) -> int:
        with self.lock:
            return self.db.execute(
                "SELECT COUNT(*) FROM groups WHERE state='dropped' AND step=?", (step,)
            ).fetchone()[0]


def shard(samples: list[dict[str, Any]], rank: int, world: int) -> list[dict[str, Any]]:
    """Rank's share of the samples, balanced by tokens (longest first to the lightest rank,
    the lowest-numbered one on ties)."""
    loads = [(0, r) for r in range(world)]  # a heap of (tokens, rank); sorted is a valid heap
    mine = []
    for i in sorted(range(len(samples)), key=lambda i: (-_tokens(samples[i]), i)):
        load, target = heapq.heappop(loads)
        if target == rank:
            mine.append(i)
        heapq.heappush(loads, (load + _tokens(samples[i]), target))
    return [samples[i] for i in sorted(mine)]


def pack(samples: list[dict[str, Any]], max_tokens: int) -> list[list[int]]:
    """Indices of `samples` packed into micro-batches of at most `max_tokens` tokens
    (first-fit decreasing; a sample longer than the budget gets a micro-batch of its own)."""
    bins: list[tuple[int, list[int]]] = []
    order = sorted(range(len(samples)), key=lambda i: (-_tokens(samples[i]), i))
    for i in order:
        size = _tokens(samples[i])
        for b, (used, members) in enumerate(bins):
            if used + size <= max_tokens:
                bins[b] = (used + size, [*members, i])
                break
        else:
            bins.append((size, [i]))
    return [sorted(members) for _, members in bins]


def _tokens(sample: dict[str, Any]) -> int:
    return len(sample["prompt_ids"]) + len(sample["completion_ids"])


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


def create_app(store: Store, token: str, groups_per_step: int, max_off_policy: int,
               capacity: int, max_request_bytes: int) -> FastAPI:  # fmt: skip
    """The queue's HTTP routes over `store`; every route but /health needs `token`."""
    # The OpenAPI description is served behind the token like every route but /health.
    app = FastAPI(
        title="Relay rollout queue", version="1", openapi_url=None, docs_url=None, redoc_url=None
    )
    ready = asyncio.Event()
    stats: dict[str, Any] = {"accepted": 0, "served": 0, "rejected_full": 0, "rejected_bad": 0}
    step_timings: dict[int, dict[str, float]] = {}
    authorised = bearer_guard(token)

    @app.get("/health", summary="Liveness; needs no token")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post(
        "/push",
        dependencies=[Depends(authorised)],
        summary="Store scored groups (JSON or relay-groups binary); 429 when full",
        openapi_extra=PUSH_BODY,
        responses={413: {}, 415: {}, 422: {}, 429: {}},
    )
    async def push(
        request: Request, batch: Annotated[int | None, Query(ge=0, le=INT64_MAX)] = None
    ) -> Response:
        body = await _read_limited(request, max_request_bytes)
        content_type = request.headers.get("content-type", "")
        try:
            groups = await asyncio.to_thread(_parse_groups, body, content_type)
        except HTTPException:
            stats["rejected_bad"] += 1
            raise
        ids = await asyncio.to_thread(store.push, groups, batch, capacity)
        if ids is Refused.full:
            stats["rejected_full"] += 1
            return Response(status_code=429, headers={"Retry-After": "0.2"})
        if ids is Refused.duplicate:
            body = json.dumps({"ids": [], "duplicate": True})
            return Response(body, media_type="application/json")
        stats["accepted"] += len(groups)
        ready.set()
        return Response(json.dumps({"ids": ids}), media_type="application/json")

    @app.get(
        "/batch",
        dependencies=[Depends(authorised)],
        summary="This rank's shard of step N's batch, packed into micro-batches; 204 if not ready",
        responses={200: BINARY_BODY, 204: {}, 409: {}},
    )
    async def batch(
        request: Request,
        step: int,
        rank: int = 0,
        world: int = 1,
        wait: float = 10.0,
        micro_tokens: int = 8192,
    ) -> Response:
        if not 0 <= rank < world or step < 0 or micro_tokens < 1:
            raise HTTPException(400, "need step >= 0, 0 <= rank < world, micro_tokens >= 1")
        if world > MAX_WORLD:
            raise HTTPException(400, f"world must be at most {MAX_WORLD}, got {world}")
        t0 = time.monotonic()
        deadline = t0 + min(max(wait, 0.0), 60.0)
        while True:
            last = await asyncio.to_thread(store.last_step)
            if step > last + 1:
                raise HTTPException(409, f"step {step} asked before step {last + 1} was assembled")
            if step <= last:
                break
            ready.clear()
            done, _ = await asyncio.to_thread(store.assemble, step, groups_per_step, max_off_policy)
            if done:
                waited = time.monotonic() - t0
                step_timings[step] = {"waited_s": waited, "assembled_at": time.time()}
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return Response(status_code=204)
            try:
                await asyncio.wait_for(ready.wait(), timeout=remaining)
            except TimeoutError:
                return Response(status_code=204)
        binary = wire.CONTENT_TYPE in request.headers.get("accept", "")
        reply = await asyncio.to_thread(
            _shard_reply, store, step, rank, world, micro_tokens, binary
        )
        stats["served"] += 1
        return reply

    @app.get("/openapi.json", dependencies=[Depends(authorised)], include_in_schema=False)
    def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.get("/stats", dependencies=[Depends(authorised)], summary="Depth, counts, step timings")
    def get_stats() -> dict[str, Any]:
        recent = sorted(step_timings)[-20:]
        return {
            "depth": store.count("ready"),
            "assigned": store.count("assigned"),
            "dropped": store.count("dropped"),
            "last_step": store.last_step(),
            "next_batch": store.next_batch(),
            "capacity": capacity,
            "steps": {str(k): step_timings[k] for k in recent},
            **stats,
        }

    return app


def _shard_reply(
    store: Store, step: int, rank: int, world: int, micro_tokens: int, binary: bool
) -> Response:
    """Rank's shard of assembled step `step`, packed and encoded (blocking: run in a thread)."""
    groups = store.batch(step)
    samples = shard([s for g in groups for s in g["samples"]], rank, world)
    meta = {
        "step": step,
        "groups": len(groups),
        "dropped": store.dropped(step),
        "depth": store.count("ready"),
        "micro_batches": pack(samples, micro_tokens),
    }
    if binary:
        return Response(wire.encode([{"samples": samples}], meta), media_type=wire.CONTENT_TYPE)
    body = json.dumps({**meta, "samples": wire.to_lists(samples)})
    return Response(body, media_type="application/json")


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


def _parse_groups(body: bytes, content_type: str) -> list[Group]:
    """Validate pushed groups (rl/records.py); any problem is a 4xx that names it, and nothing
    is stored."""
    binary = content_type.startswith(wire.CONTENT_TYPE)
    if binary:
        try:
            data: Any = {"groups": wire.decode(body, lists=False)[0]}
        except wire.WireError as err:
            raise HTTPException(422, str(err)) from err
    elif content_type.startswith("application/json"):
        try:
            data = json.loads(body)
        except ValueError as err:
            raise HTTPException(422, f"body is not JSON: {err}") from err
    else:
        raise HTTPException(415, f"content type must be application/json or {wire.CONTENT_TYPE}")
    if not isinstance(data, dict) or not isinstance(data.get("groups"), list) or not data["groups"]:
        raise HTTPException(422, "body must be an object with a non-empty 'groups' list")
    try:
        return [Group.parse(group, f"groups[{i}]") for i, group in enumerate(data["groups"])]
    except RecordError as err:
        raise HTTPException(422, str(err)) from err


def main() -> None:
    import uvicorn

    from rl.rundir import RunDir
    from rl.runtime import (
        listen_socket,
        load_run_config,
        role_args,
        run_token,
        server_host,
        setup_logging,
        write_address,
    )

    args = role_args("queue")
    log = setup_logging("queue")
    cfg = load_run_config(args.run_dir)
    run_dir = RunDir(args.run_dir)
    store = Store(run_dir.queue_store)
    app = create_app(
        store,
        run_token(args.run_dir),
        groups_per_step=cfg.environment.prompts_per_step,
        max_off_policy=cfg.algorithm.max_off_policy_steps,
        capacity=cfg.queue.capacity,
        max_request_bytes=cfg.queue.max_request_mb * 2**20,
    )
    sock = listen_socket(server_host(), cfg.queue.port)
    host, port = sock.getsockname()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))

    @app.on_event("startup")
    async def announce() -> None:
        write_address(args.run_dir, "queue", host, port)
        log.info("listening on %s:%d (store %s)", host, port, run_dir.queue_store)

    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
