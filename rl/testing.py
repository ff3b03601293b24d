"""Helpers for tests and benchmarks: compose the real config tree as `rl` does, write a run
directory as the launcher does, and start or stop one role process by its process group.

Tests and benchmarks share these (benchmarks run without pytest), so they live in the package,
not in tests/conftest.py, which keeps only pytest fixtures and hooks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from omegaconf import DictConfig

from rl.config import ROLE_MODULES, register

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
TOKEN = "test-token"


def compose_run(*overrides: str) -> DictConfig:
    """The run config `rl <overrides>` would compose."""
    from hydra import compose, initialize_config_dir

    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def options(group: str) -> list[str]:
    """The options of a config group, as file stems under conf/<group>/."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def write_run_dir(run_dir: Path, cfg: DictConfig, token: str) -> Path:
    """A run directory as the launcher writes it: resolved config and the run token."""
    from rl.rundir import RunDir

    RunDir(run_dir).create(cfg, token)
    return run_dir


def start_role(role: str, run_dir: Path, *args: str) -> subprocess.Popen[bytes]:
    """A role's entry point in its own process group, logging to run_dir/<role>.log."""
    with open(run_dir / f"{role}.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", ROLE_MODULES[role], "--run-dir", str(run_dir), *args],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop_role(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, grace: float = 20) -> None:
    """End a role's process group by its id: `sig`, then SIGKILL after `grace` seconds."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def embedded_server(tmp_path_factory: Any, *overrides: str) -> Iterator[Any]:
    """A real embedded inference role (tiny model unless overridden) in a fresh cache and run
    directory, ended by its process group id. Yields cfg, run_dir and the model's tokenizer.
    `tmp_path_factory` is pytest's fixture of that name."""
    import pytest

    from rl.model import ensure_checkpoint, load_tokenizer
    from rl.runtime import wait_for_address

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RELAY_CACHE", str(tmp_path_factory.mktemp("relay_cache")))
        cfg = compose_run(*overrides)
        tokenizer = load_tokenizer(ensure_checkpoint(cfg.model, seed=cfg.seed))
        run_dir = write_run_dir(tmp_path_factory.mktemp("run"), cfg, TOKEN)
        proc = start_role("inference", run_dir, "--replica", "0")
        try:
            try:
                wait_for_address(run_dir, "inference-0", timeout=120)
            except TimeoutError:
                pytest.fail((run_dir / "inference.log").read_text())
            yield SimpleNamespace(cfg=cfg, run_dir=run_dir, tokenizer=tokenizer)
        finally:
            stop_role(proc)
