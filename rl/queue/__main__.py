"""`python -m rl.queue --run-dir D`: the rollout queue of run D, until SIGTERM.

It opens the run's store (refusing one that lost committed data), serves the routes of
rl/queue/app.py, and records its address once it accepts connections. A write the disk has no
room for is answered 507 and ends the queue with one line (rl/core/runtime.py's `run_role`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rl.core.derive import max_model_len
from rl.core.disk import DiskFull
from rl.core.records import RunLimits
from rl.core.rundir import RunDir
from rl.core.runtime import (
    INSUFFICIENT_STORAGE,
    listen_socket,
    load_run_config,
    role_args,
    run_keys,
    run_role,
    server_host,
    setup_logging,
    start_heartbeat,
    write_address,
)
from rl.queue.app import create_app
from rl.queue.store import Store, StoreLost


def main() -> None:
    args = role_args("queue")
    log = setup_logging("queue")
    cfg = load_run_config(args.run_dir)
    start_heartbeat(args.run_dir, cfg.timeouts.hung_s)
    run_dir = RunDir(args.run_dir)
    try:
        store = Store(run_dir.queue_store, run_dir.queue_marks)
    except StoreLost as err:
        log.error("%s", err)
        raise SystemExit(f"queue: {err}") from None
    app = create_app(
        store,
        run_keys(args.run_dir),
        groups_per_step=cfg.environment.prompts_per_step,
        max_off_policy=cfg.algorithm.max_off_policy_steps,
        capacity=cfg.queue.capacity,
        max_request_bytes=cfg.queue.max_request_mb * 2**20,
        limits=RunLimits(cfg.model.vocab_size, max_model_len(cfg)),
        run=run_dir,
        batches_ahead=cfg.queue.batches_ahead,
    )
    sock = listen_socket(server_host(), cfg.queue.port)
    host, port = sock.getsockname()

    @contextlib.asynccontextmanager
    async def announce(_: FastAPI) -> AsyncIterator[None]:
        write_address(args.run_dir, "queue", host, port)  # once it serves: peers may come
        log.info("listening on %s:%d (store %s)", host, port, run_dir.queue_store)
        yield

    app.router.lifespan_context = announce
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    full: list[DiskFull] = []

    async def disk_full(_: Request, err: Exception) -> JSONResponse:
        """A full disk: answer 507 (clients wait, as for a queue that is gone), then end."""
        assert isinstance(err, DiskFull)
        full.append(err)
        server.should_exit = True
        return JSONResponse({"detail": str(err)}, status_code=INSUFFICIENT_STORAGE)

    app.add_exception_handler(DiskFull, disk_full)
    server.run(sockets=[sock])
    if full:
        raise full[0]


if __name__ == "__main__":
    run_role(main)
