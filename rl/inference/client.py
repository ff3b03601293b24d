"""The inference servers' client: OpenAI completions plus Relay's admin routes, over one or
more servers, as the orchestrator, the agents' proxy and the weight transport call them.

Responses are read here, once: each choice becomes a `Completion` (rl/core/records.py) with its
exact token ids, logprobs and the policy versions behind it. The vLLM front reads vLLM's
answers with the same reader (`sampled`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from rl.core.auth import ScopedAuth, as_keys
from rl.core.config import TimeoutsConfig
from rl.core.records import Completion
from rl.core.rundir import RunDir
from rl.core.runtime import Peer, read_address
from rl.weights.base import RefusedVersion

PROMPT_SEEDS = "seeds"
"""Relay's extension of the completions request: a seed per prompt."""


def sampled(choice: dict[str, Any]) -> tuple[list[int], list[float], list[dict[str, float]]]:
    """A completions choice's token ids, their logprobs and, per token, the alternatives asked
    for (`top_logprobs`), as Relay's servers and vLLM write them (empty where absent)."""
    logprobs = choice.get("logprobs") or {}
    return (
        list(choice.get("token_ids") or []),
        list(logprobs.get("token_logprobs") or []),
        list(logprobs.get("top_logprobs") or []),
    )


def completions(response: dict[str, Any]) -> list[Completion]:
    """A completions response's choices, in order. A request in flight during a weight swap
    spans two versions (vLLM): `policy_version` and `policy_version_max`."""
    low = response["policy_version"]
    high = response.get("policy_version_max", low)
    found = []
    for choice in response["choices"]:
        ids, logprobs, _ = sampled(choice)
        found.append(
            Completion(
                list(choice["prompt_token_ids"]),
                ids,
                logprobs,
                choice["text"],
                choice.get("finish_reason") or "stop",
                low,
                high,
            )  # fmt: skip
        )
    return found


class InferenceClient:
    """OpenAI-compatible completions plus Relay's admin routes, for one or more servers.

    A server that stops answering is looked up again in the run directory; its requests go to
    the other servers meanwhile (or wait for it, when it is the only one), and once it answers
    again it is given the version the others hold before it serves rollouts.

    A point of a sweep that shares inference finds the servers in the sweep's service
    directory (`service`) and is served there as `adapter`: its requests name it, its weights
    are loaded under it, and a server's version is read for it.
    """

    def __init__(
        self,
        run_dir: Path,
        names: list[str],
        auth: ScopedAuth | str,
        model: str,
        timeouts: TimeoutsConfig | None = None,
        adapter: str = "",
        service: Path | None = None,
        exact: bool = False,
    ) -> None:
        self.run_dir, self.adapter = run_dir, adapter
        self.model = adapter or model
        self.addresses = service or run_dir
        timeouts = timeouts or TimeoutsConfig()
        self.peer_s = timeouts.peer_s
        self.servers = [Peer(self.addresses, name, self.peer_s) for name in names]
        if isinstance(auth, str):  # a run's token: every scope's keys
            auth = ScopedAuth(as_keys(auth))
        self.http = httpx.Client(auth=auth, timeout=timeouts.request_s)
        self.version = -1  # what every server should hold
        self.stale = [False] * len(names)  # missed a weight load while down
        self.locks = [threading.Lock() for _ in names]
        self.log = logging.getLogger("orchestrator")
        self.asleep = False  # colocated on GPU: put to sleep while the trainer runs
        self.exact = exact  # every answer must come from `version` (the fixed schedule)

    def sleep(self) -> None:
        """Free the servers' memory for the trainer (weights offloaded or freed, caches
        dropped); the next `load_weights` wakes them, on the weights it loads."""
        for i in range(len(self.servers)):
            self.call(i, "/admin/sleep", {})
        self.asleep = True

    def wake(self) -> None:
        for i in range(len(self.servers)):
            self.call(i, "/admin/wake_up", {})
        self.asleep = False

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    def _post(self, i: int, route: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post(f"{self.servers[i].url}{route}", json=body)
        if response.is_error:  # the server's own words say what it refused, and why
            raise httpx.HTTPStatusError(
                f"{self.servers[i].name} answered {response.status_code} to {route}: "
                f"{response.text[:500]}",
                request=response.request,
                response=response,
            )
        return response.json()

    def _revive(self, i: int) -> bool:
        """Whether server i answers with the current weights (after reloading them)."""
        server = self.servers[i]
        with self.locks[i]:
            server.url = read_address(self.addresses, server.name) or server.url
            try:
                held = self.http.get(
                    f"{server.url}/admin/version", params={"model": self.adapter}, timeout=5.0
                )
                held.raise_for_status()
                behind = held.json()["policy_version"] != self.version or self.stale[i]
                if behind and self.version >= 0:
                    path = RunDir(self.run_dir).weights_for(self.version)  # what the rest hold
                    self._post(i, "/admin/load_weights", self._load_body(path, self.version))
                    back = "%s is back: loaded version %d into it"
                    self.log.info(back, server.name, self.version)
                self.stale[i] = False
                return True
            except httpx.TransportError:
                return False
            except httpx.HTTPStatusError as err:
                if err.response.status_code != 400:
                    raise
                # Its copy of the version the others hold is refused now (changed on disk):
                # it serves what it has until the next version loads.
                self.stale[i] = True
                self.log.warning("%s is back but refused version %d: %s", server.name,
                                 self.version, err)  # fmt: skip
                return True

    def call(self, i: int, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to server i, or to another one while i is down; waits (bounded) when none
        answers."""
        order = [i, *(j for j in range(len(self.servers)) if j != i)]
        deadline = time.monotonic() + self.peer_s
        while True:
            for j in order:
                try:
                    return self._post(j, route, body)
                except httpx.TransportError as err:
                    self.log.warning("%s unreachable (%r)", self.servers[j].name, err)
                    if self._revive(j):
                        try:
                            return self._post(j, route, body)
                        except httpx.TransportError:
                            pass
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"orchestrator: no inference server answered for {self.peer_s:.0f} s "
                    "(timeouts.peer_s)"
                )
            time.sleep(1.0)

    def complete(
        self,
        i: int,
        prompts: list[Any],
        n: int,
        max_tokens: int,
        temperature: float,
        stop: list[str] | None = None,
        seeds: list[int] | None = None,
    ) -> list[Completion]:
        """`n` completions per prompt (texts or token-id lists), prompt-major, from server i
        (or another while it is down); `seeds`, one per prompt, make each prompt's samples a
        function of its seed."""
        body = {
            "model": self.model,
            "prompt": prompts,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "logprobs": 1,
        }
        if stop:
            body["stop"] = stop
        if seeds is not None:
            body[PROMPT_SEEDS] = seeds
        for _ in range(len(self.servers) + 1):
            done = completions(self.call(i, "/v1/completions", body))
            if not self.exact or self.version < 0 or self._on_version(done):
                return done
            self.log.warning(
                "%s answered with version %d, not %d: loading it again",
                self.servers[i].name, done[0].min_version, self.version,
            )  # fmt: skip
            self.stale[i] = True
            if self._revive(i) and self.stale[i]:  # it refused the version: as sampled, then
                return done
        raise RuntimeError(
            f"{self.servers[i].name} kept answering with another version than {self.version}"
        )

    def _on_version(self, done: list[Completion]) -> bool:
        """Whether every completion was sampled by the version the servers should hold."""
        return all(c.min_version == c.max_version == self.version for c in done)

    def complete_all(
        self,
        prompts: list[Any],
        n: int,
        max_tokens: int,
        temperature: float,
        seeds: list[int] | None = None,
    ) -> list[Completion]:
        """Completions for every prompt (texts or token-id lists; prompt-major): one request
        per server, each a contiguous part of the prompts, which the server decodes as one
        batch (so a batch holds the same prompts in every run)."""
        parts = split(len(prompts), len(self.servers))
        with ThreadPoolExecutor(len(parts)) as pool:
            futures = [
                pool.submit(
                    self.complete,
                    i,
                    prompts[lo:hi],
                    n,
                    max_tokens,
                    temperature,
                    None,
                    seeds[lo:hi] if seeds is not None else None,
                )  # fmt: skip
                for i, (lo, hi) in enumerate(parts)
            ]
            return [c for f in futures for c in f.result()]

    def load_weights(self, path: Path, version: int) -> None:
        """Load `path` into every server that answers; one that is down gets the newest
        weights when it is back. A sleeping server wakes on the weights it loads (without
        reading back first the version it slept with, which may be pruned by now).
        `RefusedVersion` when a server refuses the version (400: it keeps the one it held, as
        do the others)."""
        self.asleep = False
        held, self.version = self.version, version
        for i, server in enumerate(self.servers):
            with self.locks[i]:
                try:
                    self._post(i, "/admin/load_weights", self._load_body(path, version))
                except httpx.TransportError as err:
                    self.log.warning("%s missed version %d (%r)", server.name, version, err)
                    self.stale[i] = True
                except httpx.HTTPStatusError as err:
                    if err.response.status_code != 400:
                        raise
                    self.version = held
                    self.stale[:i] = [True] * i  # any that took it go back to `held`
                    raise RefusedVersion(str(err)) from None
        took = (self._revive(i) and not self.stale[i] for i in range(len(self.servers)))
        if all(self.stale) and not any(took):
            # No server took the weights: wait for one, so that batches keep their version.
            try:
                self.call(0, "/admin/load_weights", self._load_body(path, version))
            except httpx.HTTPStatusError as err:
                if err.response.status_code != 400:
                    raise
                self.version = held
                raise RefusedVersion(str(err)) from None
            self.stale[0] = False

    def _load_body(self, path: Path, version: int) -> dict[str, Any]:
        body: dict[str, Any] = {"path": str(path), "version": version}
        if self.adapter:
            body["adapter"] = self.adapter
        return body


def split(count: int, parts: int) -> list[tuple[int, int]]:
    """`count` items as at most `parts` contiguous (begin, end) ranges, as even as they go."""
    parts = max(1, min(parts, count))
    size, extra = divmod(count, parts)
    bounds, at = [], 0
    for k in range(parts):
        end = at + size + (k < extra)
        bounds.append((at, end))
        at = end
    return bounds
