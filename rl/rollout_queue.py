"""The rollout queue: an HTTP service between the orchestrator and every trainer rank.

Scored groups are pushed by the orchestrator and persisted in SQLite (WAL, synchronous=FULL)
before the push is acknowledged. Step N's batch is assembled exactly once, from the oldest
fresh groups (stale ones are dropped and counted), and recorded, so a rank that asks for the
same step again gets the same shard. Every route but /health needs the run's bearer token.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request, Response

from rl import wire
from rl.auth import bearer_guard
from rl.records import Group, RecordError

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


class Store:
    """Durable group storage and batch assembly; every method is one transaction."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)
        self.lock = threading.Lock()

    def push(self, groups: list[Group], batch: int | None = None) -> list[int] | None:
        """Store groups in one transaction (one fsync); returns their ids, or None when
        `batch` was pushed before (a retried push whose answer was lost stores nothing)."""
        rows = [
            (g.min_version, g.max_version, g.tokens, wire.encode([g.to_dict()])) for g in groups
        ]
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            if batch is not None:
                seen = self.db.execute("SELECT 1 FROM batches WHERE batch=?", (batch,)).fetchone()
                if seen:
                    self.db.execute("COMMIT")
                    return None
                self.db.execute("INSERT INTO batches (batch) VALUES (?)", (batch,))
            ids = [
                int(
                    self.db.execute(
                        "INSERT INTO groups (min_version, max_version, tokens, payload) "
                        "VALUES (?,?,?,?)",
                        row,
                    ).lastrowid
                    or 0
                )
                for row in rows
            ]
            self.db.execute("COMMIT")
            return ids

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
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                assembled = self.db.execute(
                    "SELECT COUNT(*) FROM groups WHERE state='assigned' AND step=?", (step,)
                ).fetchone()[0]
                if assembled:  # another rank assembled it first
                    self.db.execute("COMMIT")
                    return True, 0
                cur = self.db.execute(
                    "UPDATE groups SET state='dropped', step=? WHERE state='ready' "
                    "AND ? - min_version > ?",
                    (step, step, max_off_policy),
                )
                dropped = cur.rowcount
                ids = [
                    r[0]
                    for r in self.db.execute(
                        "SELECT id FROM groups WHERE state='ready' ORDER BY id LIMIT ?", (groups,)
                    )
                ]
                done = len(ids) == groups
                if done:
                    marks = ",".join("?" * len(ids))
                    self.db.execute(
                        f"UPDATE groups SET state='assigned', step=? WHERE id IN ({marks})",
                        (step, *ids),
                    )
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
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
    """Rank's share of the samples, balanced by tokens (longest first to the lightest rank)."""
    loads = [0] * world
    owner: dict[int, int] = {}
    order = sorted(
        range(len(samples)),
        key=lambda i: (-(len(samples[i]["prompt_ids"]) + len(samples[i]["completion_ids"])), i),
    )
    for i in order:
        target = min(range(world), key=lambda r: (loads[r], r))
        owner[i] = target
        loads[target] += len(samples[i]["prompt_ids"]) + len(samples[i]["completion_ids"])
    return [samples[i] for i in range(len(samples)) if owner[i] == rank]


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
    async def push(request: Request, batch: int | None = None) -> Response:
        body = await _read_limited(request, max_request_bytes)
        try:
            groups = _parse_groups(body, request.headers.get("content-type", ""))
        except HTTPException:
            stats["rejected_bad"] += 1
            raise
        if store.count("ready") + len(groups) > capacity:
            stats["rejected_full"] += 1
            return Response(status_code=429, headers={"Retry-After": "0.2"})
        ids = await asyncio.to_thread(store.push, groups, batch)
        if ids is None:
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
        t0 = time.monotonic()
        deadline = t0 + min(max(wait, 0.0), 60.0)
        while True:
            last = store.last_step()
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
        groups = await asyncio.to_thread(store.batch, step)
        samples = shard([s for g in groups for s in g["samples"]], rank, world)
        stats["served"] += 1
        meta = {
            "step": step,
            "groups": len(groups),
            "dropped": store.dropped(step),
            "depth": store.count("ready"),
            "micro_batches": pack(samples, micro_tokens),
        }
        if wire.CONTENT_TYPE in request.headers.get("accept", ""):
            body = wire.encode([{"samples": samples}], meta)
            return Response(body, media_type=wire.CONTENT_TYPE)
        body = json.dumps({**meta, "samples": wire.to_lists(samples)})
        return Response(body, media_type="application/json")

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
        return [
            Group.parse(group, f"groups[{i}]", check_arrays=not binary)
            for i, group in enumerate(data["groups"])
        ]
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
