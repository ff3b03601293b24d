"""What a trainer step costs each rank outside forward and backward, as the world grows: bytes
and seconds per rank for the batch fetch (its shard from the rollout queue), the step's record
(what rank 0 needs of the whole batch to write metrics.jsonl) and publishing the new version
(the weights gathered block by block, rank 0 writing `weights/step_N`), at trainer world 1, 2
and 4 (FSDP2 over gloo on this CPU) and batches of 256 and 1024 samples.

Bytes are what crossed each rank's TCP sockets (gloo's and the HTTP client's: the kernel's
`tcpi_bytes_received` + `tcpi_bytes_acked` of every TCP socket the process holds, read before
and after each phase), so they count what really moved, whatever the library. Files rank 0
writes are counted apart (the published version's files). The real queue role serves the batches;
the real `rl.trainer.loop.Trainer` fetches, records and publishes them. Forward and backward
are left out: they are the same work whatever the world (benchmarks/trainer_scaling.py).

    uv run python benchmarks/step_overheads.py [--worlds 1,2,4] [--batches 256,1024] [--steps 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import socket
import struct
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl.core import wire
from rl.core.runtime import Peer, run_auth
from tests.support.runs import (
    TOKEN,
    compose_run,
    declare_run_state,
    start_role,
    stop_role,
    write_run_dir,
)

MODEL = [  # a Qwen3 of 3.2M parameters (12.7 MB in float32)
    "model.num_layers=4",
    "model.hidden_size=256",
    "model.intermediate_size=768",
    "model.num_attention_heads=8",
    "model.num_kv_heads=4",
    "model.context_length=1024",
    "environment.max_context_tokens=1024",
]
GROUP = 8
PHASES = ("fetch", "record", "publish")
TCP_INFO_BYTES = 232
BYTES_ACKED_AT = 120  # struct tcp_info: tcpi_bytes_acked, then tcpi_bytes_received (u64)


def tcp_bytes() -> int:
    """Bytes this process has sent (and had acknowledged) and received over every TCP socket
    it holds now."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.fromfd(int(fd), socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            if (
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN)
                not in (
                    socket.AF_INET,
                    socket.AF_INET6,
                )
                or sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) != socket.SOCK_STREAM
            ):
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
            if len(info) >= BYTES_ACKED_AT + 16:
                acked, received = struct.unpack_from("QQ", info, BYTES_ACKED_AT)
                total += acked + received
        except OSError:
            pass
        finally:
            sock.close()
    return total


def files_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@contextmanager
def measured(into: dict[str, float], phase: str) -> Iterator[None]:
    """Adds the block's seconds and TCP bytes to `into` under `phase`."""
    t0, net0 = time.perf_counter(), tcp_bytes()
    yield
    into[f"{phase}_s"] = into.get(f"{phase}_s", 0.0) + time.perf_counter() - t0
    into[f"{phase}_net"] = into.get(f"{phase}_net", 0.0) + tcp_bytes() - net0


def groups(samples: int, step: int) -> list[dict[str, Any]]:
    """Scored groups of tool-episode-like samples: prompts of 100-400 tokens, 20-300 after."""
    rng = random.Random(step)
    out = []
    for _ in range(samples // GROUP):
        prompt = [1] + [rng.randint(4, 40) for _ in range(rng.randint(100, 400))]
        members = []
        for _ in range(GROUP):
            completion = [rng.randint(4, 40) for _ in range(rng.randint(20, 300))]
            members.append(
                {
                    "prompt_ids": prompt,
                    "completion_ids": completion,
                    "logprobs": [-1.0] * len(completion),
                    "reward": rng.random(),
                    "advantage": rng.uniform(-1, 1),
                    "min_version": step,
                    "max_version": step,
                }
            )
        out.append({"samples": members, "min_version": step, "max_version": step})
    return out


def push_steps(run_dir: Path, samples: int, steps: int) -> None:
    http = httpx.Client(auth=run_auth(run_dir), timeout=120)
    queue = Peer(run_dir, "queue", timeout=60)
    for step in range(steps):
        response = queue.request(
            http,
            "POST",
            "/push",
            params={"batch": step},
            content=wire.encode(groups(samples, step)),
            headers={"Content-Type": wire.CONTENT_TYPE},
        )
        response.raise_for_status()


def step_stats() -> dict[str, float]:
    """A step's loss numbers, as train_step returns them (their values do not matter here)."""
    from rl.trainer.metrics import SUMMED_STATS

    return {**dict.fromkeys(SUMMED_STATS, 0.0), "ratio_max": 1.0, "ratio_min": 1.0, "grad_norm": 0}


def rank_main(rank: int, world: int, init: str, run_dir: str, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from rl.trainer.loop import Trainer

    trainer = Trainer(Path(run_dir))
    logging.disable(logging.INFO)  # the trainer's step lines
    http = httpx.Client(auth=run_auth(Path(run_dir)), timeout=120)
    queue = Peer(Path(run_dir), "queue", timeout=60)
    trainer.publish(0)  # version 0 and the first connections: not counted
    totals: dict[str, float] = {}
    for step in range(steps):
        dist.barrier()
        with measured(totals, "fetch"):
            batch = trainer.fetch(http, queue, step)
        dist.barrier()
        with measured(totals, "record"):
            times = {"time/step": 1.0, "time/wait_batch": 0.0, "time/train": 1.0}
            trainer.record_step(step, batch, step_stats(), times)
        dist.barrier()
        with measured(totals, "publish"):
            trainer.publish(step + 1)
        if rank == 0:
            version = trainer.run_dir.weights_for(step + 1)
            totals["written"] = totals.get("written", 0.0) + files_bytes(version)
    per_step = {key: value / steps for key, value in totals.items()}
    every = [None] * world
    dist.all_gather_object(every, per_step)
    if rank == 0:
        torch.save(every, out)
    dist.destroy_process_group()


def measure(tmp: Path, world: int, samples: int, steps: int) -> list[dict[str, float]]:
    name = f"w{world}_b{samples}"
    option = "parallel=single" if world == 1 else "parallel=fsdp"
    cfg = compose_run(
        *MODEL,
        option,
        "trainer.device=cpu",
        f"environment.prompts_per_step={samples // GROUP}",
        f"environment.group_size={GROUP}",
        "queue.max_request_mb=256",
    )
    run_dir = write_run_dir(tmp / name, cfg, TOKEN)
    declare_run_state(run_dir, newest_version=steps)  # step N's groups are version N
    queue = start_role("queue", run_dir)
    try:
        push_steps(run_dir, samples, steps)
        out = tmp / f"{name}.pt"
        args = (world, str(tmp / f"init_{name}"), str(run_dir), steps, str(out))
        mp.spawn(rank_main, args=args, nprocs=world, join=True)
        return torch.load(out)
    finally:
        stop_role(queue)


def mb(value: float) -> str:
    return f"{value / 1e6:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2,4", help="trainer world sizes")
    parser.add_argument("--batches", default="256,1024", help="samples per step")
    parser.add_argument("--steps", type=int, default=3, help="steps measured per point")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    print(f"per rank per step, {args.steps} steps per point, {os.cpu_count()} CPUs; MB over TCP")
    head = "".join(f"{p + ' MB':>12}{p + ' s':>10}" for p in PHASES)
    print(f"{'batch':>6} {'world':>5} {'rank':>5}{head}{'version MB':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["RELAY_CACHE"] = str(Path(tmp) / "cache")
        for samples in batches:
            for world in worlds:
                ranks = measure(Path(tmp), world, samples, args.steps)
                for rank, row in enumerate(ranks):
                    cells = "".join(
                        f"{mb(row[f'{p}_net']):>12}{row[f'{p}_s']:>10.3f}" for p in PHASES
                    )
                    wrote = mb(row["written"]) if rank == 0 else ""
                    print(f"{samples:>6} {world:>5} {rank:>5}{cells}{wrote:>12}", flush=True)


if __name__ == "__main__":
    main()
