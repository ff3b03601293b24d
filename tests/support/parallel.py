"""What the parallel-layout tests share: a model cache, run directories of each layout, and
gradients compared against one process within a stated tolerance."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.runs import TOKEN, compose_run, write_run_dir

RTOL = 1e-5


def assert_same_gradients(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    scale = max(g.abs().max().item() for g in want.values())
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=RTOL * scale, msg=name)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("relay_cache")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("RELAY_CACHE", str(path))
        yield path


def prepare(tmp: Path, name: str, *overrides: str) -> tuple[Path, Path]:
    """A fresh run directory for one layout, and the init file its ranks meet at.

    Layouts sum gradients in other orders, so their gradients agree to rounding, and weights
    after optimiser steps agree only where a step is a smooth function of the gradient: Adam's
    default epsilon (1e-8) turns a gradient that is zero up to rounding into a step of +-lr,
    so these runs use 1e-3 (a step moves by at most lr / epsilon times a gradient's change).
    Clipping is off: it would scale every gradient by the norm's rounding too."""
    cfg = compose_run(
        "trainer.device=cpu",
        *overrides,
        "algorithm.max_grad_norm=1e9",
        "algorithm.adam_eps=1e-3",
    )
    run_dir = write_run_dir(tmp / name, cfg, TOKEN)
    return run_dir, tmp / f"init_{name}"
