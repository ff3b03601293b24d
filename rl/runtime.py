"""What every role process shares: its arguments, logging, the run's config and token, and
finding the other roles' servers.

Roles find each other through the run directory (a shared filesystem on a cluster; its layout
is rl/rundir.py's): a server records its address once it listens, and clients wait for it.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from omegaconf import OmegaConf

from rl.config import RunConfig
from rl.rundir import RunDir

TOKEN_ENV = "RELAY_TOKEN"
# How long a role waits for a peer's server to appear, or to come back after a restart.
PEER_TIMEOUT_S = 900.0
HOST_ENV = "RELAY_HOST"


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


def load_run_config(run_dir: Path) -> RunConfig:
    """The resolved config the launcher wrote, validated against the schema and turned into
    the typed `RunConfig` (each role does this once, at start)."""
    loaded = OmegaConf.merge(OmegaConf.structured(RunConfig), RunDir(run_dir).load_config())
    return OmegaConf.to_object(loaded)  # type: ignore[return-value]


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


def inference_names(cfg: RunConfig) -> list[str]:
    """The names the inference servers write their addresses under."""
    return [f"inference-{i}" for i in range(cfg.parallel.inference.replicas)]


def run_token(run_dir: Path) -> str:
    token = os.environ.get(TOKEN_ENV)
    if token:
        return token
    return RunDir(run_dir).token()


def auth_headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def write_address(run_dir: Path, name: str, host: str, port: int) -> None:
    """Record where `name` listens; written atomically so readers never see half a file."""
    RunDir(run_dir).write_address(name, host, port)


def read_address(run_dir: Path, name: str) -> str | None:
    """The base URL `name` last wrote, if it has written one."""
    return RunDir(run_dir).read_address(name)


def wait_for_address(run_dir: Path, name: str, timeout: float = PEER_TIMEOUT_S) -> str:
    """The base URL of `name`, once it has written its address; a clear error after timeout."""
    deadline = time.monotonic() + timeout
    while (url := read_address(run_dir, name)) is None:
        if time.monotonic() > deadline:
            path = RunDir(run_dir).address_file(name)
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
