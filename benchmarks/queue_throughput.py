"""Rollout-queue throughput over loopback, against a raw TCP transfer of the same bytes.

Starts a real queue process, pushes realistic groups (16 samples x 1024 completion tokens with
logprobs, plus a 128-token prompt) one per request, then pulls them back as trainer batches.
Prints groups/s, MB/s and p50/p99 push latency for the binary wire format and for JSON, and the
ratio of the queue's MB/s to a raw loopback socket moving the same messages in the same run.

    uv run python benchmarks/queue_throughput.py [--groups 200]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from rl.core import wire
from rl.core.auth import token_auth
from rl.core.runtime import wait_for_address
from tests.support.runs import (
    TOKEN,
    compose_run,
    declare_run_state,
    start_role,
    stop_role,
    write_run_dir,
)

GROUPS_PER_STEP = 8


def make_group(rng: random.Random, version: int) -> dict:
    samples = []
    for _ in range(16):
        samples.append(
            {
                "prompt_ids": [rng.randrange(150_000) for _ in range(128)],
                "completion_ids": [rng.randrange(150_000) for _ in range(1024)],
                "logprobs": [-rng.random() * 5 for _ in range(1024)],
                "reward": rng.random(),
                "advantage": rng.random() - 0.5,
                "min_version": version,
                "max_version": version,
            }
        )
    return {"samples": samples, "min_version": version, "max_version": version}


def start_queue(run_dir: Path) -> subprocess.Popen[bytes]:
    cfg = compose_run(
        f"environment.prompts_per_step={GROUPS_PER_STEP}",
        "queue.capacity=100000",
        "queue.max_request_mb=256",
        "model.vocab_size=150000",  # the ids it pushes, and their length, fit the run
        "model.context_length=1152",
        "environment.max_context_tokens=1152",
        "algorithm.max_off_policy_steps=1000000",  # every group is version 0
    )
    write_run_dir(run_dir, cfg, TOKEN)
    declare_run_state(run_dir, newest_version=0)  # rewards in [0, 1), advantages in [-0.5, 0.5)
    return start_role("queue", run_dir)


def bench_queue(
    url: str, bodies: list[bytes], content_type: str, accept: str, first_step: int
) -> dict[str, float]:
    latencies = []
    with httpx.Client(base_url=url, auth=token_auth(TOKEN), timeout=120) as client:
        t0 = time.perf_counter()
        for body in bodies:
            start = time.perf_counter()
            response = client.post("/push", content=body, headers={"Content-Type": content_type})
            if response.status_code != 200:
                raise SystemExit(f"push: HTTP {response.status_code} {response.text}")
            latencies.append(time.perf_counter() - start)
        push_s = time.perf_counter() - t0
        pulled = 0
        t0 = time.perf_counter()
        for step in range(first_step, first_step + len(bodies) // GROUPS_PER_STEP):
            response = client.get("/batch", params={"step": step}, headers={"Accept": accept})
            if response.status_code != 200:
                raise SystemExit(f"step {step}: HTTP {response.status_code} {response.text}")
            pulled += len(response.content)
        pull_s = time.perf_counter() - t0
    latencies.sort()
    return {
        "push_groups_per_s": len(bodies) / push_s,
        "push_mb_per_s": sum(map(len, bodies)) / push_s / 1e6,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "pull_mb_per_s": pulled / pull_s / 1e6,
    }


def raw_loopback_mb_per_s(bodies: list[bytes]) -> float:
    """Send the same messages over one loopback TCP connection; receiver reads them all."""
    server = socket.create_server(("127.0.0.1", 0))
    total = sum(map(len, bodies))

    def receive() -> None:
        conn, _ = server.accept()
        got = 0
        while got < total:
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            got += len(chunk)
        conn.sendall(b"k")
        conn.close()

    thread = threading.Thread(target=receive)
    thread.start()
    client = socket.create_connection(server.getsockname())
    t0 = time.perf_counter()
    for body in bodies:
        client.sendall(body)
    client.recv(1)
    elapsed = time.perf_counter() - t0
    client.close()
    thread.join()
    server.close()
    return total / elapsed / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=200)
    args = parser.parse_args()
    count = args.groups - args.groups % GROUPS_PER_STEP
    rng = random.Random(0)
    groups = [make_group(rng, 0) for _ in range(count)]
    binary = [wire.encode([g]) for g in groups]
    as_json = [json.dumps({"groups": [g]}).encode() for g in groups]
    print(f"{count} groups; one group is {len(binary[0]) / 1e6:.2f} MB binary, "
          f"{len(as_json[0]) / 1e6:.2f} MB JSON")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_queue(Path(tmp))
        try:
            url = wait_for_address(Path(tmp), "queue", timeout=60)
            steps = count // GROUPS_PER_STEP
            binary_type, json_type = wire.CONTENT_TYPE, "application/json"
            rows = {
                "json": bench_queue(url, as_json, json_type, json_type, 0),
                "binary": bench_queue(url, binary, binary_type, binary_type, steps),
            }
        finally:
            stop_role(proc)
    raw = raw_loopback_mb_per_s(binary)
    print(f"{'format':<8} {'groups/s':>9} {'push MB/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'pull MB/s':>10} {'push/raw':>9}")  # fmt: skip
    for name, r in rows.items():
        print(
            f"{name:<8} {r['push_groups_per_s']:>9.1f} {r['push_mb_per_s']:>10.1f} "
            f"{r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['pull_mb_per_s']:>10.1f} "
            f"{r['push_mb_per_s'] / raw:>9.3f}"
        )
    print(f"raw loopback TCP, same bytes: {raw:.1f} MB/s")


if __name__ == "__main__":
    main()
