"""A live run under a hostile load: the main job (reverse-text, embedded CPU inference) runs
while, for a window of its steps, callers holding the run's API key (`<run dir>/api_key`) or its
admin key try what a holder of a key could try:

- the broadcast attack: their own weight group at version 10^9 (with the API and admin keys);
- a forged push to the queue (with the API key; and with the push key, ids outside the
  vocabulary);
- an 8 MB chat message;
- streams of n=512 choices that disconnect after their first event (`--streams` of them);
- a corrupt weights file: every fifth version the trainer publishes in the window
  (`--corrupt-every`) is overwritten with garbage before the orchestrator loads it, when this
  script sees it first.

/health of the inference server is polled throughout. At the end it prints what each attack
got, the generation and step time per step before, during and after the window (and the ratio
to before), whether every step was recorded once, how the run ended, and what the verification
costs: the SHA-256 of a published version (trainer and server each compute it once) and the
token-id check of one batch, as shares of a step.

    uv run python benchmarks/hostile_load.py [--steps 120] [--window 40 80] [--streams 100]
        [--corrupt-every 5] [rl overrides...]
"""

from __future__ import annotations

import argparse
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


def attacks(run: RunDir, streams: int, got: Counter) -> None:
    """One round of every attack (repeated by the caller while the window lasts)."""
    inference = run.read_address("inference-0")
    queue = run.read_address("queue")
    keys = derive(run.token())
    api, admin = keys["inference"], keys["admin"]
    with httpx.Client(timeout=30) as http:
        for name, key in (("api", api), ("admin", admin)):
            r = http.post(
                f"{inference}/admin/weights/broadcast", json=BROADCAST, headers=bearer(key)
            )
            got[f"broadcast with the {name} key: {r.status_code}"] += 1
        forged = {"groups": [{"samples": [{"prompt_ids": [1], "completion_ids": [1000],
                  "logprobs": [-1.0], "reward": 1.0, "advantage": 1.0, "min_version": 0,
                  "max_version": 0}], "min_version": 0, "max_version": 0}]}  # fmt: skip
        r = http.post(f"{queue}/push", json=forged, headers=bearer(api))
        got[f"forged push with the api key: {r.status_code}"] += 1
        r = http.post(f"{queue}/push", json=forged, headers=bearer(keys["queue-push"]))
        got[f"push of id 1000 with the push key: {r.status_code}"] += 1
        huge = {"messages": [{"role": "user", "content": "x" * 8_000_000}], "max_tokens": 4}
        r = http.post(f"{inference}/v1/chat/completions", json=huge, headers=bearer(api))
        got[f"8 MB chat message: {r.status_code}"] += 1
    body = {"prompt": "hello", "n": 512, "max_tokens": 64, "stream": True, "temperature": 1.0}

    def disconnecting() -> None:
        with httpx.Client(timeout=30) as http:
            url = f"{inference}/v1/completions"
            with http.stream("POST", url, json=body, headers=bearer(api)) as response:
                for _ in response.iter_bytes():
                    break  # gone after the first event
                got[f"disconnecting stream: {response.status_code}"] += 1

    threads = [threading.Thread(target=disconnecting) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def corrupt_new_versions(run: RunDir, stop: threading.Event, got: Counter, every: int) -> None:
    """Overwrite every `every`-th newly published version's weights with garbage as soon as it
    appears (each refused version leaves generation a step further behind the trainer)."""
    seen = set(run.published_versions())
    while not stop.is_set():
        for version in run.published_versions():
            if version not in seen:
                seen.add(version)
                if len(seen) % every == 0:
                    (run.weights_for(version) / "model.safetensors").write_bytes(b"\0" * 4096)
                    got["versions corrupted"] += 1
        time.sleep(0.002)


def watch_health(run: RunDir, stop: threading.Event, seen: Counter, last: int) -> None:
    """Poll /health until the run's last step (then the servers stop, as they should)."""
    while not stop.is_set() and current_step(run) < last - 1:
        url = run.read_address("inference-0")
        try:
            body = httpx.get(f"{url}/health", timeout=5).json()
            seen[f"{body.get('status')} receiving={body.get('receiving')}"] += 1
        except httpx.HTTPError as err:
            seen[f"unreachable ({type(err).__name__})"] += 1
        time.sleep(0.2)


def phase_times(run: RunDir, window: tuple[int, int]) -> dict[str, dict[str, float]]:
    records = run.read_metrics()
    rollouts = {r["step"]: r for r in records if r.get("kind") == "rollout"}
    train = {r["step"]: r for r in records if r.get("kind") == "train"}
    out = {}
    for name, (lo, hi) in {
        "before": (5, window[0]),
        "during": window,
        "after": (window[1], max(train) + 1),
    }.items():
        steps = [s for s in range(lo, hi) if s in rollouts and s in train]
        out[name] = {
            "steps": len(steps),
            "generate_s": statistics.mean(rollouts[s]["time/generate"] for s in steps),
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
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--window", type=int, nargs=2, default=(40, 80))
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--corrupt-every", type=int, default=5)
    args, extra = parser.parse_known_args()
    out = Path(tempfile.mkdtemp(prefix="hostile-")) / "run"
    argv = [sys.executable, "-m", "launcher.cli", f"max_steps={args.steps}",
            "environment.eval_every=0", f"hydra.run.dir={out}", *extra]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled"}
    launcher = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    run = RunDir(out)
    got, health = Counter(), Counter()
    stop_health, stop_load = threading.Event(), threading.Event()
    while run.read_address("inference-0") is None or not is_complete(run.weights_for(0)):
        if launcher.poll() is not None:
            sys.exit(f"the run ended before it served: see {out}")
        time.sleep(0.5)
    poll = (run, stop_health, health, args.steps)
    threading.Thread(target=watch_health, args=poll, daemon=True).start()
    while current_step(run) < args.window[0] and launcher.poll() is None:
        time.sleep(0.5)
    print(f"load from step {current_step(run)}", flush=True)
    corrupter = threading.Thread(
        target=corrupt_new_versions, args=(run, stop_load, got, args.corrupt_every)
    )
    corrupter.start()
    rounds = 0
    while current_step(run) < args.window[1] and launcher.poll() is None:
        attacks(run, args.streams, got)
        rounds += 1
    stop_load.set()
    corrupter.join()
    print(f"load ends at step {current_step(run)} after {rounds} rounds", flush=True)
    console, _ = launcher.communicate()
    stop_health.set()
    steps = [r["step"] for r in train_records(run)]
    summary = json.loads((out / "summary.json").read_text())
    times = phase_times(run, tuple(args.window))
    before = times["before"]
    report = {
        "run": str(out),
        "exit": launcher.returncode,
        "status": summary.get("status"),
        "steps_recorded_once": len(steps) == len(set(steps)) == args.steps,
        "attacks": dict(sorted(got.items())),
        "health": dict(health),
        "refused_versions_logged": (
            run.log("orchestrator").read_text().count("refused by inference")
        ),
        "phases": times,
        "generate_ratio_during": times["during"]["generate_s"] / before["generate_s"],
        "generate_ratio_after": times["after"]["generate_s"] / before["generate_s"],
        "verification": verification_cost(run, before["step_s"]),
        "console_tail": console.strip().splitlines()[-3:],
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
