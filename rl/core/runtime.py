"""What every role process shares: its arguments, logging, the run's config and keys,
finding the other roles' servers, and ending in one line on a full disk (`run_role`).

Roles find each other through the run directory (a shared filesystem on a cluster; its layout
is rl/core/rundir.py's): a server records its address once it listens, and clients wait for it.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import httpx
from omegaconf import OmegaConf

from rl.core import disk
from rl.core.auth import KEYS_ENV, TOKEN_ENV, ScopedAuth, decode_keys, derive
from rl.core.config import RunConfig, check_config
from rl.core.rundir import RunDir

# How long a role waits for a peer's server to appear, or to come back after a restart.
PEER_TIMEOUT_S = 900.0
HOST_ENV = "RELAY_HOST"
# The name the launcher gave this role process (queue, inference-0, trainer-node1, ...).
NAME_ENV = "RELAY_NAME"
# Set by the Slurm job supervisor: SIGTERM (`scontrol requeue`, node loss, scancel) reaches the
# trainer's ranks directly, and they checkpoint the step they are on before they stop.
CHECKPOINT_ON_TERM_ENV = "RELAY_CHECKPOINT_ON_TERM"
# The base URL this process serves, once it has written its address: its heartbeat asks it.
_serving: dict[str, str] = {}
RUN_DIR_ENV = "RELAY_RUN_DIR"
FAILED = "role failed: "
"""Starts the line a role that fails with an exception writes last to its log (`run_role`):
the launcher compares it with the one before, and ends the run on the same error twice."""
INSUFFICIENT_STORAGE = 507
"""A role's server answers this when its disk is full: it is ending, and so is the run."""


def run_role(main: Callable[[], None]) -> None:
    """Run a role's entry point. A full disk ends the process with one line naming what it was
    writing and how much space was left (on stderr: the role's log), and rl/core/disk.py's
    EXIT_CODE, instead of a traceback: the launcher then ends the run with that line rather
    than restart a role that would meet the same full disk. Any other exception is written as
    its traceback and then, last, as one line starting with `FAILED`: the launcher ends the run
    with that line when the restarted role fails with the same one (a bug, not a fault)."""
    try:
        main()
    except disk.NOT_FAILURES:
        raise
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        full = disk.as_disk_full(err, Path(os.environ.get(RUN_DIR_ENV, ".")))
        if full is not None:
            end_on_full_disk(full)
        traceback.print_exc()
        with contextlib.suppress(OSError):
            print(f"{FAILED}{error_line(err)}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def error_line(err: BaseException) -> str:
    """`err` as the last line of its traceback says it (`Type: message`), on one line."""
    said = "".join(traceback.format_exception_only(type(err), err)).strip()
    line = " | ".join(part.strip() for part in said.splitlines() if part.strip())
    return line if len(line) <= 400 else line[:399] + "…"


def end_on_full_disk(full: disk.DiskFull, now: bool = False) -> NoReturn:
    """Say `full` in one line and exit with rl/core/disk.py's EXIT_CODE (`now`: at once, from a
    thread other than the main one, skipping the interpreter's clean-up)."""
    name = os.environ.get(NAME_ENV, "role")
    try:
        print(f"{name}: {full}", file=sys.stderr, flush=True)
    except OSError:  # the log is on the full disk too: the exit code still says it
        pass
    if now:
        os._exit(disk.EXIT_CODE)
    raise SystemExit(disk.EXIT_CODE) from None


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
    if role == "inference":  # a replica's prefill or decode instance; its node of several
        parser.add_argument("--instance", choices=("prefill", "decode"), default=None)
        parser.add_argument("--nodes", type=int, default=1)
        parser.add_argument("--node", type=int, default=0)
    if extra:
        args, rest = parser.parse_known_args()
        args.rest = [a for a in rest if a != "--"]
        return args
    return parser.parse_args()


def load_run_config(run_dir: Path) -> RunConfig:
    """The resolved config the launcher wrote, validated against the schema and turned into
    the typed `RunConfig` (each role does this once, at start)."""
    loaded = OmegaConf.merge(OmegaConf.structured(RunConfig), RunDir(run_dir).load_config())
    cfg: RunConfig = OmegaConf.to_object(loaded)  # type: ignore[assignment]
    check_config(cfg)
    return cfg


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


def inference_name(replica: int, part: str | None = None) -> str:
    """The process name of inference replica `replica` (its server, or with prefill/decode
    instances its router), or of its `part` instance: what it logs and writes its address
    under."""
    return f"inference-{replica}" + (f"-{part}" if part else "")


def on_node(name: str, node: int) -> str:
    """The name of process `name`'s part on its job's `node` (the first node's is `name`)."""
    return f"{name}-node{node}" if node else name


def inference_names(cfg: RunConfig) -> list[str]:
    """The names the inference servers write their addresses under."""
    return [inference_name(i) for i in range(cfg.parallel.inference.replicas)]


def run_keys(run_dir: Path) -> dict[str, str]:
    """This process's keys (rl/core/auth.py): those the launcher gave it, or, for a role
    started by hand, every scope's from the run directory's token."""
    if (given := os.environ.get(KEYS_ENV)) is not None:
        return decode_keys(given)
    return derive(os.environ.get(TOKEN_ENV) or RunDir(run_dir).token())


def run_auth(run_dir: Path) -> ScopedAuth:
    """httpx authentication with this process's keys, each route sent with its scope's."""
    return ScopedAuth(run_keys(run_dir))


def write_address(run_dir: Path, name: str, host: str, port: int) -> None:
    """Record where `name` listens; written atomically so readers never see half a file. From
    now on this process's heartbeat beats only while its /health answers."""
    RunDir(run_dir).write_address(name, host, port)
    _serving["url"] = f"http://{host}:{port}"


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
    a request that cannot reach it (or that it answers 507: its disk is full and it is ending)
    waits for the server to answer again (at its old or a new address), up to `timeout`
    seconds, then fails naming it."""

    def __init__(self, run_dir: Path, name: str, timeout: float = PEER_TIMEOUT_S) -> None:
        self.run_dir, self.name, self.timeout = run_dir, name, timeout
        self.url = wait_for_address(run_dir, name, timeout)
        self.log = logging.getLogger("peer")

    def request(self, http: httpx.Client, method: str, route: str, **kwargs: Any) -> httpx.Response:
        deadline = None
        while True:
            try:
                response = http.request(method, f"{self.url}{route}", **kwargs)
            except httpx.TransportError as failed:
                err: Exception = failed
            else:
                if response.status_code != INSUFFICIENT_STORAGE:
                    return response
                # Its disk is full: it ends, and the launcher ends the run. Wait as for a
                # server that cannot be reached, rather than fail (and be restarted) over it.
                err = ConnectionError(f"{self.name} answered {response.text}")
            if deadline is None:
                deadline = time.monotonic() + self.timeout
                self.log.warning("%s unreachable (%r); waiting for it", self.name, err)
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"{self.name} unreachable for {self.timeout:.0f} s: {err!r}"
                ) from err
            time.sleep(0.5)
            self.url = read_address(self.run_dir, self.name) or self.url


class Heartbeat(threading.Thread):
    """Beats a counter into `.relay/heartbeats/<name>.<pid>` every `interval` seconds, from a thread
    of its own, so that the launcher can tell a live role from a hung one: a stopped or frozen
    process stops beating, however long its main thread legitimately waits. A server beats only
    while its own /health answers (ok, or starting): a blocked event loop or a failed engine
    stops the beat too. The launcher (launcher/clusters/processes.py) kills and restarts a role
    whose beat stops for `timeouts.hung_s`.

    Each beat rewrites the counter in place, at a fixed width: after the first, a beat takes no
    new space, so a role that is only waiting beats on when the disk fills, and the write that
    needs the space is the one that fails and says so. (A reader only asks whether the text
    changed; one that catches a beat half-written sees a change, which it is.) A first beat the
    disk has no room for ends the process as a full disk does (`end_on_full_disk`)."""

    WIDTH = 20

    def __init__(self, path: Path, interval: float, probe_timeout: float) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.path, self.interval, self.probe_timeout = path, interval, probe_timeout

    def run(self) -> None:
        try:
            with disk.writing(self.path):
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                atexit.register(self.path.unlink, missing_ok=True)
                beats = 0
                while True:
                    if self.healthy():
                        beats += 1
                        os.pwrite(fd, f"{beats:>{self.WIDTH}}".encode(), 0)
                    time.sleep(self.interval)
        except disk.DiskFull as full:
            end_on_full_disk(full, now=True)

    def healthy(self) -> bool:
        url = _serving.get("url")
        if url is None:  # not serving (yet): being alive is all there is to tell
            return True
        try:
            response = httpx.get(f"{url}/health", timeout=self.probe_timeout)
        except httpx.HTTPError:
            return False
        if response.status_code == 200:
            return True
        try:
            return response.json().get("status") == "starting"
        except ValueError:
            return False


def start_heartbeat(run_dir: Path, hung_s: float) -> Heartbeat | None:
    """Start this process's heartbeat when a launcher started it (`RELAY_NAME` set); a role
    started alone (tests, by hand) has nobody watching and beats nothing."""
    name = os.environ.get(NAME_ENV)
    if not name:
        return None
    path = RunDir(run_dir).heartbeat(name, os.getpid())
    beat = Heartbeat(path, interval=min(1.0, hung_s / 10), probe_timeout=max(1.0, hung_s / 4))
    beat.start()
    return beat


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


def deterministic_cuda() -> None:
    """On CUDA, torch's deterministic algorithms (cuBLAS with a fixed workspace): the same
    inputs give the same results, run after run. Kernels without a deterministic version warn
    (they are named in the role's log) rather than stop the run. Call before CUDA is used."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
