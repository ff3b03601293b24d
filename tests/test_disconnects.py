"""Requests whose client goes away, and the order requests are served in, on the embedded engine.

The server runs in this process over a tiny model whose every forward pass waits at a gate
until the test lets it through, so what the engine decodes is counted in forward passes and
tokens, never in seconds: a request whose client went away stops being decoded at the next
step (or, still queued, never runs), and requests are served in the order they came.
(tests/test_vllm.py checks the vLLM front's aborts.)
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from omegaconf import DictConfig

from rl.core.auth import derive, token_auth
from rl.core.model import ensure_checkpoint, load_model, load_tokenizer
from rl.inference.engine import RUN_GENERATES_S, ApiShare, Engine, LoadJob
from rl.inference.server import build_app
from tests.support import inference
from tests.support.inference import complete, send_unread, served_in_thread
from tests.support.runs import TOKEN, compose_run

cache = inference.cache

PROMPTS = ["hello world", "ab", "the quick brown fox"]
WAIT_S = 60  # for what must happen; reached only when it does not


@pytest.fixture(scope="module")
def cfg(cache: Path) -> DictConfig:
    return compose_run()


class Gate:
    """Holds the engine thread before each forward pass until the test lets one through, and
    records each pass's rows (a prompt pass: the batch's distinct prompts; a decoding step:
    its rows still decoding)."""

    def __init__(self, model: Any) -> None:
        self.passes: queue.Queue[int] = queue.Queue()
        self.allowed = threading.Semaphore(0)
        self.opened = False
        model.register_forward_pre_hook(self._hold, with_kwargs=True)

    def _hold(self, _: Any, args: tuple, kwargs: dict) -> None:
        self.passes.put(kwargs["input_ids"].shape[0])
        if not self.opened:
            self.allowed.acquire()

    def next_pass(self) -> int:
        """The rows of the next forward pass to reach the gate."""
        return self.passes.get(timeout=WAIT_S)

    def open(self) -> None:
        """Let every pass through from now on."""
        self.opened = True
        self.allowed.release(1000)

    def close(self) -> list[int]:
        """Hold passes again; the rows of those seen since the last look."""
        self.opened = False
        self.allowed = threading.Semaphore(0)
        seen = []
        while not self.passes.empty():
            seen.append(self.passes.get())
        return seen


@pytest.fixture(scope="module")
def gated(cfg: DictConfig) -> Iterator[SimpleNamespace]:
    """build_app over an engine whose model waits at a Gate, served by uvicorn on a thread;
    the engine's submissions, cancellations and batches are recorded as they happen."""
    path = ensure_checkpoint(cfg.model)
    model = load_model(path, dtype=cfg.model.dtype).eval()
    gate = Gate(model)
    engine = Engine(model, load_tokenizer(path), cfg, logging.getLogger("test"))
    cancelled, submitted, batches = queue.Queue(), queue.Queue(), queue.Queue()
    _record(engine, "cancel", cancelled)
    _record(engine, "submit", submitted)
    _record(engine, "_run_batch", batches, lambda jobs: [job.rows for job in jobs])
    engine.start()
    try:
        with served_in_thread(build_app(engine, TOKEN, 128)) as url:
            try:
                with httpx.Client(base_url=url, auth=token_auth(TOKEN), timeout=WAIT_S) as client:
                    yield SimpleNamespace(url=url, client=client, gate=gate, cancelled=cancelled,
                                          submitted=submitted, batches=batches,
                                          engine=engine)  # fmt: skip
            finally:
                gate.open()  # passes held at the gate finish, so the server can stop
    finally:
        engine.stop()


def _record(engine: Engine, method: str, into: queue.Queue, what: Any = None) -> None:
    """Put what each call of `engine.<method>` is given (or `what(it)`) into `into`: a batch
    as it starts, a submission or cancellation once made."""
    real = getattr(engine, method, None)

    def recorded(work: Any) -> Any:
        if what is not None:
            into.put(what(work))
        result = real(work) if real is not None else None
        if what is None:
            into.put(work)
        return result

    setattr(engine, method, recorded)


@pytest.fixture
def gate(gated: SimpleNamespace) -> Iterator[Gate]:
    """The gate closed, the records empty; open again afterwards, and the engine idle (a last
    request answered: everything queued before it is done)."""
    for records in (gated.cancelled, gated.submitted, gated.batches):
        while not records.empty():
            records.get()
    gated.gate.close()
    yield gated.gate
    gated.gate.open()
    assert complete(gated.client, prompt="ab", max_tokens=1).status_code == 200


def health(gated: SimpleNamespace) -> dict[str, Any]:
    return gated.client.get("/health").json()


def when_dropped(gated: SimpleNamespace, before: dict[str, Any]) -> dict[str, Any]:
    """/health once the engine has dropped one more request than `before` says."""
    for _ in range(WAIT_S * 20):
        if (now := health(gated))["requests_dropped"] > before["requests_dropped"]:
            return now
        time.sleep(0.05)
    raise AssertionError(f"no request was dropped: {now}")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_request_whose_client_goes_stops_at_the_next_step(
    gated: SimpleNamespace, gate: Gate, stream: bool
) -> None:
    """24 rows asking for 60 tokens each: their client goes during the prompt pass, and no
    decoding step follows (each row keeps only the token that pass drew)."""
    before = health(gated)
    client = send_unread(gated.url, {"prompt": PROMPTS, "n": 8, "max_tokens": 60, "stream": stream})
    assert gate.next_pass() == len(PROMPTS)  # the prompt pass, held: the request decodes
    client.close()
    job = gated.cancelled.get(timeout=WAIT_S)  # the server cancelled the request
    assert job.rows == 24
    gate.open()
    after = when_dropped(gated, before)
    assert gate.close() == []  # no decoding step after the prompt pass
    assert after["tokens_decoded"] - before["tokens_decoded"] == 24
    assert after["requests_dropped"] - before["requests_dropped"] == 1


def test_a_queued_request_whose_client_goes_never_runs(gated: SimpleNamespace, gate: Gate) -> None:
    before = health(gated)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(complete, gated.client, prompt="ab", max_tokens=3, temperature=0)
        assert gate.next_pass() == 1  # the first request holds the engine
        client = send_unread(gated.url, {"prompt": PROMPTS, "n": 100, "max_tokens": 60})
        queued = [gated.submitted.get(timeout=WAIT_S) for _ in range(2)][1]
        client.close()
        assert gated.cancelled.get(timeout=WAIT_S) is queued
        gate.open()
        answer = first.result(timeout=WAIT_S).json()
    after = when_dropped(gated, before)
    assert set(gate.close()) <= {1}  # only the first request's row was ever decoded
    decoded = after["tokens_decoded"] - before["tokens_decoded"]
    assert decoded == answer["usage"]["completion_tokens"]


def test_requests_are_served_in_the_order_they_came(gated: SimpleNamespace, gate: Gate) -> None:
    """Behind a request holding the engine: a small request, a whole batch's worth (512 rows)
    and another small one. Each batch takes the queue's head, as many as fit: the small one that
    came first goes before the large one, and the one after it waits its turn, though it would
    have fit beside the first. A request waits for the batches of those before it, never for
    later ones; one request holds the engine for one batch at most."""
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(complete, gated.client, prompt="ab", max_tokens=2)
        assert gate.next_pass() == 1  # the first request holds the engine
        gated.submitted.get(timeout=WAIT_S)
        rest = []
        for n in (1, 512, 1):
            rest.append(pool.submit(complete, gated.client, prompt="ab", n=n, max_tokens=2))
            gated.submitted.get(timeout=WAIT_S)  # queued before the next is sent
        gate.open()
        assert [f.result(timeout=WAIT_S).status_code for f in (first, *rest)] == [200] * 4
    batches = []
    while not gated.batches.empty():
        batches.append(gated.batches.get())
    assert batches == [[1], [1], [512], [1]]  # each batch's requests' rows


def test_the_runs_rollouts_go_ahead_of_api_clients(gated: SimpleNamespace, gate: Gate) -> None:
    """Behind a request holding the engine: an API client's two requests of 256 rows (the API
    key; 512 rows in all, its bound: inference.api_rows_per_key), then the run's own rollout
    (the orchestrator's key). The rollout is served next, ahead of both: API clients delay the
    run's rollouts by the batch already running at most."""
    api_key = derive(TOKEN)["inference"]
    with (
        ThreadPoolExecutor(4) as pool,
        httpx.Client(base_url=gated.url, headers={"Authorization": f"Bearer {api_key}"},
                     timeout=WAIT_S) as api,
    ):  # fmt: skip
        first = pool.submit(complete, gated.client, prompt="ab", max_tokens=2)
        assert gate.next_pass() == 1  # the first request holds the engine
        gated.submitted.get(timeout=WAIT_S)
        rest = []
        for client, n in ((api, 256), (api, 256), (gated.client, 1)):  # the last: a rollout
            rest.append(pool.submit(complete, client, prompt="ab", n=n, max_tokens=2))
            gated.submitted.get(timeout=WAIT_S)
        gate.open()
        assert [f.result(timeout=WAIT_S).status_code for f in (first, *rest)] == [200] * 4
    batches = []
    while not gated.batches.empty():
        batches.append(gated.batches.get())
    assert batches == [[1], [1, 256], [256]]  # in arrival order: [1], [256, 256], [1]


def test_the_runs_rollouts_go_between_the_steps_of_api_clients_batch(
    gated: SimpleNamespace, gate: Gate
) -> None:
    """An API client's 8 rows of one prompt hold the engine (their prompt pass, 1 row), then the
    run's rollout of 3 prompts comes: its prompt pass (3 rows) and steps run before the API
    batch's first decoding step (8 rows), which then goes on. Greedy, so the 8 rows end
    together and every pass of theirs has 8 rows."""
    api_key = derive(TOKEN)["inference"]
    with (
        ThreadPoolExecutor(2) as pool,
        httpx.Client(base_url=gated.url, headers={"Authorization": f"Bearer {api_key}"},
                     timeout=WAIT_S) as api,
    ):  # fmt: skip
        held = pool.submit(complete, api, prompt="ab", n=8, max_tokens=4, temperature=0)
        assert gate.next_pass() == 1  # the API batch's prompt pass, held
        rollout = pool.submit(complete, gated.client, prompt=PROMPTS, max_tokens=3, temperature=0)
        gated.submitted.get(timeout=WAIT_S)
        gated.submitted.get(timeout=WAIT_S)
        gate.open()
        answers = [f.result(timeout=WAIT_S) for f in (held, rollout)]
        assert [a.status_code for a in answers] == [200, 200]
    passes = gate.close()
    # A pass draws each token: the prompt pass the first, then one pass per further token.
    api_steps = len(answers[0].json()["choices"][0]["token_ids"]) - 1
    rollout_passes = max(len(c["token_ids"]) for c in answers[1].json()["choices"])
    assert api_steps == 3  # no row ended early: 4 tokens
    assert passes[0] == len(PROMPTS)  # the rollout's prompt pass, before any API step
    assert passes == [*passes[:rollout_passes], *[8] * api_steps]
    assert set(passes[:rollout_passes]) <= {1, 2, 3}


def test_api_clients_share_is_a_rest_after_their_work_while_the_run_generates() -> None:
    share = ApiShare(0.25, rollout_at=100.0)
    share.worked(0.1, now=101.0)  # a rollout a second ago: the run generates
    assert share.rest_left(101.0) == pytest.approx(0.3)  # 0.1 s of work is a quarter of 0.4 s
    assert share.rest_left(101.2) == pytest.approx(0.1) and share.rest_left(102.0) == 0.0
    share.worked(0.1, now=100.0 + RUN_GENERATES_S + 1)  # no rollout for a while: no rest
    assert share.rest_left(100.0 + RUN_GENERATES_S + 1) == 0.0
    whole = ApiShare(1.0, rollout_at=100.0)
    whole.worked(0.1, now=101.0)
    assert whole.rest_left(101.0) == 0.0


def test_api_clients_batches_rest_while_the_run_generates(
    gated: SimpleNamespace, gate: Gate, cfg: DictConfig, tmp_path: Path
) -> None:
    """With a share so small that the rest outlasts the test: an API client's batch (8 rows)
    rests after its prompt pass, and another API request waits behind it, while the run's
    rollout comes and is served meanwhile. A weight load queued ends the rest (it needs the
    batch to end): both API requests are then answered, and the load (of nothing) refused."""
    engine = gated.engine
    api_key = derive(TOKEN)["inference"]
    engine.api_share = ApiShare(1e-9)
    try:
        gate.open()
        assert complete(gated.client, prompt="ab", max_tokens=1).status_code == 200  # generates
        gated.submitted.get(timeout=WAIT_S)
        gate.close()
        with (
            ThreadPoolExecutor(3) as pool,
            httpx.Client(base_url=gated.url, headers={"Authorization": f"Bearer {api_key}"},
                         timeout=WAIT_S) as api,
        ):  # fmt: skip
            first = pool.submit(complete, api, prompt="ab", n=8, max_tokens=3, temperature=0)
            assert gate.next_pass() == 1  # its prompt pass, held
            gate.open()  # the prompt pass goes on, then the batch rests
            second = pool.submit(complete, api, prompt="ab", max_tokens=1)
            rollout = pool.submit(complete, gated.client, prompt=PROMPTS, max_tokens=2)
            for _ in range(3):
                gated.submitted.get(timeout=WAIT_S)
            assert rollout.result(timeout=WAIT_S).status_code == 200  # served in the rest
            assert not first.done() and not second.done()  # the API clients' wait it out
            load = engine.submit(LoadJob(tmp_path / "nothing", 1))
            assert [f.result(timeout=WAIT_S).status_code for f in (first, second)] == [200] * 2
            assert load.exception(timeout=WAIT_S) is not None
    finally:
        engine.api_share = ApiShare(cfg.inference.api_share)
