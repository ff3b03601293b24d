"""Weight broadcast between the trainer and the inference servers (weight_transport=broadcast).

Trainer rank 0 drives every update (`InferenceBroadcaster.update`):
1. asks each server (found through the run directory) for its receivers (the embedded engine
   has one, a vLLM server one per worker) and the weight group it holds;
2. makes a fresh group for all of them when any holds none or another one (the first update,
   a restarted server);
3. asks each server to receive version N: the server answers at once and, in the background,
   pauses generation, joins the group if needed, takes the weights, resumes;
4. forms the group (a server whose receivers never arrive fails the update by name),
   broadcasts (rl/weights/sync.py), and waits until every server reports version N;
5. records N in `weights/BROADCAST`: the orchestrator generates batch N once the recorded
   version allows it, as it waits for `weights/step_N` with the filesystem transport.
Every wait is bounded by `inference.broadcast_timeout_s`. vLLM is sent the tensors in the
layout `save_pretrained` writes (its loader's input: MoE experts one tensor each), the embedded
engine the module's own. The servers' end is rl/weights/routes.py. A model served from a base
in the FP8 block format gets each version re-quantized into it (rl/core/fp8.py), as the
filesystem transport writes it. A sharded trainer's version is announced from its shapes, then
gathered block by block as the buckets fill (rl/trainer/streaming.py): no rank holds it whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from rl.core import fp8
from rl.core.config import RunConfig
from rl.core.derive import broadcast_backend
from rl.core.model import ensure_checkpoint, inference_state, served_layout
from rl.core.rundir import RunDir
from rl.core.runtime import Peer, inference_names, run_auth, server_host
from rl.weights import lora
from rl.weights.base import BROADCAST_ROUTE, MAX_STATUS_WAIT_S, BlockSource, WeightPublisher
from rl.weights.sync import TensorSpec, WeightGroupSpec, WeightSender, specs_of

Streamed = tuple[list[TensorSpec], Iterator[Any]]
"""An update announced before it is gathered: every tensor's spec, then the tensors in order."""


class InferenceBroadcaster:
    """Trainer rank 0's side: one weight group with every inference server, each new version
    sent through it (see the module docstring for the order of an update)."""

    def __init__(
        self, run_dir: Path, cfg: RunConfig, log: logging.Logger, *, checkpoint_layout: bool
    ) -> None:
        self.run_dir, self.log = RunDir(run_dir), log
        self.timeout_s = float(cfg.inference.broadcast_timeout_s)
        self.sender = WeightSender(server_host(), str(broadcast_backend(cfg)), self.timeout_s)
        self.servers = [Peer(run_dir, name) for name in inference_names(cfg)]
        self.http = httpx.Client(auth=run_auth(run_dir), timeout=60.0)
        self.spec: WeightGroupSpec | None = None
        # The engine's (rl/inference/engines.py): vLLM loads checkpoint-format tensors; the
        # embedded engine holds the module's layout.
        self.checkpoint_layout = checkpoint_layout
        # A base in the FP8 block format: vLLM serves it quantized, so each version is sent
        # quantized again into that format (rl/core/fp8.py), under the base's names.
        base = ensure_checkpoint(cfg.model)
        self.fp8_base = base if self.checkpoint_layout and fp8.block_size(base) else None
        self.fp8_layout = fp8.BaseLayout(base) if self.fp8_base else None

    def publish(
        self, version: int, model: Any, state: dict[str, Any] | BlockSource | None = None
    ) -> None:
        """Send `model`'s weights (or its gathered `state`, or its blocks) as `version`, in
        the layout the servers load."""
        if lora.is_wrapped(model):  # the base for version 0, then only the adapter
            if version == 0 and isinstance(state, BlockSource):
                self.update(version, self._streamed(model.get_base_model(), state))
            else:
                self.update(version, lora.published_tensors(version, model, state))
            return
        if isinstance(state, BlockSource):
            self.update(version, self._streamed(model, state))
            return
        tensors = inference_state(model, state, self.checkpoint_layout)
        if self.fp8_base is not None:
            tensors = fp8.quantized_like(self.fp8_base, tensors)
        self.update(version, tensors)

    def _streamed(self, model: Any, source: BlockSource) -> Streamed:
        """A version announced from its blocks' shapes, then gathered block by block as the
        buckets fill."""
        specs = [s for block in source.meta() for s in specs_of(self._served(model, block))]
        # Converted (and re-quantized) where gathered; an NCCL sender takes them from there.
        blocks = source.blocks(partial(self._served, model), host=self.sender.backend != "nccl")
        values = (t for block in blocks for t in block.values())
        return specs, values

    def _served(self, model: Any, block: dict[str, Any]) -> dict[str, Any]:
        tensors = served_layout(model, block, self.checkpoint_layout)
        return self.fp8_layout.quantized(tensors) if self.fp8_layout else tensors

    def update(self, version: int, tensors: dict[str, Any] | Streamed) -> None:
        """Send `tensors` (or the announced tensors, streamed) as `version` to every server
        and wait until each serves it."""
        t0 = time.monotonic()
        statuses = self._statuses()
        fresh = self.spec is None or any(s["group"] != self.spec.group for s in statuses.values())
        if fresh:
            counts = {name: int(s["receivers"]) for name, s in statuses.items()}
            broken = [f"{name}: {s['error']}" for name, s in statuses.items() if not counts[name]]
            if broken:
                raise RuntimeError(f"weight broadcast: no receivers on {'; '.join(broken)}")
            self.spec = self.sender.new_group(sum(counts.values()))
        body = {"version": version, "group": asdict(self.spec)}
        spec = self.spec
        self.run_dir.announce_broadcast(version, spec.group, spec.host, spec.port)
        for server in self.servers:
            response = self._request(server, "POST", json={**body, "member": server.name})
            if response.status_code != 200:
                raise RuntimeError(
                    f"weight broadcast: {server.name} refused version {version}: "
                    f"{response.status_code} {response.text}"
                )
        try:
            if fresh:
                self.sender.join(self.spec, counts)
            if isinstance(tensors, dict):
                sent = self.sender.send(version, tensors)
            else:
                sent = self.sender.send_stream(version, *tensors)
        except Exception:
            self.spec = None  # the next update starts over with a fresh group
            raise
        t_sent = time.monotonic()
        self._wait_for(version)
        self.run_dir.record_broadcast(version)
        self.log.info(
            "broadcast version %d over %s: %.1f MB to %d receivers in %.3f s (+%.3f s until "
            "every server served it)%s",
            version,
            self.spec.backend,
            sent / 1e6,
            self.spec.world_size - 1,
            t_sent - t0,
            time.monotonic() - t_sent,
            " (new group)" if fresh else "",
        )

    def _request(self, server: Peer, method: str, **kwargs: Any) -> httpx.Response:
        return server.request(self.http, method, BROADCAST_ROUTE, **kwargs)

    def _statuses(self) -> dict[str, dict[str, Any]]:
        out = {}
        for server in self.servers:
            response = self._request(server, "GET")
            response.raise_for_status()
            out[server.name] = response.json()
        return out

    def _wait_for(self, version: int) -> None:
        """Until every server serves `version`; fails naming a server that reports an error,
        ended on another version (it restarted), or is still busy after the timeout."""
        deadline = time.monotonic() + self.timeout_s
        for server in self.servers:
            while True:
                wait = max(min(deadline - time.monotonic(), MAX_STATUS_WAIT_S), 0.0)
                response = self._request(server, "GET", params={"wait": wait})
                response.raise_for_status()
                status = response.json()
                if status["error"]:
                    raise RuntimeError(
                        f"{server.name} did not take version {version}: {status['error']}"
                    )
                if not status["busy"]:
                    if status["policy_version"] != version:
                        raise RuntimeError(
                            f"{server.name} serves version {status['policy_version']} after the "
                            f"broadcast of version {version} (did it restart?)"
                        )
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"weight broadcast: {server.name} did not report version {version} "
                        f"within {self.timeout_s:g} s"
                    )


class BroadcastPublisher(WeightPublisher):
    """Sends every version to the servers; writes `weights/step_N` only where a restarted
    server, a resume or an export reads it: version 0, checkpointed versions and the last."""

    def __init__(
        self,
        run_dir: Path,
        cfg: RunConfig,
        disk: WeightPublisher,
        log: logging.Logger,
        checkpoint_layout: bool,
    ) -> None:
        self.run_dir, self.cfg, self.disk, self.log = run_dir, cfg, disk, log
        self.checkpoint_layout = checkpoint_layout  # the servers' engine's
        self.broadcaster: InferenceBroadcaster | None = None  # made at the first publish

    def exported(self, version: int) -> bool:
        """Whether `version` is also written to disk."""
        every = self.cfg.trainer.checkpoint_every
        return version in (0, self.cfg.max_steps) or bool(every and version % every == 0)

    def publish(
        self, version: int, model: Any, tokenizer: Any, state: dict[str, Any] | BlockSource | None
    ) -> None:
        if self.exported(version):
            self.disk.publish(version, model, tokenizer, state)
        if self.broadcaster is None:
            self.broadcaster = InferenceBroadcaster(
                self.run_dir, self.cfg, self.log, checkpoint_layout=self.checkpoint_layout
            )
        self.broadcaster.publish(version, model, state)
