"""The rollout queue at a cluster's scale: many producers pushing whole steps, many ranks pulling.

Starts a real queue process. `--producers` threads each push `--pushes` step-sized batches (one
request each, as the orchestrator does: `prompts x group-size` samples of `--prompt-tokens` +
`--completion-tokens` tokens, binary wire format) while `--ranks` threads pull every step's
shard (`/batch?rank=r&world=ranks`), each on its own keep-alive connection. Every sample carries
its group's id and its index in the group (its first two prompt tokens), so the run checks that
no group was lost or served twice and that each step's shards partition its groups. Each
producer also resends its first batch, as after a lost answer: the queue must ignore it.

Prints push and pull p50/p99 latencies under that load, then ingest alone (the same pushes into
a fresh queue, nobody pulling) in MB/s next to a raw loopback TCP socket moving the same bytes
in the same run, and the ratio. Bounded: everything stops after `--timeout` seconds.

    uv run python benchmarks/queue_load.py [--producers 16] [--ranks 64] [--pushes 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import uvicorn
from fastapi import FastAPI, Request

from benchmarks.queue_throughput import raw_loopback_mb_per_s
from rl.core import wire
from rl.core.auth import token_auth
from rl.core.runtime import listen_socket, wait_for_address
from tests.support.runs import (
    ROOT,
    TOKEN,
    compose_run,
    declare_run_state,
    start_role,
    stop_role,
    write_run_dir,
)


@dataclass
class Shape:
    """What one push holds: a whole step."""

    prompts: int = 32
    """Groups per step (`environment.prompts_per_step`)."""
    group_size: int = 16
    """Samples per group."""
    prompt_tokens: int = 512
    completion_tokens: int = 1536


VOCAB = 150_000


def make_push(batch: int, shape: Shape, rng: np.random.Generator) -> bytes:
    """Batch `batch` as one binary push body; group g's id is `batch * prompts + g`, written
    with the sample's index into the first two prompt tokens."""
    groups = []
    for g in range(shape.prompts):
        samples = []
        for i in range(shape.group_size):
            prompt = rng.integers(0, VOCAB, shape.prompt_tokens, dtype=np.int32)
            prompt[:2] = (batch * shape.prompts + g, i)
            samples.append(
                {
                    "prompt_ids": prompt,
                    "completion_ids": rng.integers(0, VOCAB, shape.completion_tokens),
                    "logprobs": -5 * rng.random(shape.completion_tokens, dtype=np.float32),
                    "reward": float(i % 2),
                    "advantage": float(i % 2) - 0.5,
                    "min_version": 0,
                    "max_version": 0,
                }
            )
        groups.append({"samples": samples, "min_version": 0, "max_version": 0})
    return wire.encode(groups)


@dataclass
class Load:
    """What a load run saw."""

    push_s: list[float] = field(default_factory=list)
    pull_s: list[float] = field(default_factory=list)
    pushed_bytes: int = 0
    push_wall_s: float = 0.0
    duplicates_refused: int = 0
    served: dict[tuple[int, int], list[tuple[int, int]]] = field(default_factory=dict)
    """(step, rank) -> the (group id, sample index) pairs of that shard."""
    errors: list[str] = field(default_factory=list)


def queue_config(shape: Shape, total_groups: int, producers: int) -> list[str]:
    return [
        f"environment.prompts_per_step={shape.prompts}",
        f"queue.capacity={total_groups}",
        f"queue.batches_ahead={producers}",  # each pushes its batches in order, all at once
        "queue.max_request_mb=256",
        "algorithm.max_off_policy_steps=1000000",  # every group is version 0
        # The queue checks ids and lengths against the run: a 150k vocabulary, long samples.
        f"model.vocab_size={VOCAB}",
        f"model.context_length={max(128, shape.prompt_tokens + shape.completion_tokens)}",
        f"environment.max_context_tokens={shape.prompt_tokens + shape.completion_tokens}",
    ]


def start_queue(
    root: Path, shape: Shape, total_groups: int, producers: int
) -> tuple[subprocess.Popen[bytes], str]:
    cfg = compose_run(*queue_config(shape, total_groups, producers))
    run_dir = write_run_dir(root, cfg, TOKEN)
    declare_run_state(run_dir, newest_version=0)  # every group is version 0, rewards 0 or 1
    proc = start_role("queue", run_dir)
    return proc, wait_for_address(root, "queue", timeout=60)


def produce(url: str, batches: list[tuple[int, bytes]], resend: bool, load: Load,
            lock: threading.Lock) -> None:  # fmt: skip
    """Push each batch, then with `resend` the first again (a retry after a lost answer)."""
    headers = {"Content-Type": wire.CONTENT_TYPE}
    with httpx.Client(base_url=url, headers=headers, auth=token_auth(TOKEN), timeout=120) as client:
        for number, body in batches + batches[:1] * resend:
            start = time.perf_counter()
            response = client.post("/push", params={"batch": number}, content=body)
            elapsed = time.perf_counter() - start
            with lock:
                if response.status_code != 200:
                    status, text = response.status_code, response.text[:200]
                    load.errors.append(f"push {number}: HTTP {status} {text}")
                elif response.json().get("duplicate"):
                    load.duplicates_refused += 1
                else:
                    load.push_s.append(elapsed)
                    load.pushed_bytes += len(body)


def pull(url: str, rank: int, world: int, steps: int, deadline: float, load: Load,
         lock: threading.Lock) -> None:  # fmt: skip
    """Fetch this rank's shard of every step in order, as a trainer rank does."""
    accept = {"Accept": wire.CONTENT_TYPE}
    with httpx.Client(base_url=url, headers=accept, auth=token_auth(TOKEN), timeout=120) as client:
        step = 0
        while step < steps and time.monotonic() < deadline:
            params = {"step": step, "rank": rank, "world": world, "wait": 10}
            start = time.perf_counter()
            response = client.get("/batch", params=params)
            elapsed = time.perf_counter() - start
            if response.status_code == 204:
                continue
            if response.status_code != 200:
                with lock:
                    load.errors.append(f"rank {rank} step {step}: HTTP {response.status_code}")
                return
            pairs = served_pairs(response.content)
            with lock:
                load.pull_s.append(elapsed)
                load.served[step, rank] = pairs
            step += 1


def served_pairs(shard: bytes) -> list[tuple[int, int]]:
    """The (group id, sample index) of each sample in a binary /batch reply."""
    [part], _ = wire.decode(shard, lists=False)
    return [(int(s["prompt_ids"][0]), int(s["prompt_ids"][1])) for s in part["samples"]]


def run_load(url: str, bodies: list[list[tuple[int, bytes]]], ranks: int, steps: int,
             timeout_s: float, resend: bool = True) -> Load:  # fmt: skip
    """Producers (one per list in `bodies`, each resending its first batch with `resend`) and
    `ranks` pullers at once, until every rank has `steps` shards or `timeout_s` passes."""
    load, lock = Load(), threading.Lock()
    deadline = time.monotonic() + timeout_s
    with ThreadPoolExecutor(len(bodies) + ranks) as pool:
        pullers = [
            pool.submit(pull, url, r, ranks, steps, deadline, load, lock) for r in range(ranks)
        ]
        start = time.perf_counter()
        producers = [pool.submit(produce, url, b, resend, load, lock) for b in bodies]
        for future in producers:
            future.result()
        load.push_wall_s = time.perf_counter() - start
        for future in pullers:
            future.result()
    return load


def problems(load: Load, shape: Shape, ranks: int, steps: int) -> list[str]:
    """Every way the served shards differ from each pushed group served exactly once, whole,
    in one step; empty when they agree."""
    found = list(load.errors)
    missing = [(s, r) for s in range(steps) for r in range(ranks) if (s, r) not in load.served]
    if missing:
        found.append(f"{len(missing)} shards never served, first {missing[0]} (step, rank)")
    seen: Counter[tuple[int, int]] = Counter()
    step_of: dict[int, set[int]] = {}
    for (step, _), pairs in load.served.items():
        seen.update(pairs)
        for gid, _ in pairs:
            step_of.setdefault(gid, set()).add(step)
    twice = [pair for pair, n in seen.items() if n > 1]
    if twice:
        found.append(f"{len(twice)} samples served twice, first (group, index) {twice[0]}")
    split = [gid for gid, where in step_of.items() if len(where) > 1]
    if split:
        found.append(f"{len(split)} groups split across steps, first {split[0]}")
    expected = {(g, i) for g in range(steps * shape.prompts) for i in range(shape.group_size)}
    if not missing and set(seen) != expected:
        found.append(f"{len(expected - set(seen))} samples lost, {len(set(seen) - expected)} odd")
    return found


def percentile(values: list[float], q: float) -> float:
    return 1000 * float(np.percentile(values, q)) if values else float("nan")


def ingest(url: str, bodies: list[list[tuple[int, bytes]]]) -> float:
    """MB/s of the pushes alone (nobody pulling), every producer at once."""
    load = run_load(url, bodies, ranks=0, steps=0, timeout_s=600, resend=False)
    if load.errors:
        raise SystemExit(f"ingest run failed: {load.errors[:3]}")
    return load.pushed_bytes / load.push_wall_s / 1e6


def serve_sink() -> None:
    """An HTTP server whose /push reads the body and drops it: the same HTTP stack as the
    queue (uvicorn, FastAPI) with the queue's work left out."""
    app = FastAPI()

    @app.post("/push")
    async def push(request: Request) -> dict[str, list[int]]:
        return {"ids": [len(await request.body())]}

    sock = listen_socket("127.0.0.1", 0)
    print(sock.getsockname()[1], flush=True)
    uvicorn.Server(
        uvicorn.Config(app, log_level="warning", http=os.environ.get("SINK_HTTP", "auto"))
    ).run(sockets=[sock])


def sink_ingest(bodies: list[list[tuple[int, bytes]]]) -> float:
    """`ingest` into `serve_sink`, run as a process of its own like the queue."""
    command = [sys.executable, "-m", "benchmarks.queue_load", "--sink"]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, start_new_session=True)
    try:
        port = int(proc.stdout.readline())  # type: ignore[union-attr]
        return ingest(f"http://127.0.0.1:{port}", bodies)
    finally:
        stop_role(proc)


def disk_mb_per_s(folder: Path, bodies: list[bytes]) -> float:
    """Append the same bodies to a file in `folder`, fsyncing after each, as a durable log would:
    the ceiling of any store that syncs every push to this disk."""
    start = time.perf_counter()
    with open(folder / "disk-probe", "wb") as f:
        for body in bodies:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    (folder / "disk-probe").unlink()
    return sum(map(len, bodies)) / elapsed / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--producers", type=int, default=16)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--pushes", type=int, default=2, help="batches each producer pushes")
    parser.add_argument("--prompts", type=int, default=Shape.prompts)
    parser.add_argument("--group-size", type=int, default=Shape.group_size)
    parser.add_argument("--prompt-tokens", type=int, default=Shape.prompt_tokens)
    parser.add_argument("--completion-tokens", type=int, default=Shape.completion_tokens)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--sink", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sink:
        return serve_sink()
    shape = Shape(args.prompts, args.group_size, args.prompt_tokens, args.completion_tokens)
    rng = np.random.default_rng(0)
    steps = args.producers * args.pushes
    bodies = [
        [(n, make_push(n, shape, rng)) for n in range(p, steps, args.producers)]
        for p in range(args.producers)
    ]
    step_mb = len(bodies[0][0][1]) / 1e6
    print(
        f"{args.producers} producers x {args.pushes} pushes, {args.ranks} ranks; a step is "
        f"{shape.prompts} groups x {shape.group_size} samples of {shape.prompt_tokens} prompt + "
        f"{shape.completion_tokens} completion tokens = {step_mb:.1f} MB binary"
    )
    flat = [body for producer in bodies for _, body in producer]
    raw_before = raw_loopback_mb_per_s(flat)
    sink = sink_ingest(bodies)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_queue(Path(tmp) / "load", shape, steps * shape.prompts, args.producers)
        try:
            load = run_load(url, bodies, args.ranks, steps, args.timeout)
        finally:
            stop_role(proc)
        proc, url = start_queue(Path(tmp) / "ingest", shape, steps * shape.prompts, args.producers)
        try:
            alone = ingest(url, bodies)
        finally:
            stop_role(proc)
        disk = disk_mb_per_s(Path(tmp), flat)
    raw = (raw_before + raw_loopback_mb_per_s(flat)) / 2
    found = problems(load, shape, args.ranks, steps)
    verdict = "; ".join(found) if found else "no group lost or served twice"
    print(f"groups: {steps * shape.prompts} pushed, duplicate pushes ignored: "
          f"{load.duplicates_refused}/{args.producers}; {verdict}")  # fmt: skip
    print(f"\n{'latency under load':<40} {'p50 ms':>8} {'p99 ms':>8} {'requests':>9}")
    for name, values in (("push (one step)", load.push_s), ("pull (one shard)", load.pull_s)):
        print(f"{name:<40} {percentile(values, 50):>8.1f} {percentile(values, 99):>8.1f} "
              f"{len(values):>9}")  # fmt: skip
    under_load = load.pushed_bytes / load.push_wall_s / 1e6
    print(f"\n{'ingest, same bytes':<40} {'MB/s':>8} {'of raw':>8}")
    rows = [
        ("raw loopback TCP (mean of before, after)", raw),
        ("HTTP sink (same stack, body dropped)", sink),
        ("queue, nobody pulling", alone),
        (f"queue, {args.ranks} ranks pulling", under_load),
        ("disk: append + fsync each push", disk),
    ]
    for name, value in rows:
        print(f"{name:<40} {value:>8.1f} {value / raw:>8.3f}")


if __name__ == "__main__":
    main()
