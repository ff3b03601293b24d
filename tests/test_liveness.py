"""Hung roles are found and restarted: a stopped process, a server whose /health fails, while a
live one is left alone (launcher/clusters/processes.py's Liveness, rl/core/runtime.py's Heartbeat).

Each test starts a small real role process through the launcher's own `spawn` and watches it
with `check_children`, as the local launcher and the Slurm supervisor do.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.clusters.processes import (
    Child,
    Liveness,
    RunFailed,
    check_children,
    expand,
    spawn,
    stop_children,
)
from launcher.plan.planner import plan
from rl.core.rundir import RunDir
from tests.support.runs import ROOT, TOKEN, compose_run, write_run_dir

HUNG_S = 2.0
# A role that beats from a thread and otherwise sleeps (like a trainer waiting for a batch).
SLEEPER = """
import sys, time
from pathlib import Path
from rl.core.runtime import start_heartbeat
start_heartbeat(Path(sys.argv[1]), float(sys.argv[2]))
time.sleep(300)
"""
# A server whose /health answers with the status code given: it beats only while that is 200.
SERVER = """
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from rl.core.runtime import start_heartbeat, write_address

run, hung_s, code = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ok" if code == 200 else "failed"}).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
beat = start_heartbeat(run, hung_s)
# Serve (and so be probed) only once it has beaten: a role that never beat is still starting
# to the launcher, which gives it start_s, and on a loaded machine the first probe can come
# before the first beat.
for _ in range(600):
    if beat is None or beat.path.exists():
        break
    time.sleep(0.05)
write_address(run, "server", "127.0.0.1", server.server_address[1])
server.serve_forever()
"""


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    run = RunDir(tmp_path)
    run.logs.mkdir()
    return run


@pytest.fixture
def started(run: RunDir) -> Iterator[list[Child]]:
    children: list[Child] = []
    yield children
    stop_children(children)


def start(run: RunDir, children: list[Child], name: str, code: str, *args: str) -> Child:
    argv = [sys.executable, "-c", code, str(run.root), str(HUNG_S), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = spawn(name, "queue", argv, env, run.log(name))
    children.append(child)
    return child


def watch(children: list[Child], liveness: Liveness, until: Callable[[], bool], for_s: float):
    """Check the children as the launcher does until `until()` or `for_s` seconds pass."""
    deadline = time.monotonic() + for_s
    while not until() and time.monotonic() < deadline:
        check_children(children, set(), max_restarts=1, liveness=liveness)
        time.sleep(0.1)


def beating(run: RunDir, name: str) -> Callable[[], bool]:
    return lambda: bool(run.heartbeats_of(name))


def test_a_stopped_role_is_killed_and_restarted(
    run: RunDir, started: list[Child], capsys: pytest.CaptureFixture[str]
) -> None:
    liveness = Liveness(run, hung_s=HUNG_S, start_s=120.0)
    child = start(run, started, "sleeper", SLEEPER)
    watch(started, liveness, beating(run, "sleeper"), for_s=60)
    first = child.proc.pid
    os.killpg(first, signal.SIGSTOP)
    watch(started, liveness, lambda: child.proc.pid != first, for_s=60)
    assert child.proc.pid != first and child.restarts == 1
    err = capsys.readouterr().err
    assert "role sleeper hung: no sign of life for" in err
    assert "(timeouts.hung_s=2); killing it" in err
    assert "role sleeper hung (no sign of life for" in err and "restarting it (1 of 1)" in err
    assert "--- hung (no sign of life for" in run.log("sleeper").read_text()


def test_a_role_hung_past_its_restarts_fails_the_run_naming_it(
    run: RunDir, started: list[Child]
) -> None:
    liveness = Liveness(run, hung_s=HUNG_S, start_s=120.0)
    child = start(run, started, "sleeper", SLEEPER)
    watch(started, liveness, beating(run, "sleeper"), for_s=60)
    os.killpg(child.proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 60
    with pytest.raises(RunFailed, match="role sleeper hung .* and was killed"):
        while time.monotonic() < deadline:
            check_children(started, set(), max_restarts=0, liveness=liveness)
            time.sleep(0.1)


# A role that fails with an exception (through `run_role`, as every role's entry point does);
# its message is argv[3], and with argv[4] also its pid, so that each start fails differently.
FAILING = """
import os, sys
from rl.core.runtime import run_role

def main():
    raise ValueError(sys.argv[3] + (f" in {os.getpid()}" if len(sys.argv) > 4 else ""))

run_role(main)
"""


def fail_until_run_ends(children: list[Child]) -> RunFailed:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            check_children(children, set(), max_restarts=3)
        except RunFailed as failed:
            return failed
        time.sleep(0.1)
    raise AssertionError("the run did not end")


def test_a_role_failing_twice_with_the_same_error_ends_the_run_with_it(
    run: RunDir, started: list[Child], capsys: pytest.CaptureFixture[str]
) -> None:
    """Restarts are for faults: a bug met again is not restarted a second time (before, it was
    restarted max_restarts times and the reason stayed in its log)."""
    child = start(run, started, "buggy", FAILING, "the same bug")
    failed = fail_until_run_ends(started)
    assert child.restarts == 1
    assert str(failed).startswith(
        "role buggy failed twice in a row with the same error, so it is not restarted again: "
        "ValueError: the same bug (traceback in "
    )
    err = capsys.readouterr().err
    assert "role buggy exited with code 1 (ValueError: the same bug): restarting it (1 of 3)" in err
    assert run.log("buggy").read_text().count("Traceback (most recent call last)") == 2
    # Failing differently each time is a fault: it gets its restarts.
    flaky = start(run, started, "flaky", FAILING, "a fault", "with its pid")
    started.remove(child)
    child.log_file.close()
    failed = fail_until_run_ends(started)
    assert flaky.restarts == 3 and "after 3 restart(s) (ValueError: a fault in " in str(failed)


def test_a_server_whose_health_fails_stops_beating_and_is_restarted(
    run: RunDir, started: list[Child], capsys: pytest.CaptureFixture[str]
) -> None:
    liveness = Liveness(run, hung_s=HUNG_S, start_s=120.0)
    child = start(run, started, "server", SERVER, "503")
    watch(started, liveness, lambda: run.address_file("server").exists(), for_s=60)
    first = child.proc.pid
    watch(started, liveness, lambda: child.proc.pid != first, for_s=60)
    assert child.proc.pid != first
    assert "role server hung: no sign of life for" in capsys.readouterr().err


def test_live_roles_are_left_alone(run: RunDir, started: list[Child]) -> None:
    """A sleeping role and a healthy server, watched for several times `hung_s`, are neither
    killed nor restarted."""
    liveness = Liveness(run, hung_s=HUNG_S, start_s=120.0)
    sleeper = start(run, started, "sleeper", SLEEPER)
    server = start(run, started, "server", SERVER, "200")
    watch(started, liveness, lambda: run.address_file("server").exists(), for_s=60)
    pids = (sleeper.proc.pid, server.proc.pid)
    watch(started, liveness, lambda: False, for_s=4 * HUNG_S)
    assert (sleeper.proc.pid, server.proc.pid) == pids
    assert sleeper.proc.poll() is None and server.proc.poll() is None
    assert sleeper.restarts == server.restarts == 0
    assert run.heartbeats_of("sleeper") and run.heartbeats_of("server")


def process_state(pid: int) -> str | None:
    """The state letter of `pid` in /proc (T: stopped, Z: a zombie), or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2]


def wait_for(until: Callable[[], bool], for_s: float = 60) -> bool:
    deadline = time.monotonic() + for_s
    while not until() and time.monotonic() < deadline:
        time.sleep(0.05)
    return until()


@pytest.mark.slow
def test_signals_to_the_trainer_roles_group_reach_its_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: list[Child]
) -> None:
    """The trainer role started as the plan and the launcher start it (torchrun and one rank of
    the real trainer, which waits for a queue that never comes): a SIGSTOP of the role's
    process group stops the rank, not only torchrun (the launcher's hang detection relies on
    it), a SIGCONT lets it go on, and a SIGTERM of the group ends both."""
    monkeypatch.setenv("RELAY_CACHE", str(tmp_path / "cache"))
    cfg = compose_run("warmup.steps=0")
    trainer = plan(cfg).role("trainer")[0]
    run = RunDir(write_run_dir(tmp_path / "run", cfg, TOKEN))
    values = {"RELAY_RUN_DIR": str(run.root)}
    env = {**os.environ, **trainer.env, "RELAY_TOKEN": TOKEN, **values}
    child = spawn("trainer", "trainer", expand(trainer.argv, values), env, run.log("trainer"))
    started.append(child)
    assert wait_for(beating(run, "trainer"), for_s=300), run.log("trainer").read_text()
    rank = int(run.heartbeats_of("trainer")[0].suffix[1:])  # the rank beats, torchrun does not
    assert rank != child.proc.pid
    os.killpg(child.proc.pid, signal.SIGSTOP)
    stopped = wait_for(lambda: process_state(rank) == "T")
    assert stopped, f"the rank is {process_state(rank)!r} after SIGSTOP of its role's group"
    assert wait_for(lambda: process_state(child.proc.pid) == "T")  # and torchrun
    os.killpg(child.proc.pid, signal.SIGCONT)
    assert wait_for(lambda: process_state(rank) not in ("T", None))
    os.killpg(child.proc.pid, signal.SIGTERM)
    child.proc.wait(timeout=60)
    assert wait_for(lambda: process_state(rank) in (None, "Z")), process_state(rank)


@pytest.mark.parametrize("transport", ["filesystem", "broadcast"])
def test_waiting_for_weights_that_never_come_ends_naming_them(
    tmp_path: Path, transport: str
) -> None:
    """The orchestrator's wait for the trainer's next version has a deadline
    (`timeouts.weights_s`): past it, an error names the version and where it was awaited."""
    import logging

    from rl.weights.filesystem import BroadcastRecordWaiter, FilesystemWaiter

    run_dir = RunDir(tmp_path)
    run_dir.weights.mkdir(parents=True)
    if transport == "broadcast":
        (run_dir.weights / "BROADCAST").write_text("3")
        waiter = BroadcastRecordWaiter(tmp_path, timeout_s=0.3)
    else:
        waiter = FilesystemWaiter(tmp_path, None, logging.getLogger("test"), 0.3, exact=True)
    with pytest.raises(TimeoutError, match=r"timeouts.weights_s\) for policy version 4 in"):
        waiter.wait(minimum=4, held=3)
    if transport == "broadcast":  # what has come is returned at once
        (run_dir.weights / "BROADCAST").write_text("4")
        assert waiter.wait(minimum=4, held=3) == 4


class StubVllm:
    """A vLLM child for the vLLM front's restart: dies when told, comes back when let."""

    url = "http://vllm.stub"

    def __init__(self) -> None:
        self.up, self.restarts = True, 0
        self.let_up = threading.Event()

    def alive(self) -> bool:
        return self.up

    async def answers(self, http: Any, timeout: float) -> bool:
        return True

    def stop(self) -> None:
        self.up = False

    def spawn(self) -> None:
        self.up = True

    def wait_healthy(self) -> None:
        assert self.let_up.wait(timeout=60)


def test_a_weight_load_during_a_vllm_restart_waits_for_the_new_vllm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A load arriving while the front restarts vLLM used to take the swap lock and wait for the
    restart, while the restart waited for the lock to load the old weights back: both hung."""
    import asyncio
    import logging

    import httpx

    from rl.inference.vllm import front as vllm_backend

    # Loaded as it stands: no private copy of a version that was never published.
    monkeypatch.setattr(vllm_backend.VllmFrontend, "_private_copy", lambda self, path, *_: path)
    rpcs: list[str] = []

    def vllm_routes(request: httpx.Request) -> httpx.Response:
        rpcs.append(request.url.path)
        return httpx.Response(200, json={"results": []})

    vllm = StubVllm()
    front = vllm_backend.VllmFrontend(vllm, None, "tiny", logging.getLogger("test"))  # type: ignore[arg-type]
    front.http = httpx.AsyncClient(transport=httpx.MockTransport(vllm_routes))
    front.weights, front.version = (tmp_path / "step_0", 0), 0
    front.ready.set()

    async def scenario() -> dict[str, Any]:
        watch = asyncio.create_task(front.watch(hung_s=60))
        vllm.up = False  # vLLM dies
        while front.ready.is_set():  # the watch has begun restarting it
            await asyncio.sleep(0.05)
        load = asyncio.create_task(front.load_weights(tmp_path / "step_1", 1))
        await asyncio.sleep(0.5)  # the load is waiting
        vllm.let_up.set()
        try:
            return await asyncio.wait_for(load, timeout=60)
        finally:
            watch.cancel()

    assert asyncio.run(scenario())["policy_version"] == 1
    assert front.weights == (tmp_path / "step_1", 1)
    # The restart put the old weights back first, then the load swapped in the new ones.
    assert rpcs.count("/collective_rpc") == 2


def test_a_lost_node_restarts_its_replica_even_under_a_hung_load(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A replica spanning nodes that loses a node: vLLM's pause then waits for the lost
    engines. The head's restart used to wait for that load (which held the swap lock) until the
    request timed out, ten minutes in CI; it stops vLLM first, and the load goes to the new one."""
    import asyncio
    import logging

    import httpx

    from rl.inference.vllm import front as vllm_backend

    # Loaded as it stands: no private copy of a version that was never published.
    monkeypatch.setattr(vllm_backend.VllmFrontend, "_private_copy", lambda self, path, *_: path)
    vllm = StubVllm()
    vllm.let_up.set()
    paused = threading.Event()

    async def vllm_routes(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/pause" and not paused.is_set():
            paused.set()
            while vllm.up:  # the pause waits for the lost node's engines until vLLM stops
                await asyncio.sleep(0.05)
            raise httpx.ConnectError("vLLM stopped")
        return httpx.Response(200, json={"results": []})

    class Replica:
        reason: str | None = None
        dir = tmp_path  # where the replica's nodes all read (a private copy's place)

        def lost(self) -> str | None:
            return self.reason

        def new_generation(self) -> None:
            self.reason = None

        def healthy(self) -> None:
            pass

    replica = Replica()
    front = vllm_backend.VllmFrontend(
        vllm, None, "tiny", logging.getLogger("test"), replica=replica
    )  # type: ignore[arg-type]
    front.http = httpx.AsyncClient(transport=httpx.MockTransport(vllm_routes))
    front.ready.set()

    async def scenario() -> dict[str, Any]:
        watch = asyncio.create_task(front.watch(hung_s=60))
        load = asyncio.create_task(front.load_weights(tmp_path / "step_1", 1))
        while not paused.is_set():
            await asyncio.sleep(0.05)
        replica.reason = "node 1 of the replica has been silent"
        try:
            return await asyncio.wait_for(load, timeout=60)
        finally:
            watch.cancel()

    assert asyncio.run(scenario())["policy_version"] == 1
    assert vllm.restarts == 1 and front.weights == (tmp_path / "step_1", 1)
