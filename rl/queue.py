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

SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    min_version INTEGER NOT NULL,
    max_version INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    payload TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'ready',
    step INTEGER
);
CREATE INDEX IF NOT EXISTS groups_state ON groups(state, id);
"""


class Store:
    """Durable group storage and batch assembly; every method is one transaction."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)
        self.lock = threading.Lock()

    def push(self, groups: list[dict[str, Any]]) -> list[int]:
        """Store groups in one transaction (one fsync); returns their ids."""
        rows = [
            (
                g["min_version"],
                g["max_version"],
                sum(len(s["prompt_ids"]) + len(s["completion_ids"]) for s in g["samples"]),
                json.dumps(g),
            )
            for g in groups
        ]
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
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
        return [json.loads(r[0]) for r in rows]

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


def create_app(store: Store, token: str, groups_per_step: int, max_off_policy: int,
               capacity: int, max_request_bytes: int) -> FastAPI:  # fmt: skip
    app = FastAPI(title="Relay rollout queue")
    ready = asyncio.Event()
    stats = {"accepted": 0, "served": 0, "rejected_full": 0}

    def authorised(request: Request) -> None:
        if request.headers.get("authorization") != f"Bearer {token}":
            raise HTTPException(401, "missing or wrong bearer token")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/push", dependencies=[Depends(authorised)])
    async def push(request: Request) -> Response:
        body = await request.body()
        if len(body) > max_request_bytes:
            raise HTTPException(413, f"body over {max_request_bytes} bytes")
        groups = _parse_groups(body)
        if store.count("ready") + len(groups) > capacity:
            stats["rejected_full"] += 1
            return Response(status_code=429, headers={"Retry-After": "0.2"})
        ids = await asyncio.to_thread(store.push, groups)
        stats["accepted"] += len(groups)
        ready.set()
        return Response(json.dumps({"ids": ids}), media_type="application/json")

    @app.get("/batch", dependencies=[Depends(authorised)])
    async def batch(step: int, rank: int = 0, world: int = 1, wait: float = 10.0) -> Response:
        if not 0 <= rank < world:
            raise HTTPException(400, f"rank={rank} outside world={world}")
        deadline = time.monotonic() + min(wait, 60.0)
        while True:
            last = store.last_step()
            if step > last + 1:
                raise HTTPException(409, f"step {step} asked before step {last + 1} was assembled")
            if step <= last:
                break
            ready.clear()
            done, _ = await asyncio.to_thread(store.assemble, step, groups_per_step, max_off_policy)
            if done:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return Response(status_code=204)
            try:
                await asyncio.wait_for(ready.wait(), timeout=remaining)
            except TimeoutError:
                return Response(status_code=204)
        groups = await asyncio.to_thread(store.batch, step)
        samples = [s for g in groups for s in g["samples"]]
        stats["served"] += 1
        body = {
            "step": step,
            "groups": len(groups),
            "dropped": store.dropped(step),
            "samples": shard(samples, rank, world),
        }
        return Response(json.dumps(body), media_type="application/json")

    @app.get("/stats", dependencies=[Depends(authorised)])
    def get_stats() -> dict[str, Any]:
        return {
            "depth": store.count("ready"),
            "assigned": store.count("assigned"),
            "dropped": store.count("dropped"),
            "last_step": store.last_step(),
            **stats,
        }

    return app


SAMPLE_KEYS = {"prompt_ids": list, "completion_ids": list, "logprobs": list, "advantage": float}


def _parse_groups(body: bytes) -> list[dict[str, Any]]:
    """Validate pushed groups; any problem is a 422 that names it, and nothing is stored."""
    try:
        data = json.loads(body)
    except ValueError as err:
        raise HTTPException(422, f"body is not JSON: {err}") from err
    if not isinstance(data, dict) or not isinstance(data.get("groups"), list) or not data["groups"]:
        raise HTTPException(422, "body must be an object with a non-empty 'groups' list")
    for i, group in enumerate(data["groups"]):
        _check_group(i, group)
    return data["groups"]


def _check_group(index: int, group: Any) -> None:
    if not isinstance(group, dict) or not isinstance(group.get("samples"), list):
        raise HTTPException(422, f"groups[{index}] must be an object with a 'samples' list")
    for key in ("min_version", "max_version"):
        if not isinstance(group.get(key), int):
            raise HTTPException(422, f"groups[{index}].{key} must be an integer")
    if not group["samples"]:
        raise HTTPException(422, f"groups[{index}].samples is empty")
    for i, sample in enumerate(group["samples"]):
        where = f"groups[{index}].samples[{i}]"
        for key, kind in SAMPLE_KEYS.items():
            value = sample.get(key) if isinstance(sample, dict) else None
            if not isinstance(value, kind) and not (kind is float and isinstance(value, int)):
                raise HTTPException(422, f"{where}.{key} must be a {kind.__name__}")
        if len(sample["logprobs"]) != len(sample["completion_ids"]):
            raise HTTPException(422, f"{where}: logprobs and completion_ids differ in length")


def main() -> None:
    import socket

    import uvicorn

    from rl.runtime import load_run_config, role_args, run_token, setup_logging, write_address

    args = role_args("queue")
    log = setup_logging("queue")
    cfg = load_run_config(args.run_dir)
    store = Store(args.run_dir / "queue.sqlite")
    app = create_app(
        store,
        run_token(args.run_dir),
        groups_per_step=cfg.environment.prompts_per_step,
        max_off_policy=cfg.algorithm.max_off_policy_steps,
        capacity=cfg.queue.capacity,
        max_request_bytes=cfg.queue.max_request_mb * 2**20,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", cfg.queue.port))
    host, port = sock.getsockname()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))

    @app.on_event("startup")
    async def announce() -> None:
        write_address(args.run_dir, "queue", host, port)
        log.info("listening on %s:%d (store %s)", host, port, args.run_dir / "queue.sqlite")

    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
