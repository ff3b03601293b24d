"""Weight updates of a LoRA run against full weights: bytes and publish + load latency.

For the tiny model and the ~31M-parameter one of weight_update.py, starts a real embedded
inference role for a LoRA run (`model.lora.rank`, attention projections) and, repeatedly,
publishes a new version and has the server load it, both ways a run could: the full weights
(`weights/step_N` in HF layout, what a full fine-tuning run moves) and the adapter alone (what a
LoRA run moves). Prints the bytes of each and the median publish and load times, and the ratios
full / adapter.

    uv run python benchmarks/lora_update.py [--rank 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.weight_update import LARGER, dir_bytes
from rl.core import lora
from rl.core.auth import token_auth
from rl.core.model import ensure_checkpoint, load_model, load_tokenizer, publish_weights
from rl.core.rundir import RunDir
from rl.core.runtime import wait_for_address
from rl.trainer import lora as lora_trainer
from rl.weights import lora as lora_weights
from tests.support.runs import TOKEN, compose_run, start_role, stop_role, write_run_dir


def measure(cfg, root: Path, repeats: int) -> dict[str, dict[str, float]]:
    run_dir = write_run_dir(root / cfg.model.name, cfg, TOKEN)
    layout = RunDir(run_dir)
    layout.weights.mkdir()
    proc = start_role("inference", run_dir, "--replica", "0")
    try:
        url = wait_for_address(run_dir, "inference-0", timeout=600)
        base = ensure_checkpoint(cfg.model)
        model, tok = lora_trainer.wrap(load_model(base), cfg.model), load_tokenizer(base)
        times: dict[str, dict[str, list[float]]] = {
            kind: {"publish": [], "load": [], "mb": []} for kind in ("full", "adapter")
        }
        with httpx.Client(base_url=url, auth=token_auth(TOKEN), timeout=600) as client:
            for step in range(repeats):
                with torch.no_grad():  # a new policy: the adapter moves
                    for name, p in model.named_parameters():
                        if lora.is_adapter_name(name):
                            p.add_(0.01)
                for kind in ("full", "adapter"):
                    version = 2 * step + (kind == "adapter")
                    target = layout.weights_for(version)
                    t0 = time.perf_counter()
                    if kind == "full":
                        publish_weights(model.get_base_model(), tok, target,
                                        lora_weights.base_tensors(model.state_dict()))  # fmt: skip
                    else:
                        lora_weights.publish(version, model, tok, None, layout)  # odd: an adapter
                    t1 = time.perf_counter()
                    body = {"path": str(target), "version": version}
                    client.post("/admin/load_weights", json=body).raise_for_status()
                    t2 = time.perf_counter()
                    times[kind]["publish"].append(t1 - t0)
                    times[kind]["load"].append(t2 - t1)
                    times[kind]["mb"].append(dir_bytes(target) / 1e6)
        return {k: {m: statistics.median(v) for m, v in t.items()} for k, t in times.items()}
    finally:
        stop_role(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'model':<6} {'kind':<8} {'MB':>8} {'publish s':>10} {'load s':>8} "
          f"{'full/adapter MB':>16} {'full/adapter s':>15}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("RELAY_CACHE", str(Path(tmp) / "cache"))
        for overrides in ([], LARGER):
            cfg = compose_run(*overrides, f"model.lora.rank={args.rank}")
            r = measure(cfg, Path(tmp), args.repeats)
            full, adapter = r["full"], r["adapter"]
            for kind, m in r.items():
                ratio_mb = full["mb"] / adapter["mb"] if kind == "adapter" else 1.0
                spent = m["publish"] + m["load"]
                ratio_s = (full["publish"] + full["load"]) / spent if kind == "adapter" else 1.0
                print(
                    f"{cfg.model.name:<6} {kind:<8} {m['mb']:>8.3f} {m['publish']:>10.4f} "
                    f"{m['load']:>8.4f} {ratio_mb:>16.1f} {ratio_s:>15.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
