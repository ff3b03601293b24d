"""A live run under a hostile load: the main job (reverse-text, embedded CPU inference; groups
without signal kept, so that every step generates the same 256 samples and steps compare) runs
while, for `--load-s` seconds from step `--load-from`, callers holding the run's API key
(`<run dir>/api_key`) or its admin key try what a holder of a key could try:

- streams of n=512 choices that disconnect after their first event, `--stream-rate` a second
  (63: what was measured against a live run), sent at that rate whatever the answers;
- 1 MB prompts, one to /v1/completions and one to /v1/chat/completions every `--megabyte-every`
  seconds (a tiny-model server holds 128 tokens: at most 640 bytes of text);
- once a second: the broadcast attack (their own weight group at version 10^9, with the API and
  admin keys), a forged push to the queue (with the API key; and with the push key, ids outside
  the vocabulary) and an 8 MB chat message;
- a corrupt weights file: every fifth version the trainer publishes under the load
  (`--corrupt-every`; 0: none) is overwritten with garbage before the orchestrator loads it,
  when this script sees it first.

The attackers run in this process, on the run's own cores; every loop is bounded by the load's
seconds, and every request goes to the run's own servers on 127.0.0.1. /health of the inference
server is polled throughout. At the end it prints what each attack got (and how long the
answers took), the rate the streams were sent at, the generation and step time per step before,
during and after the load (and the ratio to before: the goal is generation within 1.33x of
quiet, the run's rollouts keeping 75% of their speed; also per 256 samples, should a step
generate more than one round), the cores other processes on the machine took in each phase
(another job's load spoils the comparison), whether every step was recorded once, how the run
ended, and what the verification costs: the SHA-256 of a published version (trainer and server
each compute it once) and the token-id check of one batch, as shares of a step.

    uv run python benchmarks/hostile_load.py [--steps 300] [--load-from 80] [--load-s 30]
        [--stream-rate 63] [--megabyte-every 1] [--corrupt-every 5] [rl overrides...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from rl.core.auth import derive
from rl.core.derive import max_model_len
from rl.core.paths import ROOT
from rl.core.records import RunLimits, Sample
from rl.core.rundir import RunDir, checksum_problem, is_complete
from rl.core.runtime import load_run_config

BROADCAST = {
    "version": 10**9,
    "member": "inference-0",
    "group": {"host": "127.0.0.1", "port": 1, "world_size": 2, "backend": "gloo",
              "timeout_s": 60.0, "group": "hostile"},
}  # fmt: skip


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def train_records(run: RunDir) -> list[dict]:
    return [r for r in run.read_metrics() if r.get("kind") == "train"]


def current_step(run: RunDir) -> int:
    return max((r["step"] for r in train_records(run)), default=-1)


def encoded(body: dict[str, Any]) -> bytes:
    """A JSON body encoded once (an attacker replays the same bytes)."""
    return json.dumps(body).encode()


FORGED = encoded({"groups": [{"samples": [{"prompt_ids": [1], "completion_ids": [1000],
                  "logprobs": [-1.0], "reward": 1.0, "advantage": 1.0, "min_version": 0,
                  "max_version": 0}], "min_version": 0, "max_version": 0}]})  # fmt: skip
HUGE = encoded({"messages": [{"role": "user", "content": "x" * 8_000_000}], "max_tokens": 4})
STREAM = encoded({"prompt": "hello", "n": 512, "max_tokens": 64, "stream": True,
                  "temperature": 1.0})  # fmt: skip
MEGABYTE = {
    "completions": encoded({"prompt": "x" * 1_000_000, "max_tokens": 4}),
    "chat/completions": encoded(
        {"messages": [{"role": "user", "content": "x" * 1_000_000}], "max_tokens": 4}
    ),
}


def json_headers(key: str) -> dict[str, str]:
    return {**bearer(key), "Content-Type": "application/json"}


def probes(run: RunDir, http: httpx.Client, got: Counter) -> None:
    """One round of the attacks on other routes than the completions (repeated by the caller
    once a second while the load lasts); a probe that gets no answer is counted so."""
    inference = run.read_address("inference-0")
    queue = run.read_address("queue")
    keys = derive(run.token())
    api, admin = keys["inference"], keys["admin"]
    broadcast = encoded(BROADCAST)
    sent = [
        ("broadcast with the api key", "/admin/weights/broadcast", inference, broadcast, api),
        ("broadcast with the admin key", "/admin/weights/broadcast", inference, broadcast, admin),
        ("forged push with the api key", "/push", queue, FORGED, api),
        ("push of id 1000 with the push key", "/push", queue, FORGED, keys["queue-push"]),
        ("8 MB chat message", "/v1/chat/completions", inference, HUGE, api),
    ]
    for name, route, url, body, key in sent:
        try:
            answer = http.post(url + route, content=body, headers=json_headers(key))
            status: int | str = answer.status_code
        except httpx.HTTPError as err:
            status = type(err).__name__
        got[f"{name}: {status}"] += 1


class Load:
    """The completions attacks, sent from an event loop of their own at a fixed rate (an
    answer's delay does not slow the sending): what each got, and its answers' seconds."""

    def __init__(self, run: RunDir, stream_rate: float, megabyte_every: float) -> None:
        self.url = run.read_address("inference-0")
        self.headers = json_headers(derive(run.token())["inference"])
        self.stream_rate, self.megabyte_every = stream_rate, megabyte_every
        self.got: Counter = Counter()
        self.seconds: dict[str, list[float]] = {}
        self.streams_sent = 0
        self.sending_s = 0.0
        self.stop = threading.Event()

    def _count(self, what: str, status: int | str, start: float) -> None:
        name = f"{what}: {status}"
        self.got[name] += 1
        self.seconds.setdefault(name, []).append(time.perf_counter() - start)

    async def _stream(self, http: httpx.AsyncClient) -> None:
        start = time.perf_counter()
        try:
            url = f"{self.url}/v1/completions"
            stream = http.stream("POST", url, content=STREAM, headers=self.headers)
            async with stream as response:
                async for _ in response.aiter_bytes():
                    break  # gone after the first event
                self._count("disconnecting stream", response.status_code, start)
        except httpx.HTTPError as err:
            self._count("disconnecting stream", type(err).__name__, start)

    async def _megabyte(self, http: httpx.AsyncClient, route: str) -> None:
        start = time.perf_counter()
        try:
            url, body = f"{self.url}/v1/{route}", MEGABYTE[route]
            r = await http.post(url, content=body, headers=self.headers)
            self._count(f"1 MB prompt to /v1/{route}", r.status_code, start)
        except httpx.HTTPError as err:
            self._count(f"1 MB prompt to /v1/{route}", type(err).__name__, start)

    async def _send(self) -> None:
        loop = asyncio.get_running_loop()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        running: set[asyncio.Task] = set()

        def launch(work: Any) -> None:
            task = loop.create_task(work)
            running.add(task)
            task.add_done_callback(running.discard)

        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            began = loop.time()
            next_stream, next_megabyte = began, began
            while not self.stop.is_set():
                now = loop.time()
                if now >= next_stream:
                    launch(self._stream(http))
                    self.streams_sent += 1
                    next_stream += 1 / self.stream_rate
                if now >= next_megabyte:
                    launch(self._megabyte(http, "completions"))
                    launch(self._megabyte(http, "chat/completions"))
                    next_megabyte += self.megabyte_every
                await asyncio.sleep(max(0.0, min(next_stream, next_megabyte) - loop.time()))
            self.sending_s = loop.time() - began
            await asyncio.gather(*running)

    def run(self) -> None:
        asyncio.run(self._send())

    def report(self) -> dict[str, Any]:
        seconds = {k: round(statistics.median(v), 3) for k, v in sorted(self.seconds.items())}
        return {
            "streams_per_s": round(self.streams_sent / max(self.sending_s, 1e-9), 1),
            "answer_s_median": seconds,
        }


def corrupt_new_versions(run: RunDir, stop: threading.Event, got: Counter, every: int) -> None:
    """Overwrite every `every`-th newly published version's weights with garbage as soon as it
    appears (each refused version leaves generation a step further behind the trainer). The
    trainer records a version once it is whole: the record is looked at every 2 ms (a stat)
    and read when it changed."""
    seen = set(run.published_versions())
    stamp: tuple[int, int] | None = None
    while not stop.is_set():
        try:
            stat = run.published_record.stat()
            now: tuple[int, int] | None = (stat.st_ino, stat.st_mtime_ns)
        except FileNotFoundError:
            now = None
        if now != stamp:
            stamp = now
            for version in run.published_versions():
                if version not in seen:
                    seen.add(version)
                    if len(seen) % every == 0:
                        weights = run.weights_for(version) / "model.safetensors"
                        weights.write_bytes(b"\0" * 4096)
                        got["versions corrupted"] += 1
        time.sleep(0.002)


def cpu_seconds(root: int) -> tuple[float, float]:
    """CPU seconds used so far by the whole machine, and by the process tree of `root` and
    this process (the run and its attackers), from /proc (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    jiffies = [int(v) for v in Path("/proc/stat").read_text().split()[1:9]]
    busy = sum(jiffies) - jiffies[3] - jiffies[4]  # all but idle and iowait
    parents, used = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        pid = int(stat.parent.name)
        parents[pid], used[pid] = int(fields[1]), int(fields[11]) + int(fields[12])
    ours = {os.getpid(), root}
    for pid in sorted(parents):
        chain, at = [], pid
        while at in parents and at not in ours and at > 1:
            chain.append(at)
            at = parents[at]
        if at in ours:
            ours.update(chain)
    return busy / tick, sum(used.get(pid, 0) for pid in ours) / tick


def others_cores(marks: list[tuple[float, float, float]]) -> list[float]:
    """Cores used by processes outside the run and its attackers between consecutive marks
    (time, machine CPU seconds, the run's): what another job on the machine took."""
    return [
        round(((b[1] - a[1]) - (b[2] - a[2])) / (b[0] - a[0]), 2)
        for a, b in zip(marks, marks[1:], strict=False)
    ]


def watch_health(run: RunDir, stop: threading.Event, seen: Counter, last: int) -> None:
    """Poll /health until the run's last step (then the servers stop, as they should)."""
    with httpx.Client(timeout=5) as http:
        while not stop.is_set() and current_step(run) < last - 1:
            url = run.read_address("inference-0")
            try:
                body = http.get(f"{url}/health").json()
                seen[f"{body.get('status')} receiving={body.get('receiving')}"] += 1
            except httpx.HTTPError as err:
                seen[f"unreachable ({type(err).__name__})"] += 1
            time.sleep(0.2)


def phase_times(run: RunDir, loaded: tuple[int, int]) -> dict[str, dict[str, float]]:
    """Mean generation and step seconds per step before, during and after the load, which ran
    while the trainer recorded steps `loaded` (first, last). A step generates while the one
    before it trains, so the steps at each edge, half loaded, are left out."""
    records = run.read_metrics()
    rollouts = {r["step"]: r for r in records if r.get("kind") == "rollout"}
    train = {r["step"]: r for r in records if r.get("kind") == "train"}
    first, last = loaded
    out = {}
    for name, (lo, hi) in {
        "before": (5, first),
        "during": (first + 2, last + 1),
        "after": (last + 3, max(train) + 1),
    }.items():
        steps = [s for s in range(lo, hi) if s in rollouts and s in train]
        generate = [rollouts[s]["time/generate"] for s in steps]
        samples = [rollouts[s]["samples/generated"] for s in steps]
        out[name] = {
            "steps": len(steps),
            "generate_s": statistics.mean(generate),
            # A step generates more than one round of samples when the groups without
            # signal are filtered out, more often as the policy learns.
            "samples_per_step": statistics.mean(samples),
            "generate_s_per_256_samples": 256 * sum(generate) / sum(samples),
            "step_s": statistics.mean(train[s]["time/step"] for s in steps),
        }
    return out


def verification_cost(run: RunDir, step_s: float) -> dict[str, float]:
    """Seconds of the checksum of one published version and of the id check of one batch's
    samples (as many as a step trains on), and each as a share of a step."""
    version = max(
        v for v in run.published_versions() if checksum_problem(run.weights_for(v)) is None
    )
    t0 = time.perf_counter()
    for _ in range(5):
        checksum_problem(run.weights_for(version))
    checksum_s = (time.perf_counter() - t0) / 5
    cfg = load_run_config(run.root)
    limits = RunLimits(cfg.model.vocab_size, max_model_len(cfg))
    half = max_model_len(cfg) // 2  # samples as long as a batch's could be
    rows = cfg.environment.prompts_per_step * cfg.environment.group_size
    ids = [i % cfg.model.vocab_size for i in range(half)]
    samples = [Sample(ids, ids, [-1.0] * half, 0.0, 0.0, 0, 0) for _ in range(rows)]
    t0 = time.perf_counter()
    for _ in range(20):
        for i, sample in enumerate(samples):
            limits.check(sample, f"sample {i}")
    ids_s = (time.perf_counter() - t0) / 20
    # The trainer hashes each version once as it publishes, the server once as it loads.
    return {
        "checksum_s": checksum_s,
        "checksum_share": 2 * checksum_s / step_s,
        "id_check_s": ids_s,
        "id_check_share": 2 * ids_s / step_s,  # the queue's check and the trainer's
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--load-from", type=int, default=80, help="the step the load starts at")
    parser.add_argument("--load-s", type=float, default=30.0, help="how long the load lasts")
    parser.add_argument("--stream-rate", type=float, default=63.0)
    parser.add_argument("--megabyte-every", type=float, default=1.0)
    parser.add_argument("--corrupt-every", type=int, default=5, help="0: corrupt none")
    args, extra = parser.parse_known_args()
    out = Path(tempfile.mkdtemp(prefix="hostile-")) / "run"
    argv = [sys.executable, "-m", "launcher.cli", f"max_steps={args.steps}",
            "environment.eval_every=0", "algorithm.filter_zero_advantage=false",
            f"hydra.run.dir={out}", *extra]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled"}
    launcher = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    run = RunDir(out)
    got, health = Counter(), Counter()
    stop_health, stop_load = threading.Event(), threading.Event()
    marks: list[tuple[float, float, float]] = []  # (time, machine CPU s, the run's CPU s)

    def mark() -> None:
        marks.append((time.monotonic(), *cpu_seconds(launcher.pid)))

    def wait_for_step(step: int) -> None:
        while current_step(run) < step and launcher.poll() is None:
            time.sleep(0.2)

    while run.read_address("inference-0") is None or not is_complete(run.weights_for(0)):
        if launcher.poll() is not None:
            sys.exit(f"the run ended before it served: see {out}")
        time.sleep(0.5)
    poll = (run, stop_health, health, args.steps)
    threading.Thread(target=watch_health, args=poll, daemon=True).start()
    wait_for_step(5)
    mark()
    wait_for_step(args.load_from)
    first = current_step(run)
    mark()
    print(f"load from step {first}", flush=True)
    corrupter = threading.Thread(
        target=corrupt_new_versions, args=(run, stop_load, got, args.corrupt_every)
    )
    if args.corrupt_every:
        corrupter.start()
    load = Load(run, args.stream_rate, args.megabyte_every)
    sender = threading.Thread(target=load.run)
    sender.start()
    rounds, ends = 0, time.monotonic() + args.load_s
    # Ended early should the run near its last steps: the "after" phase needs some.
    with httpx.Client(timeout=30) as http:
        while time.monotonic() < ends and current_step(run) < args.steps - 20:
            if launcher.poll() is not None:
                break
            probes(run, http, got)
            rounds += 1
            time.sleep(max(0.0, min(1.0, ends - time.monotonic())))
    load.stop.set()
    stop_load.set()
    if args.corrupt_every:
        corrupter.join()
    last = current_step(run)
    mark()
    sender.join()
    print(f"load ends at step {last} after {rounds} rounds", flush=True)
    wait_for_step(args.steps - 3)
    mark()
    got.update(load.got)
    console, _ = launcher.communicate()
    stop_health.set()
    steps = [r["step"] for r in train_records(run)]
    summary = json.loads((out / "summary.json").read_text())
    times = phase_times(run, (first, last))
    before, during = times["before"], times["during"]
    ratio = during["generate_s"] / before["generate_s"]
    per_sample = during["generate_s_per_256_samples"] / before["generate_s_per_256_samples"]
    report = {
        "run": str(out),
        "exit": launcher.returncode,
        "status": summary.get("status"),
        "steps_recorded_once": len(steps) == len(set(steps)) == args.steps,
        "attacks": dict(sorted(got.items())),
        "load": load.report(),
        "health": dict(health),
        "refused_versions_logged": (
            run.log("orchestrator").read_text().count("refused by inference")
        ),
        "phases": times,
        # Another job on the machine slows a phase without the load: this says how much.
        "other_processes_cores": dict(zip(times, others_cores(marks), strict=True)),
        "generate_ratio_during": ratio,
        "generate_ratio_during_per_sample": per_sample,
        "generate_ratio_after": times["after"]["generate_s"] / before["generate_s"],
        "verification": verification_cost(run, before["step_s"]),
        "console_tail": console.strip().splitlines()[-3:],
    }
    print(json.dumps(report, indent=1))
    print(
        f"generation per step: quiet {before['generate_s']:.3f} s, under the load "
        f"{during['generate_s']:.3f} s: {ratio:.2f}x (goal: within 1.33x); per 256 samples "
        f"{before['generate_s_per_256_samples']:.3f} s and "
        f"{during['generate_s_per_256_samples']:.3f} s: {per_sample:.2f}x"
    )


if __name__ == "__main__":
    main()
