"""pytest hooks: tests marked `gpu` are skipped where torch sees no CUDA device.

Helpers that tests and benchmarks share (composing a run, writing a run directory, starting a
role) live in tests/support/runs.py.
"""

from __future__ import annotations

import pytest


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
