"""The inference role with backend `vllm`: a real vLLM OpenAI server behind Relay's routes.

The role starts vLLM's server (arguments from the plan) on a private port and serves the same
HTTP contract as the embedded engine in front of it, so the orchestrator has one client:
- the OpenAI routes (rl/inference/openai_api.py, shared with the embedded engine: chat
  templates, tool calls, streaming, errors) send every request on to vLLM's /v1/completions as token
  ids with `return_token_ids`, and answer with the policy version(s) that served it;
- /admin/load_weights swaps weights in place: vLLM pauses (keeping in-flight requests), reloads
  `weights/step_N` through its worker's `reload_weights`, drops its prefix cache (built with the
  old weights) and resumes. Requests in flight finish on the new weights;
- /admin/weights/broadcast (rl/weights/routes.py) takes weights from the trainer's broadcast
  with the same pause, reload, drop, resume sequence: each vLLM worker joins the weight group and
  streams the tensors into the same in-place reload (rl/weights/sync.py's worker extension,
  which the plan adds with `--worker-extension-cls`; vLLM shards and quantises them itself);
- if vLLM dies it is restarted, at most `MAX_RESTARTS` times, with the last weights it loaded
  from disk (a broadcast group does not survive it: the trainer's next update forms a new one);
- a request whose client goes away is aborted in vLLM's engine (its `/abort_requests`, by the
  request id this front gives it), not left to decode for nobody;
- /admin/sleep and /admin/wake_up are vLLM's sleep mode (GPU only); /health says whether it is
  asleep, completions are refused meanwhile, and a weight load wakes it first.
vLLM's admin routes need `VLLM_SERVER_DEV_MODE=1`; they are reachable only on loopback here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from rl.core.auth import scoped_guard
from rl.core.config import RunConfig
from rl.core.derive import max_model_len
from rl.core.lora import is_adapter_dir
from rl.core.model import ensure_checkpoint, load_tokenizer
from rl.core.paths import ROOT
from rl.core.rundir import RunDir, write_atomic
from rl.core.runtime import die_with_parent, listen_socket, on_node, server_host, write_address
from rl.inference.admin import LoadWeightsRequest, add_admin_routes, requested_weights
from rl.inference.client import sampled
from rl.inference.generation import Sample
from rl.inference.openai_api import APIError, Deltas, Params, Result, add_openai_routes
from rl.weights.published import (
    RefusedWeights,
    check_checkpoint,
    private_copy,
)
from rl.weights.routes import add_routes
from rl.weights.sync import WeightGroupSpec

HOST = "127.0.0.1"
MAX_RESTARTS = 3
START_TIMEOUT_S = 600.0
# A node of a replica spanning nodes whose file has not been touched this long is gone.
NODE_STALE_S = 30.0
# vLLM serves a LoRA run's own policy adapter as <model name> + this (the base keeps the name).
POLICY_ADAPTER = "-policy"


class SpanningReplica:
    """How the processes of one replica spanning nodes (a vLLM head and a headless process on
    each other node) start together and go down together, through the run directory they all
    see. The head is the authority:

    - before each start of its vLLM the head writes a new generation (`head`);
    - each other node starts its headless vLLM only into the newest generation, and starts it
      again whenever the generation changes (the head's new vLLM waits for them all);
    - each other node writes `node<N>` (its generation and a token per start of its vLLM) and
      touches it every second;
    - the head starts its vLLM again (a new generation) when a node's file goes stale (the
      node or its process is gone) or shows a new start in the current generation (that
      node's vLLM died and came back alone, outside the head's data-parallel group).
    """

    def __init__(self, run_dir: Path, instance: str, nodes: int) -> None:
        self.dir = RunDir(run_dir).replica_nodes(instance)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.nodes = nodes
        self.joined: dict[int, str] = {}  # each node's start token when the head was healthy

    def _read(self, name: str) -> str | None:
        try:
            return (self.dir / name).read_text()
        except FileNotFoundError:
            return None

    def generation(self) -> str | None:
        return self._read("head")

    def new_generation(self) -> str:
        generation = f"{os.getpid()}-{time.time_ns()}"
        write_atomic(self.dir / "head", generation)
        self.joined = {}
        return generation

    def started(self, node: int, generation: str) -> None:
        write_atomic(self.dir / f"node{node}", f"{generation} {os.getpid()}-{time.time_ns()}")

    def beat(self, node: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.dir / f"node{node}")

    def _node(self, node: int) -> tuple[str, str, float] | None:
        path = self.dir / f"node{node}"
        try:
            generation, token = path.read_text().split()
            return generation, token, path.stat().st_mtime
        except (FileNotFoundError, ValueError):
            return None

    def healthy(self) -> None:
        """The head's vLLM answers: every node has joined this generation; note their starts."""
        for node in range(1, self.nodes):
            if (seen := self._node(node)) is not None:
                self.joined[node] = seen[1]

    def lost(self) -> str | None:
        """Why the head must start its replica again, or None."""
        generation = self.generation()
        for node in range(1, self.nodes):
            seen = self._node(node)
            if seen is None or node not in self.joined:
                continue
            if time.time() - seen[2] > NODE_STALE_S:
                return f"node {node} of the replica has been silent for {NODE_STALE_S:.0f} s"
            if seen[0] == generation and seen[1] != self.joined[node]:
                return f"node {node} of the replica started its vLLM again"
        return None


class VllmProcess:
    """One vLLM server child in its own process group, restarted when it dies. `headless`: a
    secondary node's engines of a replica spanning nodes (`vllm serve --headless`, no HTTP)."""

    def __init__(
        self,
        python: str,
        args: list[str],
        log_path: Path,
        logger: logging.Logger,
        headless: bool = False,
    ):
        self.python, self.args, self.log_path, self.logger = python, args, log_path, logger
        self.headless = headless
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        """Start vLLM and wait until it is healthy."""
        self.spawn()
        self.wait_healthy()

    def spawn(self) -> None:
        """Start vLLM's server without waiting for it. Call it from the main thread: the
        parent-death signal fires when the forking thread exits."""
        with listen_socket(HOST, 0) as probe:  # a free port for vLLM's private server
            self.port = probe.getsockname()[1]
        # Relay's source on the path: vLLM's workers import rl.weights.sync from their own env.
        source = str(ROOT)
        path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
        # Runtime LoRA loading (/v1/load_lora_adapter) is off unless asked for.
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": path,
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}  # fmt: skip
        if self.headless:  # `vllm serve --headless`, which vLLM's own server module lacks
            argv = [self.python, "-m", "rl.inference.vllm.serve", *self.args]
        else:
            argv = [self.python, "-m", "vllm.entrypoints.openai.api_server", *self.args]
            argv += ["--host", HOST, "--port", str(self.port)]
        with open(self.log_path, "ab") as log:
            # Its own process group (vLLM's engine and workers join it), so it can be stopped
            # as a unit; and SIGTERM when this role dies, so a killed role leaves no vLLM behind.
            self.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_terminate_with_parent,
            )
        self.logger.info("started vLLM (pid %d): %s", self.proc.pid, " ".join(argv))

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        t0 = time.monotonic()
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with code {self.proc.returncode}; see {self.log_path}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.logger.info("vLLM healthy after %.1f s", time.monotonic() - t0)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM not healthy within {START_TIMEOUT_S:.0f} s; see {self.log_path}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def answers(self, client: httpx.AsyncClient, timeout: float) -> bool:
        """Whether vLLM's /health answers 200 within `timeout` (a stopped or wedged vLLM
        is alive but does not)."""
        try:
            response = await client.get(f"{self.url}/health", timeout=timeout)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def stop(self) -> None:
        """End vLLM's whole process group at once (server, engine core, workers)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def _terminate_with_parent() -> None:
    """In the child before exec: ask Linux to SIGTERM it when its parent thread exits."""
    die_with_parent(signal.SIGTERM)


class VllmFrontend:
    """Relay's inference contract over one supervised vLLM server."""

    def __init__(
        self,
        vllm: VllmProcess,
        tokenizer: Any,
        model_name: str,
        logger: logging.Logger,
        shared: bool = False,
        replica: SpanningReplica | None = None,
    ):
        self.vllm, self.tokenizer, self.model_name, self.logger = (
            vllm,
            tokenizer,
            model_name,
            logger,
        )
        self.shared = shared  # a sweep's shared inference: one base, each point's adapter
        self.replica = replica  # the other nodes of a replica spanning nodes
        # Sweep points served by the base alone (their version 0) until their first adapter.
        self.base_points: dict[str, int] = {}
        self.version = -1
        self.weights: tuple[Path, int] | None = None  # last loaded from disk, and its version
        # Private copies of what vLLM loaded from disk (`_private_copy`), removed at exit: on
        # this node, or for a replica spanning nodes, where all its workers read (the run
        # directory's shared filesystem).
        where = replica.dir if replica else None
        self.private = Path(tempfile.mkdtemp(prefix="relay-vllm-weights-", dir=where))
        self.copies = 0
        # LoRA adapters vLLM serves, by the name requests ask for (the run's own policy under
        # the model's name): their directory and version, to load again after a restart.
        self.adapters: dict[str, tuple[Path, int]] = {}
        self.weight_group: str | None = None  # the broadcast group vLLM's workers are in
        self.receivers: int | None = None
        self.ready = asyncio.Event()
        self.swap = asyncio.Lock()
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(600.0))
        self.asleep = False  # vLLM's sleep mode: weights offloaded, KV cache dropped
        self.aborting: set[asyncio.Task] = set()  # aborts of requests whose client went away
        self.in_flight = 0  # requests sent on to vLLM, not yet answered (/health)
        self.dropped = 0  # requests aborted in vLLM because their client went away (/health)

    def held(self, name: str = "") -> int:
        """The version served under `name` ("": the run's own policy)."""
        if name and name != self.model_name:
            if name in self.adapters:
                return self.adapters[name][1]
            return self.base_points.get(name, -1)
        return self.version

    def vllm_model(self, name: str = "") -> str:
        """What vLLM serves `name` as: the base model, or the LoRA adapter loaded for it (the
        run's policy has one named apart from the base)."""
        name = name or self.model_name
        if name in self.adapters:
            return self._lora_name(name)
        return self.model_name if name in self.base_points else name

    def _lora_name(self, name: str) -> str:
        """The name vLLM holds `name`'s adapter under (the policy's apart from the base)."""
        return name + POLICY_ADAPTER if name == self.model_name else name

    async def complete(self, body: dict[str, Any], name: str = "") -> dict[str, Any]:
        """vLLM's completions answer to `body` (token-id prompts), with the policy versions that
        served it; a vLLM that dies under the request is waited for and asked again. Cancelled
        (its client went away), the request is aborted in vLLM."""
        request_id = f"relay-{uuid.uuid4().hex}"
        for attempt in range(MAX_RESTARTS + 1):
            await self.ready.wait()
            before = self.held(name)
            self.in_flight += 1
            try:
                response = await self.http.post(
                    f"{self.vllm.url}/v1/completions",
                    json=body,
                    headers={"X-Request-Id": request_id},
                )
                break
            except httpx.TransportError:  # vLLM died under the request: wait for the restart
                if attempt == MAX_RESTARTS:
                    raise
                await asyncio.sleep(2.0)
            except asyncio.CancelledError:
                self.abort(request_id, len(body["prompt"]))
                raise
            finally:
                self.in_flight -= 1
        if response.status_code != 200:
            raise APIError(response.status_code, f"vLLM: {response.text[:1000]}")
        result = response.json()
        result["policy_version"], result["policy_version_max"] = before, self.held(name)
        return result

    async def complete_stream(
        self, body: dict[str, Any], name: str = ""
    ) -> AsyncIterator[dict[str, Any]]:
        """vLLM's streamed completions chunks for `body`, then one `{"policy_version": ...}`."""
        await self.ready.wait()
        before = self.held(name)
        request_id, done = f"relay-{uuid.uuid4().hex}", False
        self.in_flight += 1
        try:
            async with self.http.stream(
                "POST",
                f"{self.vllm.url}/v1/completions",
                json={**body, "stream": True},
                headers={"X-Request-Id": request_id},
            ) as response:
                if response.status_code != 200:
                    text = (await response.aread())[:1000]
                    raise APIError(response.status_code, f"vLLM: {text!r}")
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        yield json.loads(line[len("data: ") :])
            done = True
        finally:  # left early: the client went away (the response stops iterating)
            self.in_flight -= 1
            if not done:
                self.abort(request_id, len(body["prompt"]))
        yield {"policy_version": before, "policy_version_max": self.held(name)}

    def abort(self, request_id: str, prompts: int) -> None:
        """Abort in vLLM's engine the request sent as `request_id` with `prompts` prompts (vLLM
        runs prompt i as cmpl-<request id>-i), on a task of its own: the caller is being
        cancelled. vLLM aborts a request whose connection closes, too, once it notices."""
        ids = [f"cmpl-{request_id}-{i}" for i in range(prompts)]
        if not ids:  # vLLM takes no ids as "abort every request"
            return
        task = asyncio.get_running_loop().create_task(self._abort(ids))
        self.aborting.add(task)
        task.add_done_callback(self.aborting.discard)

    async def _abort(self, ids: list[str]) -> None:
        try:
            response = await self.http.post(
                f"{self.vllm.url}/abort_requests", json={"request_ids": ids}, timeout=30.0
            )
            response.raise_for_status()
        except httpx.HTTPError as exc:  # a restarted vLLM holds none of them anyway
            self.logger.warning("could not abort %s in vLLM: %r", ids[0], exc)
            return
        self.dropped += 1
        self.logger.info("aborted %s in vLLM: its client went away", ids[0].rsplit("-", 1)[0])

    async def sleep(self) -> dict[str, Any]:
        """vLLM's sleep mode, level 1: weights offloaded to host memory, KV cache dropped
        (needs --enable-sleep-mode, which colocated placement passes)."""
        async with self.swap:
            await self._admin("/sleep", params={"level": "1"})
            self.asleep = True
        return {"asleep": True}

    async def wake(self) -> dict[str, Any]:
        async with self.swap:
            await self._wake()
        return {"asleep": False}

    async def _wake(self) -> None:
        await self._admin("/wake_up")
        self.asleep = False

    async def load_weights(self, path: Path, version: int, name: str = "") -> dict[str, Any]:
        """Load published `path` as `version` once it is checked (every tensor readable and
        finite): vLLM reloads in place, so a refusal must come before it starts. A LoRA adapter is
        loaded into vLLM at runtime under `name` ("": the run's policy), replacing the one
        there; full weights replace the base (and the policy serves the base until its next
        adapter)."""
        for attempt in range(MAX_RESTARTS + 1):
            try:
                return await self._load_weights(path, version, name or self.model_name)
            except httpx.HTTPError:
                # vLLM was stopped under the load for a restart: load again into the new one
                # (which first gets back what it held). Any other failure is the load's own.
                if self.ready.is_set() or attempt == MAX_RESTARTS:
                    raise
                self.logger.warning("vLLM restarted during the load of version %d", version)
        raise AssertionError("unreachable")

    async def _load_weights(self, path: Path, version: int, name: str) -> dict[str, Any]:
        await self.ready.wait()  # a restart holds the lock until vLLM is back
        async with self.swap:
            try:
                copy = await asyncio.to_thread(self._private_copy, path, version, name)
                return await self._load_copy(copy, version, name)
            finally:
                self._drop_copies()

    def _drop_copies(self) -> None:
        """Remove the private copies nothing is served from (any more)."""
        served = {path for path, _ in self.adapters.values()}
        served |= {self.weights[0]} if self.weights else set()
        for copy in self.private.iterdir():
            if copy not in served:
                shutil.rmtree(copy, ignore_errors=True)

    def _private_copy(self, path: Path, version: int, name: str) -> Path:
        """A checked copy of published `path` that only this server reads (vLLM reads the
        files itself, after the check: a file rewritten in between would be loaded, or kill
        vLLM's memory map with SIGBUS), kept while it is served, to load again after a
        restart."""
        self.copies += 1
        into = self.private / f"{self.copies}-{name}-step_{version}"
        copy = private_copy(path, into)
        check_checkpoint(copy)
        return copy

    async def _load_copy(self, path: Path, version: int, name: str) -> dict[str, Any]:
        if self.asleep:  # a load wakes the server, as the embedded engine's does
            await self._wake()
        if is_adapter_dir(path):
            return await self._load_adapter(path, version, name)
        if self.shared and version == 0 and name != self.model_name:
            # A sweep point's version 0 is the base vLLM holds (the sweep starts every
            # point from it): the point is served, its adapter to come.
            self.base_points[name] = version
            return {"policy_version": version, "load_s": 0.0}
        if name != self.model_name:
            raise RefusedWeights(f"{path} holds full weights, not an adapter for {name!r}")
        result = await self._swap_weights(path, version)
        self.adapters.pop(name, None)
        return result

    async def _load_adapter(self, path: Path, version: int, name: str) -> dict[str, Any]:
        """vLLM's runtime LoRA loading, in place of the adapter under the same name (requests
        in flight finish on the one they started with)."""
        t0 = time.monotonic()
        body = {"lora_name": self._lora_name(name), "lora_path": str(path), "load_inplace": True}
        response = await self.http.post(f"{self.vllm.url}/v1/load_lora_adapter", json=body)
        if response.status_code != 200:
            raise RefusedWeights(f"vLLM refused the adapter {path}: {response.text[:500]}")
        self.adapters[name] = (path, version)
        if name == self.model_name:
            self.version = version
        seconds = time.monotonic() - t0
        named = "" if name == self.model_name else f" as {name}"
        self.logger.info("loaded version %d from %s%s in %.3f s", version, path, named, seconds)
        return {"policy_version": version, "load_s": seconds}

    async def _swap_weights(self, path: Path, version: int) -> dict[str, Any]:
        """Pause (keeping in-flight requests), reload, drop stale prefix cache, resume."""
        t0 = time.monotonic()
        async with self._paused():
            await self._rpc("reload_from", weights_path=str(path))
        self.version, self.weights = version, (path, version)
        seconds = time.monotonic() - t0
        self.logger.info("loaded version %d from %s in %.3f s", version, path, seconds)
        return {"policy_version": version, "load_s": seconds}

    async def weight_receivers(self) -> int:
        """vLLM's workers, each of which takes the whole broadcast (one per collective_rpc
        answer)."""
        if self.receivers is None:
            await self.ready.wait()
            self.receivers = len(await self._rpc("relay_weight_receiver"))
        return self.receivers

    async def receive_broadcast(self, spec: WeightGroupSpec, member: str, version: int) -> None:
        """Pause, join the group (when new), stream the update into vLLM, drop the prefix
        cache, resume: the filesystem swap's sequence, with the weights from the trainer."""
        await self.ready.wait()  # a restart holds the lock until vLLM is back
        async with self.swap:
            t0 = time.monotonic()
            async with self._paused():
                if self.weight_group != spec.group:
                    self.weight_group = None
                    # No time limit here: the weight group's own timeout bounds both calls.
                    await self._rpc("init_weight_group", None, spec=spec.to_json(), member=member)
                    self.weight_group = spec.group
                results = await self._rpc("receive_weights", None)
            got = {r["version"] for r in results}
            if got != {version}:
                raise RuntimeError(f"vLLM's workers received versions {got}, not {version}")
            self.version = version
        mb = results[0]["bytes"] / 1e6
        seconds = time.monotonic() - t0
        self.logger.info(
            "received version %d by broadcast (%.1f MB) in %.3f s", version, mb, seconds
        )

    @contextlib.asynccontextmanager
    async def _paused(self) -> Any:
        await self._admin("/pause", params={"mode": "keep"})
        try:
            yield
            await self._admin("/reset_prefix_cache", params={"reset_running_requests": "true"})
        finally:
            await self._admin("/resume")

    async def _rpc(self, method: str, timeout: float | None = 600.0, **kwargs: str) -> list[Any]:
        """Call `method` on every vLLM worker (collective_rpc); their answers, in order."""
        body = {"method": method, "kwargs": kwargs}
        url = f"{self.vllm.url}/collective_rpc"
        response = await self.http.post(url, json=body, timeout=timeout)
        if response.status_code != 200:
            raise RuntimeError(
                f"vLLM collective_rpc {method}: {response.status_code} {response.text}"
            )
        return response.json()["results"] if response.content else []

    async def _admin(self, route: str, **kwargs: Any) -> None:
        response = await self.http.post(f"{self.vllm.url}{route}", **kwargs)
        response.raise_for_status()

    async def watch(self, hung_s: float) -> None:
        """Restart vLLM when it dies or stops answering /health for `hung_s` (bounded),
        reloading the weights it last held. The wait for the new vLLM runs off the event
        loop: Relay's /health keeps answering ("starting") meanwhile."""
        silent_since: float | None = None
        while True:
            await asyncio.sleep(1.0)
            if self.vllm.alive() and self.ready.is_set():
                lost = self.replica.lost() if self.replica else None
                if lost:
                    self.logger.warning("%s: starting the replica again", lost)
                elif await self.vllm.answers(self.http, timeout=max(1.0, hung_s / 4)):
                    silent_since = None
                    continue
                else:
                    silent_since = silent_since or time.monotonic()
                    if time.monotonic() - silent_since < hung_s:
                        continue
                    self.logger.warning("vLLM has not answered /health for %.0f s", hung_s)
            elif self.vllm.alive():
                continue
            silent_since = None
            if self.vllm.restarts >= MAX_RESTARTS:
                self.ready.clear()
                self.logger.error("vLLM failed %d times; giving up", self.vllm.restarts + 1)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            # vLLM stops first: a call in flight on it (a load whose pause waits for a lost
            # node's engines) fails now instead of holding the swap lock. Under the lock, the
            # next load waits for the new vLLM (loads wait for `ready` before taking it).
            self.ready.clear()
            self.vllm.stop()
            async with self.swap:
                if not await self._restart():
                    return
            self.ready.set()

    async def _restart(self) -> bool:
        """Start vLLM again on the weights it last held; False (and the role ending, for the
        launcher to restart) if it does not come back."""
        self.ready.clear()
        self.vllm.restarts += 1
        self.logger.warning("restarting vLLM (%d of %d)", self.vllm.restarts, MAX_RESTARTS)
        # Spawned from this (main) thread: the parent-death signal fires when the forking
        # thread exits. Requests wait on `ready` meanwhile.
        self.vllm.stop()
        if self.replica:  # the other nodes start theirs again into the new generation
            self.replica.new_generation()
        self.vllm.spawn()
        try:
            await asyncio.to_thread(self.vllm.wait_healthy)
        except (RuntimeError, TimeoutError):  # end the role: the launcher restarts it
            self.logger.exception("vLLM did not come back")
            os.kill(os.getpid(), signal.SIGTERM)
            return False
        if self.replica:
            self.replica.healthy()
        self.weight_group, self.version = None, -1  # a new vLLM: base weights, no group
        self.asleep = False  # and awake
        if self.weights is not None:  # back to what it held before
            await self._swap_weights(*self.weights)
        for served, (path, version) in list(self.adapters.items()):
            await self._load_adapter(path, version, served)
        return True


class VllmBackend:
    """The vLLM front as the OpenAI routes' backend (rl/inference/openai_api.py): each request
    goes to vLLM's completions endpoint as token ids, asking for the token ids and logprobs back
    (ids, not strings, for the alternatives too), so both backends answer from the same tokens."""

    def __init__(
        self, front: VllmFrontend, max_len: int, vocab_size: int, rows_per_key: int | None
    ) -> None:
        self.front, self.max_len, self.vocab_size = front, max_len, vocab_size
        self.model_name, self.tokenizer = front.model_name, front.tokenizer
        self.max_rows = None  # vLLM schedules any number itself
        self.rows_per_key = rows_per_key  # inference.api_rows_per_key

    def served(self) -> list[str]:
        named = sorted({*self.front.adapters, *self.front.base_points} - {self.model_name})
        return [self.model_name, *named]

    @property
    def asleep(self) -> bool:
        return self.front.asleep

    def body(self, prompts: list[list[int]], params: Params) -> dict[str, Any]:
        limits = params.limits
        handover = {} if params.kv_transfer is None else {"kv_transfer_params": params.kv_transfer}
        return {
            **handover,
            "model": self.front.vllm_model(params.model),
            "prompt": prompts,
            "n": params.n,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": limits.top_p,
            "seed": params.seed,
            "stop": list(limits.stop),
            "logprobs": max(1, limits.top_logprobs),
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }

    async def generate(self, prompts: list[list[int]], params: Params) -> Result:
        if params.seeds is not None and len(prompts) > 1:  # vLLM seeds a request: one each
            parts = await asyncio.gather(
                *(
                    self.generate([prompt], replace(params, seed=seed, seeds=None))
                    for prompt, seed in zip(prompts, params.seeds, strict=True)
                )
            )
            low, high = min(p.version for p in parts), max(p.version_max for p in parts)
            return Result(low, high, [s for part in parts for s in part.samples])
        if params.seeds is not None:
            params = replace(params, seed=params.seeds[0], seeds=None)
        result = await self.front.complete(self.body(prompts, params), params.model)
        top = params.limits.top_logprobs
        choices = sorted(result["choices"], key=lambda c: c["index"])
        samples = [_sample(*sampled(c), c.get("finish_reason"), top) for c in choices]
        versions = result["policy_version"], result["policy_version_max"]
        return Result(*versions, samples, result.get("kv_transfer_params"))

    async def stream(
        self, prompts: list[list[int]], params: Params
    ) -> AsyncIterator[Deltas | Result]:
        if params.seeds is not None and len(prompts) > 1:
            raise APIError(400, "seeds: a streamed request takes one prompt", "seeds")
        if params.seeds is not None:
            params = replace(params, seed=params.seeds[0], seeds=None)
        parts = [_Part() for _ in range(len(prompts) * params.n)]
        body = self.body(prompts, params)
        async for chunk in self.front.complete_stream(body, params.model):
            if "policy_version" in chunk and "choices" not in chunk:
                top = params.limits.top_logprobs
                samples = [_sample(p.ids, p.logprobs, p.tops, p.finish, top) for p in parts]
                yield Result(chunk["policy_version"], chunk["policy_version_max"], samples)
                return
            deltas = []
            for choice in chunk.get("choices", []):
                part = parts[choice["index"]]
                ids, logprobs, tops = sampled(choice)
                part.ids += ids
                part.logprobs += logprobs
                part.tops += tops
                part.finish = choice.get("finish_reason") or part.finish
                if ids:
                    deltas.append((choice["index"], ids))
            if deltas:
                yield deltas


@dataclass
class _Part:
    """One streamed choice as its chunks arrive."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[dict[str, float]] = field(default_factory=list)
    finish: str | None = None


def _sample(
    ids: list[int], logprobs: list[float], tops: list[dict], finish: str | None, top: int
) -> Sample:
    """One vLLM choice as the engine's Sample (alternatives' "token_id:N" keys read as ids)."""
    alternatives = None
    if top:
        alternatives = [
            sorted(((int(k.split(":", 1)[1]), v) for k, v in step.items()), key=lambda a: -a[1])[
                :top
            ]
            for step in tops
        ]
    return Sample(list(ids), list(logprobs), finish or "length", alternatives)


class VllmAdmin:
    """The admin routes' answers (rl/inference/admin.py) for the vLLM front."""

    def __init__(self, front: VllmFrontend, run_dir: Path | None, receiving: dict) -> None:
        self.front, self.run_dir, self.receiving = front, run_dir, receiving

    async def health(self) -> tuple[int, dict[str, Any]]:
        front = self.front
        if not front.ready.is_set():
            return 503, {"status": "starting", "detail": "vLLM is restarting"}
        return 200, {
            "status": "ok",
            "policy_version": front.version,
            "backend": "vllm",
            "receiving": self.receiving["version"],
            "asleep": front.asleep,  # up, but serving no completions until woken
            "requests_in_flight": front.in_flight,  # sent on to vLLM, not yet answered
            "requests_dropped": front.dropped,  # aborted in vLLM: their clients went away
        }

    async def served_version(self, model: str) -> dict[str, Any]:
        return {"policy_version": self.front.held(model)}

    async def load_weights(self, request: LoadWeightsRequest) -> dict[str, Any]:
        # only a version this run published, as the embedded engine (rl/weights/published.py)
        path = await requested_weights(self.run_dir, self.front.shared, request)
        return await self.front.load_weights(path, request.version, request.adapter or "")

    async def sleep(self) -> dict[str, Any]:
        return await self.front.sleep()

    async def wake_up(self) -> dict[str, Any]:
        return await self.front.wake()


def build_app(
    front: VllmFrontend, keys: Any, run_dir: Path | None = None, openai: Any = None
) -> FastAPI:
    """Relay's routes in front of vLLM; the OpenAI ones over `openai` (a VllmBackend). Each
    route needs its scope's key of `keys` (a mapping, or the run's token: rl/core/auth.py)."""
    authorized = scoped_guard(keys)

    app = FastAPI(title="relay-inference (vllm)")
    receiving = add_routes(app, authorized, front, front.logger, run_dir)
    if openai is not None:
        add_openai_routes(app, openai, authorized)

    add_admin_routes(app, authorized, VllmAdmin(front, run_dir, receiving))
    return app


def _served_args(cfg: RunConfig, vllm_args: list[str]) -> tuple[Path, list[str]]:
    """The model's checkpoint here, and the plan's vLLM arguments serving it."""
    checkpoint = ensure_checkpoint(cfg.model)
    args = list(vllm_args)
    if cfg.model.source == "random" and "--model" in args:
        args[args.index("--model") + 1] = str(checkpoint)  # the locally built model
    return checkpoint, args


def serve_headless(
    cfg: RunConfig, run_dir: Path, instance: str, node: int, nodes: int, vllm_args: list[str],
    logger: logging.Logger,
) -> None:  # fmt: skip
    """Node `node` of a replica spanning nodes: its share of the replica's engines, with no
    HTTP of its own, started into each generation of the head (SpanningReplica); ends the
    role after `MAX_RESTARTS` deaths of its own, for the launcher to restart."""
    _, args = _served_args(cfg, vllm_args)
    python = cfg.inference.vllm_python or sys.executable
    RunDir(run_dir).logs.mkdir(parents=True, exist_ok=True)
    log = RunDir(run_dir).log(f"{on_node(instance, node)}-vllm")
    vllm = VllmProcess(python, args, log, logger, headless=True)
    replica = SpanningReplica(run_dir, instance, nodes)
    deaths = 0
    while True:
        while (generation := replica.generation()) is None:
            time.sleep(1.0)  # the head has not started yet
        vllm.spawn()
        replica.started(node, generation)
        logger.info("node %d joined generation %s of %s", node, generation, instance)
        while vllm.alive() and replica.generation() == generation:
            replica.beat(node)
            time.sleep(1.0)
        if not vllm.alive():
            deaths += 1
            logger.warning("vLLM on node %d exited with %s", node, vllm.proc and vllm.proc.poll())
            if deaths > MAX_RESTARTS:
                sys.exit(f"vLLM on node {node} of {instance} failed {deaths} times; see {log}")
        else:
            logger.info("the head of %s started again: joining its new generation", instance)
        vllm.stop()


def serve(
    cfg: RunConfig,
    run_dir: Path,
    name: str,
    vllm_args: list[str],
    logger: logging.Logger,
    nodes: int = 1,
) -> None:
    """Start vLLM with the plan's arguments and serve Relay's routes in front of it; the head
    of a replica spanning `nodes` watches the others (SpanningReplica)."""
    import uvicorn

    checkpoint, args = _served_args(cfg, vllm_args)
    python = cfg.inference.vllm_python or sys.executable
    logs = RunDir(run_dir).logs
    logs.mkdir(parents=True, exist_ok=True)
    vllm = VllmProcess(python, args, RunDir(run_dir).log(f"{name}-vllm"), logger)
    replica = SpanningReplica(run_dir, name, nodes) if nodes > 1 else None
    if replica:
        replica.new_generation()
    vllm.start()
    if replica:
        replica.healthy()
    front = VllmFrontend(
        vllm, load_tokenizer(checkpoint), cfg.model.name, logger, cfg.inference.shared, replica
    )
    front.ready.set()
    from rl.core.runtime import run_keys

    openai = VllmBackend(
        front, max_model_len(cfg), cfg.model.vocab_size, cfg.inference.api_rows_per_key
    )
    app = build_app(front, run_keys(run_dir), run_dir, openai)
    sock = listen_socket(server_host(), cfg.inference.port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        watch = asyncio.get_running_loop().create_task(front.watch(cfg.timeouts.hung_s))
        write_address(run_dir, name, server_host(), port)
        logger.info("listening on http://%s:%d (vLLM on port %d)", server_host(), port, vllm.port)
        yield
        watch.cancel()
        vllm.stop()

    app.router.lifespan_context = lifespan

    try:
        server.run(sockets=[sock])
    finally:
        vllm.stop()  # reached on errors; on SIGTERM the shutdown hook above has done it
        shutil.rmtree(front.private, ignore_errors=True)
