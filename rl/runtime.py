"""What every role process shares: the run directory, its config, addresses and the run token.

Roles find each other through the run directory (a shared filesystem on a cluster): a server
writes `addresses/<name>.json` once it listens, and clients wait for that file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rl.config import RunConfig

TOKEN_ENV = "RELAY_TOKEN"
HOST_ENV = "RELAY_HOST"
# A job supervisor asks the trainer to checkpoint and stop by creating this file in the run
# directory; the trainer answers with the second, holding the step it checkpointed.
CHECKPOINT_REQUEST = "control/checkpoint-request"
CHECKPOINTED = "control/checkpointed"


def server_host() -> str:
    """The address a role's server binds and advertises: the node's address on a cluster
    (set by the job supervisor), loopback on this machine."""
    return os.environ.get(HOST_ENV, "127.0.0.1")


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


def wait_for_address(run_dir: Path, name: str, timeout: float = 900.0) -> str:
    """The base URL of `name`, once it has written its address; a clear error after timeout."""
    path = run_dir / "addresses" / f"{name}.json"
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not write {path} within {timeout:.0f} s")
        time.sleep(0.1)
    info = json.loads(path.read_text())
    return f"http://{info['host']}:{info['port']}"


def append_jsonl(path: Path, record: dict) -> None:
    """Append one JSON line with a single write (several roles append to metrics.jsonl)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


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
