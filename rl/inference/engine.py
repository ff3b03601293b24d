"""The embedded engine: one thread owns a transformers model and serves every request to it.

It serves CPU runs and small single-GPU runs without vLLM, and is the reference the vLLM backend
is held to. The engine thread merges concurrent requests into one left-padded batch, decodes it
with a KV cache (rl/inference/generation.py), and applies weight swaps only between batches (from
`weights/step_N`, or received from the trainer's broadcast: rl/weights/), so every response can
name the single policy version that produced it. The HTTP server in front of it is
rl/inference/server.py.

Requests are taken in arrival order, as many as fit `inference.max_batch_size` rows, and a
batch decodes until its last row ends: a request waits for the batches of the requests before
it, never for later ones, and one request (at most max_batch_size rows of at most the context
length) holds the engine for at most one batch. The run's own rollouts (sent with the
orchestrator's key, rl/core/auth.py) are queued ahead of API clients' waiting requests, though
never ahead of a weight load or sleep queued before them; and a batch of API clients' requests
alone pauses between its steps while the rollouts at the head of the queue run, as a batch of
their own, on the same weights (the engine then holds both batches' memory). API clients delay
the run's rollouts by one decoding step, at most. While the run generates, API clients' batches
also take at most `inference.api_share` of the engine's time (`ApiShare`): on CPU the trainer,
the orchestrator and the server's own HTTP handling need the cores they leave. Each API key has
a bounded share of the queue too (`inference.api_rows_per_key`, rl/inference/openai_api.py).
A request whose client went away is dropped: queued, it never runs; decoding, its rows leave
the batch at the next step.

Asleep (colocated placement: the trainer's turn), the weights' memory is given back: on GPU
they move to host memory; on CPU they are freed, and read again on waking from where they came
from (the base checkpoint or the published version loaded last). Completions are refused
meanwhile; a weight load wakes the engine on the weights it loads.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl.core.config import RunConfig
from rl.core.lora import enabled as lora_enabled
from rl.core.lora import is_adapter_dir, is_adapter_name, scale, targets
from rl.inference.adapters import Adapter, Adapters
from rl.inference.generation import NO_LIMITS, Limits, StepSink, generate
from rl.inference.openai_api import ASLEEP, Deltas
from rl.weights.lora import read_adapter
from rl.weights.published import RefusedWeights, check_finite, private_copy, read_checkpoint
from rl.weights.sync import WeightReceiver


def load_state_dict_in_place(model: Any, path: Path, recorded: bool = True) -> None:
    """Copy an HF checkpoint's safetensors into `model`; read and checked whole first (readable,
    finite, matching the model; `recorded`: a published version, its files as the trainer
    recorded them), so a refused checkpoint leaves no half-loaded model."""
    state = read_checkpoint(path, recorded)
    if not state.keys() <= model.state_dict().keys():
        # Saved in the published layout, which transformers converts on load (MoE experts are
        # stored one tensor per expert and held stacked): read it through that conversion,
        # from a checked copy of a published version.
        from transformers import AutoModelForCausalLM

        with tempfile.TemporaryDirectory(prefix="relay-weights-") as tmp:
            source = private_copy(path, Path(tmp) / "copy") if recorded else path
            converted = AutoModelForCausalLM.from_pretrained(source, dtype=model.dtype)
            load_state_in_place(model, converted.state_dict(), f"checkpoint {path}")
        return
    load_state_in_place(model, state, f"checkpoint {path}")


def load_state_in_place(model: Any, state: dict[str, Any], source: str) -> None:
    """Copy `state` (HF names) into `model` once it is checked to match the served model."""
    current = model.state_dict()
    loaded_ptrs = {current[k].data_ptr() for k in state if k in current}
    # Tied weights (lm_head = embedding) are saved once; a key sharing storage is not missing.
    missing = [k for k in current if k not in state and current[k].data_ptr() not in loaded_ptrs]
    unexpected = [k for k in state if k not in current]
    wrong = [k for k in state if k in current and state[k].shape != current[k].shape]
    if missing or unexpected or wrong:
        raise ValueError(
            f"{source} does not match the served model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shape {wrong[:5]}"
        )
    model.load_state_dict(state, strict=False)


RUN_GENERATES_S = 10.0
"""How recently a rollout must have come for the run to count as generating (`ApiShare`)."""


@dataclass
class ApiShare:
    """The engine time API clients' batches may take while the run generates (a rollout came
    within RUN_GENERATES_S): after API work of t seconds the engine rests t x (1 - share) /
    share seconds before more, running the run's rollouts meanwhile. Times are
    `time.monotonic()` seconds, given by the caller."""

    share: float
    rest_until: float = 0.0
    rollout_at: float = -RUN_GENERATES_S
    """When the last rollout came."""

    def worked(self, seconds: float, now: float) -> None:
        """API clients' batches have just run for `seconds`: owe the rest that follows."""
        if now - self.rollout_at < RUN_GENERATES_S:
            self.rest_until = now + seconds * (1 - self.share) / self.share

    def rest_left(self, now: float) -> float:
        return max(0.0, self.rest_until - now)


def _overtaken(queued: Any) -> bool:
    """Whether a rollout job goes ahead of `queued`: an API client's request."""
    return isinstance(queued, CompletionJob) and not queued.rollout


@dataclass
class CompletionJob:
    """One HTTP completions request, tokenized and validated, waiting for the engine.
    `sink`, when set, sees each decoding step's tokens for this job's rows (streaming)."""

    prompts_ids: list[list[int]]
    n: int
    max_tokens: int
    temperature: float
    seed: int | None
    limits: Limits = NO_LIMITS
    sink: Callable[[Deltas], None] | None = None
    adapter: str = ""
    """The LoRA adapter's name ("": the run's own policy)."""
    seeds: tuple[int, ...] | None = None
    """A seed per prompt: each prompt's rows draw from a generator of their own."""
    future: Future = field(default_factory=Future)
    withdrawn: bool = False
    """Set (Engine.cancel) when the client went away while the job decodes: its rows end at
    the next step."""
    rollout: bool = False
    """The run's own rollouts (the orchestrator's key): queued ahead of API clients' requests
    that wait, never ahead of a weight load or sleep queued before it."""

    @property
    def rows(self) -> int:
        return len(self.prompts_ids) * self.n


@dataclass
class LoadJob:
    """A weight swap, queued behind the requests that arrived before it: from a checkpoint
    directory, or (`receiver` set) from the trainer's broadcast."""

    path: Path | None
    version: int
    receiver: WeightReceiver | None = None
    adapter: str = ""
    """In a LoRA run, the name to serve an adapter under ("": the run's own policy)."""
    future: Future = field(default_factory=Future)


class EngineStopped(RuntimeError):
    """The engine thread is not running, so a queued request will never be served."""


class EngineAsleep(RuntimeError):
    """The engine is asleep (its weights given back): it serves no completions until woken."""


class SleepRefused(RuntimeError):
    """The engine cannot give its weights back: it could not read them again on waking."""


@dataclass
class MemoryJob:
    """Sleep (give the weights' memory back: on GPU to host memory, on CPU freed) or wake up
    (weights back on the device, or read again), queued behind the requests before it."""

    asleep: bool
    future: Future = field(default_factory=Future)


def _fail(jobs: Sequence[CompletionJob | LoadJob | MemoryJob], exc: BaseException) -> None:
    """Fail the futures of `jobs` not already answered (or cancelled by a departed client)."""
    for job in jobs:
        if not job.future.done():
            job.future.set_exception(exc)


class Engine:
    """Owns the model on one thread, so batches and weight swaps can never overlap.

    An error in one batch or load fails only that work's futures. Should the thread die anyway,
    `failure` says why, and every queued and later request fails with `EngineStopped`.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        cfg: RunConfig,
        logger: logging.Logger,
        weights_from: Path | None = None,
    ):
        """`weights_from`: the checkpoint `model`'s weights were read from (sleep on CPU reads
        them from there again on waking; without it, it refuses)."""
        import torch

        self.model, self.tokenizer, self.logger = model, tokenizer, logger
        self.model_name, self.max_batch_size = cfg.model.name, cfg.inference.max_batch_size
        self.api_rows_per_key = cfg.inference.api_rows_per_key  # the API routes' bound
        # Ids the model can embed (it may sample ones the tokenizer does not name, and a
        # multi-turn episode sends them back as its next prompt).
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.version = -1  # base weights; the orchestrator loads version 0 before rollouts
        # Seeded from the OS: replicas must not draw identical samples for unseeded requests.
        self.device = model.device
        self.asleep = False
        # Where the served full weights can be read again (None: received by broadcast), and
        # while asleep on CPU, each freed parameter's shape.
        self.weights_from = weights_from
        self.base = weights_from  # the model's own checkpoint: not a published version
        self._freed: list[tuple[Any, Any]] = []
        # Counted on the engine thread (read by /health): sampled tokens, and requests dropped
        # because their client went away (queued, or decoding).
        self.tokens_decoded = 0
        self.requests_dropped = 0
        self.generator = torch.Generator(device=model.device)
        self.generator.seed()
        # LoRA runs: versions after 0 are adapters, applied on the base without merging.
        self.adapters = Adapters(model, targets(cfg.model)) if lora_enabled(cfg.model) else None
        self.lora_scale = scale(cfg.model) if self.adapters else 1.0
        self.shared = cfg.inference.shared  # a sweep's shared inference: one base, N points
        self._pending: deque[CompletionJob | LoadJob | MemoryJob] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self.api_share = ApiShare(cfg.inference.api_share)
        self._api_since = 0.0  # when API clients' batch work last started (engine thread)
        self._died = ""  # why the thread ended early; "" while it runs or after stop()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    def failure(self) -> str:
        """Why the engine cannot serve ("" while its thread runs)."""
        if self._thread.is_alive():
            return ""
        return self._died or "the engine thread is not running"

    def cancel(self, job: CompletionJob) -> None:
        """Drop `job`, whose client went away: still queued, it never runs (its future is
        cancelled); decoding, its rows end at the batch's next step."""
        if not job.future.cancel():
            job.withdrawn = True

    def submit(self, job: CompletionJob | LoadJob | MemoryJob) -> Future:
        with self._cond:
            if self._died:
                _fail([job], EngineStopped(self._died))
                return job.future
            at = len(self._pending)
            if isinstance(job, CompletionJob) and job.rollout:  # ahead of API clients' requests
                self.api_share.rollout_at = time.monotonic()
                while at and _overtaken(self._pending[at - 1]):
                    at -= 1
            self._pending.insert(at, job)
            self._cond.notify()
        return job.future

    def _take(self, rollouts_only: bool) -> list[CompletionJob]:
        """The requests at the head of the queue, in its order, up to max_batch_size rows
        (`rollouts_only`: the run's rollouts there, none when a weight load or sleep or an API
        client's request comes first). Called holding the lock."""
        batch: list[CompletionJob] = []
        rows = 0
        while self._pending and isinstance(head := self._pending[0], CompletionJob):
            if (rollouts_only and not head.rollout) or (
                batch and rows + head.rows > self.max_batch_size
            ):
                break
            self._pending.popleft()
            if head.future.set_running_or_notify_cancel():  # False: client went away
                batch.append(head)
                rows += head.rows
            else:
                self.requests_dropped += 1
        return batch

    def _between_api_steps(self) -> bool:
        """Between two steps of a batch of API clients' requests alone: the rest its work owes
        (`ApiShare`), in which the rollouts queued at the head of the queue run, on the same
        weights (at once, rest or not); whether any ran."""
        now = time.monotonic()
        self.api_share.worked(now - self._api_since, now)
        ran = False
        while batch := self._rollouts_or_rest():
            try:
                self._serve(batch)
            except BaseException as exc:  # the thread dies (_loop): these are not left waiting
                _fail(batch, EngineStopped(f"the engine thread died: {exc!r}"))
                raise
            ran = True
        self._api_since = time.monotonic()
        return ran

    def _rollouts_or_rest(self) -> list[CompletionJob]:
        """The rollouts at the head of the queue, waiting for some while API clients' batches
        rest; none once the rest is over."""
        with self._cond:
            while not (batch := self._take(rollouts_only=True)) and self._resting():
                self._cond.wait(self._rest_wait())
            return batch

    def _resting(self) -> bool:
        """Whether API clients' batches wait (`ApiShare`): not while the engine stops, nor while
        a weight load or sleep is queued (it waits for them). Called holding the lock."""
        if self._stopping or any(isinstance(job, LoadJob | MemoryJob) for job in self._pending):
            return False
        return self.api_share.rest_left(time.monotonic()) > 0

    def _rest_wait(self) -> float:
        """How long to wait, resting, before looking again (new work wakes the engine
        sooner); at most a second, so that any share's rest stays a wait the lock allows."""
        return min(self.api_share.rest_left(time.monotonic()), 1.0)

    def _next_work(self) -> list[CompletionJob] | LoadJob | None:
        """A weight load alone, or the queued requests up to max_batch_size rows (in queue
        order: arrival order, the run's rollouts ahead of API clients'; API clients' not while
        they rest)."""
        with self._cond:
            while True:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return None
                if isinstance(self._pending[0], LoadJob | MemoryJob):
                    return self._pending.popleft()  # type: ignore[return-value]
                resting = self._resting()
                if (batch := self._take(rollouts_only=resting)) or not resting:
                    return batch
                self._cond.wait(self._rest_wait())

    def _loop(self) -> None:
        jobs: list[CompletionJob | LoadJob] = []
        try:
            while (work := self._next_work()) is not None:
                jobs = [work] if isinstance(work, LoadJob | MemoryJob) else list(work)
                self._serve(work)
        except BaseException as exc:  # reported by failure() and /health, not raised again
            self.logger.exception("the engine thread died")
            with self._cond:
                self._died = f"the engine thread died: {exc!r}"
                stranded, self._pending = list(self._pending), deque()
            _fail(jobs + stranded, EngineStopped(self._died))

    def _serve(self, work: list[CompletionJob] | LoadJob) -> None:
        """Run one load or batch; an error fails that work's futures and no others."""
        try:
            if isinstance(work, MemoryJob):
                self._set_memory(work)
            elif isinstance(work, LoadJob):
                self._load(work)
            elif work:
                self._run_batch(work)
        except Exception as exc:
            single = isinstance(work, LoadJob | MemoryJob)
            self.logger.exception("%s failed", type(work).__name__ if single else "batch")
            _fail([work] if single else work, exc)  # type: ignore[list-item]

    def _set_memory(self, job: MemoryJob) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        if job.asleep and not self.asleep:
            self._sleep()
        elif self.asleep and not job.asleep:
            self._wake(self.weights_from)
        job.future.set_result(self.memory())

    def memory(self) -> dict[str, Any]:
        """Whether the engine is asleep, and the bytes its weights hold: on the GPU
        (`device_bytes`: all it has allocated there), and anywhere (`weight_bytes`)."""
        import torch

        held = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        weights = sum(p.untyped_storage().nbytes() for p in self.model.parameters())
        return {"asleep": self.asleep, "device_bytes": held, "weight_bytes": weights}

    def _sleep(self) -> None:
        """Give the weights' memory back: on GPU to host memory, on CPU freed (each parameter
        keeps its identity, so tied weights stay tied, and only its storage goes)."""
        import torch

        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        elif self.weights_from is None:
            raise SleepRefused(
                f"version {self.version} was received by broadcast and has no copy to read "
                "again on waking: not put to sleep (sleep on CPU frees the weights)"
            )
        else:
            self._freed = [(p, p.shape) for p in self.model.parameters()]
            for param, _ in self._freed:
                param.data = torch.empty(0, dtype=param.dtype)
        self.asleep = True
        self.logger.info("asleep: the weights' memory is given back")

    def _wake(self, source: Path | None) -> None:
        """The weights back: on the device (GPU), or (CPU) allocated and read from `source`
        (None: left for the load that follows to fill whole). Still asleep if that fails."""
        import torch

        if self.device.type == "cuda":
            self.model.to(self.device)
        else:
            for param, shape in self._freed:
                param.data = torch.empty(shape, dtype=param.dtype)
            if source is not None:
                try:
                    load_state_dict_in_place(self.model, source, source != self.base)
                except BaseException:
                    for param, _ in self._freed:
                        param.data = torch.empty(0, dtype=param.dtype)
                    raise
            self._freed = []
        self.asleep = False
        self.logger.info("awake: the weights are back")

    def held(self, name: str = "") -> int:
        """The version served under `name` ("": the run's own policy)."""
        if name and name != self.model_name:
            adapter = self.adapters.loaded.get(name) if self.adapters else None
            return adapter.version if adapter else -1
        return self.version

    def _load(self, job: LoadJob) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        start = time.perf_counter()
        source = job.path or "the trainer's broadcast"
        name = job.adapter or self.model_name
        woke = self.asleep  # a load wakes the engine, on the weights it loads
        try:
            if woke:  # new full weights fill every parameter: nothing to read again first
                whole = job.receiver is None and name == self.model_name
                self._wake(None if whole and not is_adapter_dir(job.path) else self.weights_from)
            if job.receiver is not None:
                self._receive(job.receiver, job.version)
            else:
                self._load_dir(job.path, job.version, name)
        except Exception as exc:  # reported to the caller; the old weights stay in place
            self.logger.warning("refused version %d from %s: %s", job.version, source, exc)
            if woke and not self.asleep:
                self._sleep()  # as the load found it
            job.future.set_exception(exc)
            return
        if name == self.model_name:
            self.version = job.version
        seconds = time.perf_counter() - start
        named = "" if name == self.model_name else f" as {name}"
        self.logger.info(
            "loaded version %d from %s%s in %.2f s", job.version, source, named, seconds
        )
        job.future.set_result({"policy_version": job.version, "load_s": seconds})

    def _load_dir(self, path: Path, version: int, name: str) -> None:
        """Full weights (the base: no adapter under `name` after it) or, in a LoRA run, an
        adapter served as `name`."""
        if not is_adapter_dir(path):
            if self.shared and version == 0 and name != self.model_name:
                # A sweep point's version 0 is the base this service holds (the sweep starts
                # every point from it): the point is served, its adapter to come.
                self.adapters.put(name, Adapter({}, 1.0, version))
                return
            if name != self.model_name:
                raise RefusedWeights(f"{path} holds full weights, not an adapter for {name!r}")
            load_state_dict_in_place(self.model, path)
            self.weights_from = path
            if self.adapters:
                self.adapters.put(name, None)
            return
        if self.adapters is None:
            raise RefusedWeights(f"{path} is a LoRA adapter; this server serves no LoRA run")
        tensors, scale = read_adapter(path)
        adapter = self.adapters.parse(tensors, scale, version, f"adapter {path}")
        self.adapters.put(name, adapter)

    def _receive(self, receiver: WeightReceiver, version: int) -> None:
        """Take a whole update, then check and copy it (the old weights stay if it fails)."""
        state: dict[str, Any] = {}
        header = receiver.receive(state.update)
        if header["version"] != version:
            raise ValueError(f"broadcast carried version {header['version']}, not {version}")
        source = f"broadcast of version {version}"
        for name, tensor in state.items():
            check_finite(name, tensor, source)
        if self.adapters and any(is_adapter_name(key) for key in state):
            adapter = self.adapters.parse(state, self.lora_scale, version, source)
            self.adapters.put(self.model_name, adapter)
            return
        load_state_in_place(self.model, state, source)
        self.weights_from = None  # no copy of these weights to read again
        if self.adapters:
            self.adapters.put(self.model_name, None)

    def _run_batch(self, jobs: list[CompletionJob]) -> None:
        import torch

        if self.asleep:
            _fail(jobs, EngineAsleep(ASLEEP))
            return
        prompts, caps, temps, gens, limits, names = [], [], [], [], [], []
        for job in jobs:
            gen = self.generator
            if job.seed is not None:
                gen = torch.Generator(device=self.model.device).manual_seed(job.seed)
            for i, prompt in enumerate(job.prompts_ids):
                if job.seeds is not None:  # this prompt's rows: a generator of their own
                    gen = torch.Generator(device=self.model.device).manual_seed(job.seeds[i])
                prompts += [prompt] * job.n
                caps += [job.max_tokens] * job.n
                temps += [job.temperature] * job.n
                gens += [gen] * job.n
                limits += [job.limits] * job.n
                names += [job.adapter or self.model_name] * job.n
        start = time.perf_counter()
        on_step = _stream_to(jobs) if any(job.sink for job in jobs) else None
        route = self.adapters.route if self.adapters else None
        # A batch of API clients' requests alone lets the run's rollouts go between its steps,
        # and keeps to its share of the engine's time.
        api_only = not any(job.rollout for job in jobs)
        if api_only:
            self._api_since = time.monotonic()
        samples = generate(
            self.model, self.tokenizer, prompts, caps, temps, gens, limits, on_step, names, route,
            _withdrawn(jobs), self._between_api_steps if api_only else None,
        )  # fmt: skip
        if api_only:
            now = time.monotonic()
            self.api_share.worked(now - self._api_since, now)
        tokens = sum(len(s.token_ids) for s in samples)
        self.tokens_decoded += tokens
        seconds = time.perf_counter() - start
        self.logger.debug("batch of %d rows: %d tokens in %.2f s", len(prompts), tokens, seconds)
        offset = 0
        for job in jobs:
            if job.withdrawn:
                self.requests_dropped += 1
                self.logger.info("dropped a request of %d rows: its client went away", job.rows)
            job.future.set_result((self.held(job.adapter), samples[offset : offset + job.rows]))
            offset += job.rows


def _withdrawn(jobs: list[CompletionJob]) -> Callable[[], list[int]]:
    """The batch rows of the jobs withdrawn since last asked (generate's `withdrawn`)."""
    spans, at = [], 0
    for job in jobs:
        spans.append((job, at, at + job.rows))
        at += job.rows
    told: set[int] = set()  # the spans already named

    def rows() -> list[int]:
        new = [k for k, (job, _, _) in enumerate(spans) if job.withdrawn and k not in told]
        told.update(new)
        return [row for k in new for row in range(spans[k][1], spans[k][2])]

    return rows


def _stream_to(jobs: list[CompletionJob]) -> StepSink:
    """A step sink handing each streaming job its own rows' new tokens (job-local indices)."""
    spans, at = [], 0
    for job in jobs:
        spans.append((job, at, at + job.rows))
        at += job.rows

    def on_step(tokens: list[int], _: list[float], alive: list[bool]) -> None:
        for job, begin, end in spans:
            if job.sink is not None:
                new = [(k - begin, [tokens[k]]) for k in range(begin, end) if alive[k]]
                if new:
                    job.sink(new)

    return on_step
