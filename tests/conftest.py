"""pytest hooks: tests marked `gpu` are skipped where torch sees no CUDA device. The tests'
processes write Python's bytecode cache, as `rl`'s do (launcher/cli.py), even where
PYTHONDONTWRITEBYTECODE is set: each would otherwise compile torch from source again.

Helpers that tests and benchmarks share (composing a run, writing a run directory, starting a
role) live in tests/support/runs.py.
"""

from __future__ import annotations

import os
import sys

import pytest

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
