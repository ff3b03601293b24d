"""Runs and roles for tests and benchmarks: compose the real config tree as `rl` does, write a
run directory as the launcher does, start or stop one role process by its process group, and
run `rl` itself to the end, checking that no process of the run is left behind.

Benchmarks import these too (they run without pytest, so nothing here needs it at import).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from omegaconf import DictConfig

from launcher.clusters.run_dir import group_alive
from rl.core.config import ROLE_MODULES, register
from rl.core.paths import CONF, ROOT
from rl.core.rundir import RunDir

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
    RunDir(run_dir).create(cfg, token)
    return run_dir


def declare_run_state(
    run_dir: Path, newest_version: int, reward: tuple[float, float] = (0.0, 1.0),
    advantage: float = 1.0,
) -> None:  # fmt: skip
    """What the trainer and the orchestrator of a live run record, for a queue run without
    them: the newest policy version published (as the broadcast transport records it) and
    the score bounds a pushed sample must fit."""
    from rl.core.records import ScoreBounds

    run = RunDir(run_dir)
    run.weights.mkdir(parents=True, exist_ok=True)
    run.record_broadcast(newest_version)
    run.write_scores(ScoreBounds(reward, advantage).to_dict())


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

    from rl.core.model import ensure_checkpoint, load_tokenizer
    from rl.core.runtime import wait_for_address

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RELAY_CACHE", str(tmp_path_factory.mktemp("relay_cache")))
        cfg = compose_run(*overrides)
        tokenizer = load_tokenizer(ensure_checkpoint(cfg.model))
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


def assert_no_process_left(run_dir: Path) -> None:
    """No process group the run recorded, and no process naming its directory, is alive."""
    pids = RunDir(run_dir).read_pids()
    alive = [name for name, pgid in pids.items() if group_alive(pgid)]
    assert not alive, f"left behind: {alive}"
    deadline = time.monotonic() + 10  # a parent-death signal is delivered asynchronously
    while processes_of(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_of(run_dir), f"left behind: pids {processes_of(run_dir)}"


def run_to_end(run_dir: Path, cache: Path, *overrides: str, **env: str) -> list[dict]:
    """`rl` (SMALL, then `overrides`) run to the end in `run_dir`; its metrics.jsonl records."""
    out = subprocess.run(
        rl_command(run_dir, *overrides),
        cwd=ROOT,
        env=child_env(cache, **env),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert_no_process_left(run_dir)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


SMALL = [
    "warmup.steps=5",
    "environment.eval_size=16",
    "environment.prompts_per_step=8",
    "environment.group_size=4",
    "environment.eval_every=3",
]


def rl_command(run_dir: Path, *overrides: str) -> list[str]:
    """The `rl` command of a small run in `run_dir`."""
    return [sys.executable, "-m", "launcher.cli", *SMALL, f"hydra.run.dir={run_dir}", *overrides]


def child_env(cache: Path, **extra: str) -> dict[str, str]:
    """This environment with the model cache `cache` and `extra`."""
    return {**os.environ, "RELAY_CACHE": str(cache), **extra}


def processes_of(run_dir: Path) -> list[int]:
    """Live processes whose command line names the run directory (torchrun's ranks included),
    in whatever process group or session."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(run_dir).encode() in cmdline.read_bytes():
                stat = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()
                if stat[0] != "Z":
                    found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found
