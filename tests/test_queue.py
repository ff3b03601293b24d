"""The rollout queue as a real process over a socket: delivery, staleness, auth, durability."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl.core import wire
from rl.core.auth import token_auth
from rl.core.rundir import RunDir
from rl.core.runtime import wait_for_address
from rl.queue.shards import micro_batches, partition
from tests.support.runs import TOKEN as RL_TESTING_TOKEN
from tests.support.runs import (
    compose_run,
    declare_run_state,
    start_role,
    stop_role,
    write_run_dir,
)

TOKEN = "queue-test-token"
GROUPS_PER_STEP = 3
NEWEST = 3
"""The newest policy version the queue's run has published (`declare_run_state`)."""


def group(version: int, lengths: tuple[int, ...] = (3, 5), reward: float = 0.5) -> dict:
    samples = [
        {
            "prompt_ids": [1, 2],
            "completion_ids": list(range(n)),
            "logprobs": [-0.5] * n,
            "reward": reward,
            "advantage": 0.1,
            "min_version": version,
            "max_version": version,
        }
        for n in lengths
    ]
    return {"samples": samples, "min_version": version, "max_version": version}


def start(run_dir: Path) -> SimpleNamespace:
    RunDir(run_dir).address_file("queue").unlink(missing_ok=True)
    proc = start_role("queue", run_dir)
    url = wait_for_address(run_dir, "queue", timeout=60)
    client = httpx.Client(base_url=url, auth=token_auth(TOKEN), timeout=30)
    return SimpleNamespace(proc=proc, url=url, client=client)


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[SimpleNamespace]:
    cfg = compose_run(
        f"environment.prompts_per_step={GROUPS_PER_STEP}",
        "algorithm.max_off_policy_steps=2",
        "queue.capacity=8",
        "queue.max_request_mb=1",
    )
    run_dir = write_run_dir(tmp_path / "run", cfg, TOKEN)
    declare_run_state(run_dir, NEWEST)
    q = start(run_dir)
    q.run_dir = run_dir
    yield q
    stop_role(q.proc)


def push(q: SimpleNamespace, *groups: dict) -> httpx.Response:
    return q.client.post("/push", json={"groups": list(groups)})


def batch(q: SimpleNamespace, step: int, rank: int = 0, world: int = 1) -> httpx.Response:
    return q.client.get("/batch", params={"step": step, "rank": rank, "world": world, "wait": 0.5})


def test_batch_is_assembled_once_and_served_identically(queue: Any) -> None:
    assert push(queue, group(0), group(0)).status_code == 200
    assert batch(queue, 0).status_code == 204  # 2 of 3 groups: not yet
    assert push(queue, group(0), group(0)).status_code == 200
    first = [batch(queue, 0, rank, 2).json() for rank in (0, 1)]
    again = [batch(queue, 0, rank, 2).json() for rank in (0, 1)]
    assert first == again
    served = first[0]["samples"] + first[1]["samples"]
    assert len(served) == GROUPS_PER_STEP * 2 and first[0]["groups"] == GROUPS_PER_STEP
    # The fourth group is left for step 1, not handed out twice.
    stats = queue.client.get("/stats").json()
    assert stats["depth"] == 1 and stats["assigned"] == GROUPS_PER_STEP


def test_stale_groups_are_dropped_and_counted(queue: Any) -> None:
    push(queue, *(group(0) for _ in range(3)))
    assert batch(queue, 0).status_code == 200
    push(queue, *(group(0) for _ in range(3)))
    assert batch(queue, 1).status_code == 200
    push(queue, *(group(1) for _ in range(3)))
    assert batch(queue, 2).status_code == 200
    push(queue, group(0), group(3), group(3), group(3))  # at step 3, version 0 is 3 > 2 behind
    body = batch(queue, 3).json()
    assert body["dropped"] == 1
    assert {s["min_version"] for s in body["samples"]} == {3}


def test_steps_must_be_asked_in_order(queue: Any) -> None:
    assert batch(queue, 1).status_code == 409


def test_refuses_unauthenticated_malformed_and_over_capacity(queue: Any) -> None:
    anonymous = httpx.post(f"{queue.url}/push", json={"groups": [group(0)]})
    assert anonymous.status_code == 401
    assert httpx.get(f"{queue.url}/health").status_code == 200
    bad = group(0)
    bad["samples"][0]["logprobs"] = [0.0]
    response = push(queue, bad)
    assert response.status_code == 422 and "unlike logprobs in length" in response.text
    not_json = queue.client.post(
        "/push", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert not_json.status_code == 422
    assert push(queue, *(group(0) for _ in range(8))).status_code == 200
    full = push(queue, group(0))
    assert full.status_code == 429 and "retry-after" in full.headers
    assert queue.client.get("/stats").json()["depth"] == 8


def test_acknowledged_groups_survive_kill_9(queue: Any) -> None:
    """The store as a network filesystem holds it: WAL without the shared-memory file
    (locking_mode=EXCLUSIVE), locked to the queue; a queue killed outright loses nothing it
    acknowledged."""
    import sqlite3

    from rl.core.rundir import RunDir

    push(queue, group(0), group(0, (7,)))
    store = RunDir(queue.run_dir).queue_store
    assert store.with_name(store.name + "-wal").exists()
    assert not store.with_name(store.name + "-shm").exists()
    with pytest.raises(sqlite3.OperationalError, match="database is locked"):
        sqlite3.connect(store, timeout=0.1).execute("SELECT COUNT(*) FROM groups").fetchone()
    stop_role(queue.proc, signal.SIGKILL)
    restarted = start(queue.run_dir)
    try:
        assert restarted.client.get("/stats").json()["depth"] == 2
        push(restarted, group(0))
        served = batch(restarted, 0).json()["samples"]
        assert sorted(len(s["completion_ids"]) for s in served) == [3, 3, 5, 5, 7]
    finally:
        stop_role(restarted.proc)


def test_shards_balance_tokens() -> None:
    sizes = [1 + n for n in (9, 1, 1, 1, 5, 3)]  # a one-token prompt and n completion tokens
    shards = partition(sizes, 2)
    loads = [sum(sizes[i] for i in part) for part in shards]
    assert sorted(loads) == [12, 14] and sorted(i for p in shards for i in p) == list(range(6))


def test_binary_push_and_pull_round_trip(queue: Any) -> None:
    groups = [group(0, (4, 9)), group(0, (2,)), group(0, (6, 6, 1))]
    response = queue.client.post(
        "/push", content=wire.encode(groups), headers={"Content-Type": wire.CONTENT_TYPE}
    )
    assert response.status_code == 200, response.text
    reply = queue.client.get(
        "/batch",
        params={"step": 0, "wait": 1, "micro_tokens": 12},
        headers={"Accept": wire.CONTENT_TYPE},
    )
    assert reply.headers["content-type"] == wire.CONTENT_TYPE
    [shard_group], meta = wire.decode(reply.content)
    samples = shard_group["samples"]
    assert sorted(len(s["completion_ids"]) for s in samples) == [1, 2, 4, 6, 6, 9]
    assert all(s["logprobs"] == [-0.5] * len(s["completion_ids"]) for s in samples)
    # Packed under 12 tokens per micro-batch (2 prompt tokens per sample), every sample once.
    packed = sorted(i for mb in meta["micro_batches"] for i in mb)
    assert packed == list(range(6))
    for mb in meta["micro_batches"]:
        tokens = sum(2 + len(samples[i]["completion_ids"]) for i in mb)
        assert tokens <= 12 or len(mb) == 1


def test_oversized_and_wrong_type_bodies_are_refused(queue: Any) -> None:
    huge = group(0, (300_000,))
    too_big = queue.client.post(
        "/push", content=wire.encode([huge]), headers={"Content-Type": wire.CONTENT_TYPE}
    )
    assert too_big.status_code == 413
    text = queue.client.post("/push", content=b"hello", headers={"Content-Type": "text/plain"})
    assert text.status_code == 415
    corrupt = wire.encode([group(0)])[:-3]
    short = queue.client.post("/push", content=corrupt, headers={"Content-Type": wire.CONTENT_TYPE})
    assert short.status_code == 422
    assert queue.client.get("/stats").json()["depth"] == 0


def test_openapi_describes_every_route(queue: Any) -> None:
    assert httpx.get(f"{queue.url}/openapi.json").status_code == 401
    assert httpx.get(f"{queue.url}/docs").status_code == 404
    spec = queue.client.get("/openapi.json").json()
    assert {"/health", "/push", "/batch", "/stats"} <= set(spec["paths"])
    body = spec["paths"]["/push"]["post"]["requestBody"]["content"]
    assert {"application/json", wire.CONTENT_TYPE} <= set(body)


def test_pack_respects_budget() -> None:
    sizes = [1 + n for n in (9, 1, 1, 1, 5, 3)]
    bins = micro_batches(sizes, 10)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(sizes[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 3  # 26 tokens in bins of 10: FFD reaches the bound


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)


@st.composite
def mutated_bodies(draw: st.DrawFn) -> tuple[bytes, str]:
    """A valid push, then one random mutation: a field deleted, retyped, or the bytes cut."""
    body = {"groups": [group(draw(st.integers(0, 3)), (2, 3))]}
    target = draw(st.sampled_from(["body", "group", "sample"]))
    node = {"body": body, "group": body["groups"][0], "sample": body["groups"][0]["samples"][0]}
    node = node[target]
    key = draw(st.sampled_from(sorted(node)))
    if draw(st.booleans()):
        del node[key]
    else:
        node[key] = draw(json_values)
    kind = draw(st.sampled_from(["json", "binary", "text"]))
    if kind == "json":
        raw = json.dumps(body).encode()
        return raw[: draw(st.integers(0, len(raw)))], "application/json"
    if kind == "binary":
        try:
            raw = wire.encode(body["groups"])
        except Exception:  # the mutation made it unencodable: send noise instead
            raw = draw(st.binary(max_size=64))
        return raw[: draw(st.integers(0, len(raw)))], wire.CONTENT_TYPE
    return draw(st.binary(max_size=64)), "text/plain"


@pytest.fixture(scope="module")
def shared_queue(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    cfg = compose_run("queue.capacity=100000")
    run_dir = write_run_dir(tmp_path_factory.mktemp("fuzz"), cfg, TOKEN)
    declare_run_state(run_dir, NEWEST)
    q = start(run_dir)
    yield q
    stop_role(q.proc)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=mutated_bodies(), authorised=st.booleans())
def test_fuzzed_pushes_are_refused_cleanly(
    shared_queue: Any, body: tuple[bytes, str], authorised: bool
) -> None:
    raw, content_type = body
    before = shared_queue.client.get("/stats").json()["depth"]
    headers = {"Content-Type": content_type}
    if not authorised:
        headers["Authorization"] = "Bearer wrong"
    response = shared_queue.client.post("/push", content=raw, headers=headers)
    after = shared_queue.client.get("/stats").json()["depth"]
    assert response.status_code < 500, response.text
    if response.status_code == 200:
        assert authorised and after == before + 1
    else:
        assert response.status_code in (401, 413, 415, 422) and after == before


# Hostile input: values that once poisoned the queue or were stored as ready.


def post_groups(q: SimpleNamespace, groups: list[dict], binary: bool, **params: Any) -> Any:
    if binary:
        headers = {"Content-Type": wire.CONTENT_TYPE}
        return q.client.post("/push", content=wire.encode(groups), headers=headers, params=params)
    body = json.dumps({"groups": groups})  # allows NaN, as a careless producer might send
    headers = {"Content-Type": "application/json"}
    return q.client.post("/push", content=body, headers=headers, params=params)


def test_out_of_range_integers_are_refused_and_the_queue_keeps_working(queue: Any) -> None:
    huge = 2**70
    assert post_groups(queue, [group(0)], False, batch=huge).status_code == 422
    assert post_groups(queue, [group(0)], False, batch=-1).status_code == 422
    for binary in (False, True):
        bad = group(0)
        bad["min_version"] = bad["max_version"] = huge
        refused = post_groups(queue, [bad], binary)
        assert refused.status_code == 422 and "groups[0].min_version" in refused.text
    # Nothing half-written: the queue still takes pushes and assembles a batch.
    assert queue.client.get("/stats").json()["depth"] == 0
    assert post_groups(queue, [group(0)] * 3, False, batch=0).status_code == 200
    assert batch(queue, 0).status_code == 200


def test_a_failed_store_transaction_is_rolled_back(tmp_path: Path) -> None:
    from rl.core.records import Group
    from rl.queue.store import Store

    store = Store(tmp_path / "queue.db")
    valid = [Group.parse(group(0))]
    with pytest.raises(OverflowError):
        store.push(valid, batch=2**70)  # validation is the handler's job; the store must recover
    assert store.push(valid, batch=0) == [1]
    assert store.assemble(0, 1, max_off_policy=2) == (True, 0)


def poisoned(case: str) -> dict:
    g = group(3, (2, 3))
    sample = g["samples"][0]
    if case == "nan_logprob":
        sample["logprobs"][1] = float("nan")
    elif case == "empty_prompt":
        sample["prompt_ids"] = []
    elif case == "negative_id":
        sample["completion_ids"][0] = -5
    elif case == "group_versions_reversed":
        g["min_version"], g["max_version"] = 4, 3
    elif case == "sample_versions_reversed":
        sample["min_version"], sample["max_version"] = 3, 2
    elif case == "sample_outside_group":
        sample["min_version"] = sample["max_version"] = 7
    return g


POISON_NAMES = {
    "nan_logprob": "logprobs",
    "empty_prompt": "prompt_ids",
    "negative_id": "token ids",
    "group_versions_reversed": "groups[0].min_version",
    "sample_versions_reversed": "groups[0].samples[0].min_version",
    "sample_outside_group": "groups[0].samples[0]",
}


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("case", sorted(POISON_NAMES))
def test_poisoned_groups_are_refused_in_both_formats(
    shared_queue: Any, case: str, binary: bool
) -> None:
    before = shared_queue.client.get("/stats").json()["depth"]
    response = post_groups(shared_queue, [poisoned(case)], binary)
    assert response.status_code == 422, response.text
    assert POISON_NAMES[case] in response.json()["detail"]
    assert shared_queue.client.get("/stats").json()["depth"] == before


def test_token_ids_past_int32_are_refused(shared_queue: Any) -> None:
    g = group(0)
    g["samples"][0]["prompt_ids"] = [2**31]
    response = post_groups(shared_queue, [g], False)
    assert response.status_code == 422 and "token ids" in response.text


def test_concurrent_pushes_never_exceed_capacity(queue: Any) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda _: push(queue, group(0)).status_code, range(24)))
    assert sorted(set(codes)) == [200, 429] and codes.count(200) == 8
    assert queue.client.get("/stats").json()["depth"] == 8


def test_absurd_world_is_refused(queue: Any) -> None:
    push(queue, *(group(0) for _ in range(3)))
    response = batch(queue, 0, world=30_000_000)
    assert response.status_code == 400 and "world" in response.text
    assert batch(queue, 0, 1, 2).status_code == 200


@pytest.mark.parametrize("wait", ["nan", "inf", "-inf", "-1", "61"])
def test_wait_must_be_a_finite_bounded_number(shared_queue: Any, wait: str) -> None:
    params = {"step": 0, "wait": wait}
    response = shared_queue.client.get("/batch", params=params)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["query", "wait"]


# The store's high-water marks: a store that lost committed transactions refuses to start.


def hot_copy(store_path: Path, marks: Path, into: Path) -> tuple[Path, Path]:
    """Copy a live store (database, -wal) and its marks, as a crash would leave them."""
    into.mkdir()
    for suffix in ("", "-wal"):
        source = store_path.with_name(store_path.name + suffix)
        (into / source.name).write_bytes(source.read_bytes())
    (into / marks.name).write_bytes(marks.read_bytes())
    return into / store_path.name, into / marks.name


def corrupt_frame(wal: Path, frame: int) -> None:
    """Flip a byte in the page of WAL frame `frame` (its checksum no longer matches)."""
    from rl.queue.store import PAGE_BYTES

    data = bytearray(wal.read_bytes())
    at = 32 + frame * (24 + PAGE_BYTES) + 24 + 100
    data[at] ^= 0xFF
    wal.write_bytes(bytes(data))


def test_a_store_that_lost_commits_refuses_to_start(tmp_path: Path) -> None:
    from rl.core.records import Group
    from rl.core.rundir import RunDir
    from rl.queue.store import PAGE_BYTES, Store, StoreLost

    run = RunDir(tmp_path / "run")
    run.internal.mkdir(parents=True)
    store = Store(run.queue_store, run.queue_marks)
    for step in range(6):  # one transaction per push and per assembly, all in the WAL
        assert store.push([Group.parse(group(step))] * 2, batch=step) == [
            2 * step + 1,
            2 * step + 2,
        ]
        assert store.assemble(step, 2, max_off_policy=2) == (True, 0)
    wal = run.queue_store.with_name(run.queue_store.name + "-wal")
    frames = (wal.stat().st_size - 32) // (24 + PAGE_BYTES)
    # Intact, a copy reopens with every mark.
    intact, intact_marks = hot_copy(run.queue_store, run.queue_marks, tmp_path / "intact")
    assert Store(intact, intact_marks).last_step() == 5
    # A bad frame in the middle: SQLite silently keeps only the transactions before it.
    damaged, damaged_marks = hot_copy(run.queue_store, run.queue_marks, tmp_path / "damaged")
    corrupt_frame(damaged.with_name(damaged.name + "-wal"), frames // 2)
    unchecked = Store(damaged)
    held = unchecked.last_step()  # without marks, nothing notices
    unchecked.close()  # the store is locked to one process at a time
    assert held < 5
    with pytest.raises(StoreLost) as refused:
        Store(damaged, damaged_marks)
    message = str(refused.value)
    assert str(damaged) in message and f"assembled steps {held + 1}..5" in message
    assert str(damaged_marks) in message  # and how to go on anyway
    # Deleting the marks accepts the loss: the store starts from what it holds.
    damaged_marks.unlink()
    assert Store(damaged, damaged_marks).last_step() == held


def test_many_producers_and_ranks_lose_and_repeat_nothing(tmp_path: Path) -> None:
    """benchmarks/queue_load.py at a small scale: 4 producers push whole steps (each resends
    one, as after a lost answer) while 8 ranks pull every step."""
    import numpy as np

    from benchmarks.queue_load import Shape, make_push, problems, run_load, served_pairs
    from benchmarks.queue_load import start_queue as start_loaded_queue

    shape = Shape(prompts=4, group_size=3, prompt_tokens=5, completion_tokens=7)
    producers, ranks, steps = 4, 8, 8
    rng = np.random.default_rng(0)
    bodies = [
        [(n, make_push(n, shape, rng)) for n in range(p, steps, producers)]
        for p in range(producers)
    ]
    proc, url = start_loaded_queue(tmp_path, shape, steps * shape.prompts, producers)
    try:
        load = run_load(url, bodies, ranks, steps, timeout_s=120)
        with httpx.Client(base_url=url, auth=token_auth(RL_TESTING_TOKEN)) as client:
            again = {
                (step, rank): served_pairs(
                    client.get(
                        "/batch",
                        params={"step": step, "rank": rank, "world": ranks, "wait": 0},
                        headers={"Accept": wire.CONTENT_TYPE},
                    ).content
                )
                for step in (0, steps - 1)
                for rank in range(ranks)
            }
    finally:
        stop_role(proc)
    assert problems(load, shape, ranks, steps) == []
    assert load.duplicates_refused == producers
    assert all(load.served[key] == pairs for key, pairs in again.items())  # deterministic shards
    sizes = {len(pairs) for pairs in load.served.values()}  # equal samples: counts within 1
    assert max(sizes) - min(sizes) <= 1 and sum(len(p) for p in load.served.values()) == (
        steps * shape.prompts * shape.group_size
    )


def test_a_push_that_does_not_fit_the_run_is_refused_whole(queue: Any) -> None:
    """Token ids outside the model's vocabulary (64 here), a sample longer than the served
    length (128), or JSON nested 200k deep: each a 422 naming it, nothing stored. An id the
    vocabulary lacks would otherwise end the trainer at every try (IndexError)."""
    outside = group(0)
    outside["samples"][1]["completion_ids"][2] = 1000
    longer = group(0, lengths=(3, 127))
    cases = {
        "token id 1000 is outside the model's vocabulary [0, 64)": {"groups": [outside]},
        "129 tokens, above the run's served length 128": {"groups": [longer]},
    }
    for message, body in cases.items():
        response = queue.client.post("/push", json=body)
        assert response.status_code == 422 and message in response.json()["detail"], response.text
    deep = b'{"groups": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    response = queue.client.post(
        "/push", content=deep, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 422 and "nested too deeply" in response.json()["detail"]
    stats = queue.client.get("/stats").json()
    assert stats["depth"] == 0 and stats["rejected_bad"] == 3
    assert push(queue, group(0)).status_code == 200  # the queue still serves


def test_the_trainer_checks_its_batch_against_the_run() -> None:
    """What reaches the trainer's batch is held to the same limits (the queue checked it)."""
    from rl.core.records import RecordError, RunLimits, Sample

    limits = RunLimits(vocab_size=64, max_len=16)
    good = Sample([1, 2], [3, 63], [-1.0, -1.0], 0.0, 0.0, 0, 0)
    limits.check(good, "ok")
    bad_id = Sample([1, 2], [3, 64], [-1.0, -1.0], 0.0, 0.0, 0, 0)
    with pytest.raises(RecordError, match="batch 3's sample 1: token id 64 is outside"):
        limits.check(bad_id, "batch 3's sample 1")
    long = Sample([1] * 10, [3] * 7, [-1.0] * 7, 0.0, 0.0, 0, 0)
    with pytest.raises(RecordError, match="17 tokens, above the run's served length 16"):
        limits.check(long, "s")
    # And to the score bounds the orchestrator declared: group_mean over rewards in [0, 1],
    # with a length penalty of 0.5 on samples of up to 16 of 8 tokens, spreads them by 2.
    from rl.core.records import ScoreBounds
    from rl.orchestrator.loop import score_bounds

    cfg = compose_run("algorithm.length_penalty=0.5", "environment.max_tokens=8")
    bounds = score_bounds(cfg, (0.0, 1.0), max_len=16)
    assert bounds == ScoreBounds((0.0, 1.0), 2.0)
    zscore = compose_run("algorithm.advantage=zscore", "environment.group_size=4")
    assert score_bounds(zscore, (0.0, 1.0), 16).advantage == 1.5  # (n - 1) / sqrt(n)
    # Each estimator keeps within its bound, extreme groups included (one reward apart).
    import random

    from rl.orchestrator.advantages import ADVANTAGES, advantage_bound

    draw = random.Random(0)
    for name, estimator in ADVANTAGES.items():
        for n in (2, 3, 8):
            bound = advantage_bound(name, 1.0, n)
            groups = [[draw.random() for _ in range(n)] for _ in range(200)]
            groups += [[1.0] + [0.0] * (n - 1), [0.0] + [1.0] * (n - 1)]
            top = max(abs(a) for rewards in groups for a in estimator(rewards))
            assert top <= bound * (1 + 1e-9), (name, n, top, bound)
    scored = RunLimits(vocab_size=64, max_len=16, scores=bounds)
    scored.check(Sample([1, 2], [3], [-1.0], 1.0, -2.0, 0, 0), "at the bound")
    for reward, advantage, message in [(0.0, 1e300, r"advantage 1e\+300"), (-0.1, 0.0, "reward")]:
        with pytest.raises(RecordError, match=message):
            scored.check(Sample([1, 2], [3], [-1.0], reward, advantage, 0, 0), "s")


def test_pushes_wait_for_the_orchestrator_to_declare_the_score_bounds(tmp_path: Path) -> None:
    """Before the orchestrator declared the run's score bounds the queue takes nothing (503,
    to be tried again); then it takes what fits them."""
    from fastapi.testclient import TestClient

    from rl.core.records import RunLimits
    from rl.queue.app import create_app
    from rl.queue.store import Store

    run = RunDir(tmp_path)
    run.internal.mkdir(parents=True)
    app = create_app(Store(tmp_path / "q.sqlite"), TOKEN, 1, 2, 10, 2**20,
                     RunLimits(64, 128), run)  # fmt: skip
    client = TestClient(app, headers=token_auth(TOKEN).header("/push"))
    early = client.post("/push", json={"groups": [group(0)]})
    assert early.status_code == 503 and "retry-after" in early.headers
    declare_run_state(tmp_path, newest_version=0)
    assert client.post("/push", json={"groups": [group(0)]}).status_code == 200


def test_a_push_the_schedule_did_not_ask_for_is_refused(queue: Any) -> None:
    """With the push key: a batch numbered past the next one, a group from a version the
    trainer has not published (10**6 ahead, or 2**63-1), a reward outside the environment's
    range or an advantage beyond its estimator's bound is a 422 naming the bound, and nothing
    moves: the real batch is then stored, not dropped as a duplicate of the forged one."""
    ahead = queue.client.post("/push", params={"batch": 3}, json={"groups": [group(0)]})
    assert ahead.status_code == 422, ahead.text
    assert "a push numbers at most batch 1 (queue.batches_ahead=1" in ahead.json()["detail"]
    far, reward, advantage = group(NEWEST + 10**6), group(0, reward=1.5), group(0)
    top = group(2**63 - 1)
    advantage["samples"][0]["advantage"] = 1e300
    for body, message in [
        (far, f"policy version {NEWEST + 10**6}, newer than the newest the trainer published (3)"),
        (top, f"policy version {2**63 - 1}, newer"),
        (reward, "reward 1.5 is outside the environment's reward range [0, 1]"),
        (advantage, "advantage 1e+300 is beyond the bound 1"),
    ]:
        refused = push(queue, body)
        assert refused.status_code == 422 and message in refused.json()["detail"], refused.text
    stats = queue.client.get("/stats").json()
    assert stats["next_batch"] == 0 and stats["depth"] == 0 and stats["rejected_bad"] == 5
    for step in (0, 1):
        real = queue.client.post(
            "/push", params={"batch": step}, json={"groups": [group(0)] * GROUPS_PER_STEP}
        )
        assert real.status_code == 200 and "duplicate" not in real.json(), real.text
    # Once the trainer publishes a newer version, groups from it are taken.
    RunDir(queue.run_dir).record_broadcast(NEWEST + 1)
    assert push(queue, group(NEWEST + 1)).status_code == 200
    assert [batch(queue, step).status_code for step in (0, 1)] == [200, 200]
