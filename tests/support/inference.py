"""A real embedded inference server for tests (module fixtures), and requests to it."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from omegaconf import DictConfig

from rl.core.auth import derive, token_auth
from rl.core.runtime import listen_socket, wait_for_address
from tests.support.runs import TOKEN, start_role, stop_role, write_run_dir


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private RELAY_CACHE so the tiny model is built here (and inherited by servers)."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("relay_cache")
        mp.setenv("RELAY_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def server(cfg: DictConfig, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real `python -m rl.inference` process serving the module's `cfg` and `checkpoint`
    fixtures; ended by its process group id."""
    run_dir = write_run_dir(tmp_path_factory.mktemp("run"), cfg, TOKEN)
    proc = start_role("inference", run_dir, "--replica", "0")
    try:
        try:
            url = wait_for_address(run_dir, "inference-0", timeout=120)
        except TimeoutError:
            pytest.fail((run_dir / "inference.log").read_text())
        with httpx.Client(base_url=url, auth=token_auth(TOKEN), timeout=60) as client:
            yield SimpleNamespace(client=client, url=url, run_dir=run_dir, proc=proc)
    finally:
        stop_role(proc)
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status still names it.
    assert proc.returncode in (0, -signal.SIGTERM)


def complete(client: httpx.Client, **body: Any) -> httpx.Response:
    """POST /v1/completions for the tiny model (or `body`'s)."""
    return client.post("/v1/completions", json={"model": "tiny", **body})  # or body's model


def send_unread(url: str, body: dict[str, Any], token: str = TOKEN) -> socket.socket:
    """POST /v1/completions (the tiny model, or `body`'s) sent whole on a socket of its own,
    the answer never read: closing the socket is the client going away."""
    host, port = httpx.URL(url).host, httpx.URL(url).port
    raw = json.dumps({"model": "tiny", **body}).encode()
    key = derive(token)["inference"]  # an API client's key
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    sock = socket.create_connection((host, port), timeout=60)
    sock.sendall(head.encode() + raw)
    return sock


@contextlib.contextmanager
def served_in_thread(app: Any) -> Iterator[str]:
    """`app` served by uvicorn on a thread at 127.0.0.1 (its URL), stopped on leaving."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_config=None))
    sock = listen_socket("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(600):
            if server.started or not thread.is_alive():
                break
            time.sleep(0.05)
        assert server.started
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
