"""The rollout queue as a real process over a socket: delivery, staleness, auth, durability."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from rl.queue import shard
from rl.runtime import auth_headers, wait_for_address
from tests.conftest import compose_run, start_role, stop_role, write_run_dir

TOKEN = "queue-test-token"
GROUPS_PER_STEP = 3


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
    (run_dir / "addresses" / "queue.json").unlink(missing_ok=True)
    proc = start_role("queue", run_dir)
    url = wait_for_address(run_dir, "queue", timeout=60)
    client = httpx.Client(base_url=url, headers=auth_headers(TOKEN), timeout=30)
    return SimpleNamespace(proc=proc, url=url, client=client)


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[SimpleNamespace]:
    cfg = compose_run(
        f"environment.prompts_per_step={GROUPS_PER_STEP}",
        "algorithm.max_off_policy_steps=2",
        "queue.capacity=8",
    )
    run_dir = write_run_dir(tmp_path / "run", cfg, TOKEN)
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
    assert response.status_code == 422 and "logprobs and completion_ids" in response.text
    assert queue.client.post("/push", content=b"{not json").status_code == 422
    assert push(queue, *(group(0) for _ in range(8))).status_code == 200
    full = push(queue, group(0))
    assert full.status_code == 429 and "retry-after" in full.headers
    assert queue.client.get("/stats").json()["depth"] == 8


def test_acknowledged_groups_survive_kill_9(queue: Any) -> None:
    push(queue, group(0), group(0, (7,)))
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
    samples = [{"prompt_ids": [0], "completion_ids": [0] * n} for n in (9, 1, 1, 1, 5, 3)]
    shards = [shard(samples, r, 2) for r in range(2)]
    loads = [sum(len(s["completion_ids"]) + 1 for s in part) for part in shards]
    assert sorted(loads) == [12, 14] and sum(len(p) for p in shards) == 6
