"""The GPU figures' script (benchmarks/gpu_figures.py) on this CPU with the tiny model: every
part runs and reports what it measured; the GPU-only figures (peak memory, MFU, the HBM
bound) are null here. On the lent device `.ci/gpu-check` runs it with Qwen3-0.6B's shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import gpu_figures


def test_the_report_holds_every_figure(tmp_path: Path) -> None:
    args = ["--model", "tiny", "--tokens", "32", "64", "--batch", "4", "--prompt", "8"]
    args += ["--new", "4", "--steps", "1", "--no-compile", "--out", str(tmp_path / "r.json")]
    report = gpu_figures.main(args)
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(json.dumps(report))
    assert [t["tokens"] for t in report["trainer"]] == [32, 64]
    for figures in report["trainer"]:
        assert figures["tokens_per_s"] > 0 and figures["estimate_gib"] > 0
        assert figures["mfu"] is None and figures["peak_gib"] is None  # no GPU here
    decode = report["decode"]
    assert decode["tokens_per_s"] > 0 and decode["hbm_bound_tokens_per_s"] is None
    assert decode["estimate_gib"] > 0
    colocated = report["colocated"]
    # On CPU sleep frees the weights' storage and wake reads them back: all of it both ways.
    tiny_weights = 303_168 * 4 / 2**30  # float32
    assert colocated["released_gib"] == pytest.approx(colocated["awake_gib"])
    assert colocated["taken_back_gib"] == pytest.approx(colocated["awake_gib"])
    assert colocated["awake_gib"] == pytest.approx(tiny_weights, rel=0.05)
