"""What every role process shares: the run directory, its config, addresses and the run token.

Roles find each other through the run directory (a shared filesystem on a cluster): a server
writes `addresses/<name>.json` once it listens, and clients wait for that file.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from omegaconf import DictConfig, OmegaConf

from rl.config import RunConfig

TOKEN_ENV = "RELAY_TOKEN"
# How long a role waits for a peer's server to appear, or to come back after a restart.
PEER_TIMEOUT_S = 900.0
HOST_ENV = "RELAY_HOST"
# A job supervisor asks the trainer to checkpoint and stop by creating this file in the run
# directory; the trainer answers with the second, holding the step it checkpointed.
CHECKPOINT_REQUEST = "control/checkpoint-request"
CHECKPOINTED = "control/checkpointed"


def server_host() -> str:
    """The address a role's server binds and advertises: the node's address on a cluster
    (set by the job supervisor), loopback on this machine."""
    return os.environ.get(HOST_ENV, "127.0.0.1")


def die_with_parent(sig: int) -> None:
    """Ask Linux to send `sig` to this process when the thread that started it exits."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, sig)


def role_args(role: str, extra: bool = False) -> argparse.Namespace:
    """Parse the common `--run-dir` argument of a role entry point."""
    parser = argparse.ArgumentParser(prog=f"python -m rl.{role}")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--replica", type=int, default=0)
    if extra:
        args, rest = parser.parse_known_args()
        args.rest = [a for a in rest if a != "--"]
        return args
    return parser.parse_args()


def load_run_config(run_dir: Path) -> DictConfig:
    """The resolved config the launcher wrote, re-validated against the schema."""
    loaded = OmegaConf.load(run_dir / "config.yaml")
    return OmegaConf.merge(OmegaConf.structured(RunConfig), loaded)  # type: ignore[return-value]


def setup_logging(role: str) -> logging.Logger:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s.%(msecs)03d {role} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return logging.getLogger(role)


def inference_names(cfg: DictConfig) -> list[str]:
    """The names the inference servers write their addresses under."""
    return [f"inference-{i}" for i in range(cfg.parallel.inference.replicas)]


def run_token(run_dir: Path) -> str:
    token = os.environ.get(TOKEN_ENV)
    if token:
        return token
    return (run_dir / "token").read_text().strip()


def auth_headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def write_address(run_dir: Path, name: str, host: str, port: int) -> None:
    """Record where `name` listens; written atomically so readers never see half a file."""
    folder = run_dir / "addresses"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{name}.json.tmp"
    tmp.write_text(json.dumps({"host": host, "port": port, "pid": os.getpid()}))
    tmp.rename(folder / f"{name}.json")


def read_address(run_dir: Path, name: str) -> str | None:
    """The base URL `name` last wrote, if it has written one."""
    try:
        info = json.loads((run_dir / "addresses" / f"{name}.json").read_text())
    except FileNotFoundError:
        return None
    return f"http://{info['host']}:{info['port']}"


def wait_for_address(run_dir: Path, name: str, timeout: float = PEER_TIMEOUT_S) -> str:
    """The base URL of `name`, once it has written its address; a clear error after timeout."""
    deadline = time.monotonic() + timeout
    while (url := read_address(run_dir, name)) is None:
        if time.monotonic() > deadline:
            path = run_dir / "addresses" / f"{name}.json"
            raise TimeoutError(f"{name} did not write {path} within {timeout:.0f} s")
        time.sleep(0.1)
    return url


class Peer:
    """A role's server, found through the run directory, and found again after it restarts:
    a request that cannot reach it waits for the server to answer again (at its old or a new
    address), up to `timeout` seconds, then fails naming it."""

    def __init__(self, run_dir: Path, name: str, timeout: float = PEER_TIMEOUT_S) -> None:
        self.run_dir, self.name, self.timeout = run_dir, name, timeout
        self.url = wait_for_address(run_dir, name, timeout)
        self.log = logging.getLogger("peer")

    def request(self, http: httpx.Client, method: str, route: str, **kwargs: Any) -> httpx.Response:
        deadline = None
        while True:
            try:
                return http.request(method, f"{self.url}{route}", **kwargs)
            except httpx.TransportError as err:
                if deadline is None:
                    deadline = time.monotonic() + self.timeout
                    self.log.warning("%s unreachable (%r); waiting for it", self.name, err)
                if time.monotonic() > deadline:
                    raise ConnectionError(
                        f"{self.name} unreachable for {self.timeout:.0f} s: {err!r}"
                    ) from err
                time.sleep(0.5)
                self.url = read_address(self.run_dir, self.name) or self.url


def append_jsonl(path: Path, record: dict) -> None:
    """Append one JSON line with a single write, under the file's lock (several roles append to
    metrics.jsonl, and a resuming trainer rewrites it)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(record) + "\n")


def drop_records(path: Path, drop: Callable[[dict], bool]) -> int:
    """Remove the JSON lines for which `drop` is true, in place and under the file's lock;
    returns how many went."""
    if not path.exists():
        return 0
    with open(path, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        lines = [line for line in f.read().splitlines() if line.strip()]
        kept = [line for line in lines if not drop(json.loads(line))]
        f.seek(0)
        f.write("".join(line + "\n" for line in kept))
        f.truncate()
    return len(lines) - len(kept)


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for a role's HTTP server (port 0 picks a free one).

    TCP_NODELAY is set on the listening socket so accepted connections inherit it: without it,
    a response written in two parts waits on the client's delayed ACK (~40 ms per request on a
    keep-alive connection, measured on loopback here).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock
