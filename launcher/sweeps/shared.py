"""A sweep whose points share one inference service: `rl -m ... inference.shared=true`.

Hydra's basic launcher calls `launch` for each point in turn. With `inference.shared` a point
is checked (its plan, and that it can share the service with the points before it) and kept:
nothing starts yet. Once every point is known (Hydra's `on_multirun_end`: `SweepEnd` below),
`run_shared` runs them together on this machine:

1. The warm-up, once, in `base/`: every point's adapter must sit on the same base, so the
   sweep warms it up with the first point's settings and starts every point from its
   weights (each point's config records `model.path` and `warmup.steps=0`).
2. One inference service in `inference/`: the base, and under each point's name (`point-N`)
   that point's adapter, as many as there are points (`inference.max_loras`).
3. Side by side, each point's queue, orchestrator and trainer in its own run directory, a run
   of its own: metrics, summary, plot, progress lines prefixed with its name.

A point whose role fails (past `max_restarts`) ends alone, `failed` in its summary, and the
others go on; the service failing ends every point. Ctrl-C stops them all. Every point's
summary is written as it ends, and the sweep's table and plot once all have.
"""

from __future__ import annotations

import contextlib
import copy
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from launcher.clusters.base import cluster_of
from launcher.clusters.local.launch import Watch, record_pids, resume_command, start_children
from launcher.clusters.processes import (
    FINISHING_ROLES,
    POLL_S,
    Child,
    RunFailed,
    stop_children,
)
from launcher.errors import ConfigError, PlanError
from launcher.plan.planner import RunPlan, format_plan, plan
from launcher.sweeps.base import warm_up
from launcher.sweeps.summary import write_sweep_summary
from launcher.watch.report import finish_run, override, sweep_group
from launcher.watch.tracking import Follow
from rl.core.config import RunConfig
from rl.core.model import ensure_checkpoint
from rl.core.rundir import BASE, SERVICE, RunDir, flat, point_name, shared_service

# What points sharing one service may set apart: how each trains, never what is served.
VARIES = (
    "algorithm.",
    "model.lora.rank",
    "model.lora.alpha",
    "model.lora.dropout",
    "trainer.",
    "queue.",
    "seed",
    "max_steps",
    "max_restarts",
    "environment.seed",
    "environment.eval_every",
    "wandb.",
    "timeouts.",
)


@dataclass
class Point:
    """A sweep point checked and waiting for the others: its config (resolved) and the run
    directory Hydra made for it."""

    cfg: dict[str, Any]
    root: Path
    overrides: list[str]


PENDING: list[Point] = []
"""The points of the multirun under way (Hydra runs its jobs in this process)."""


def _varies(key: str) -> bool:
    return any(key == v or (v.endswith(".") and key.startswith(v)) for v in VARIES)


def typed(tree: dict[str, Any]) -> DictConfig:
    """A resolved config as the schema types it (what roles load from config.yaml)."""
    return OmegaConf.merge(OmegaConf.structured(RunConfig), tree)


def check_point(cfg: DictConfig, mode_multirun: bool) -> dict[str, Any]:
    """This point's resolved config, or ConfigError/PlanError saying in one line why it
    cannot share the sweep's inference with the points before it."""
    if not mode_multirun:
        raise ConfigError(
            "inference.shared=true: one inference service for the points of a sweep; run a "
            "multirun (rl -m algorithm.lr=1e-3,3e-3 inference.shared=true ...)"
        )
    tree = OmegaConf.to_container(cfg, resolve=True)
    if PENDING:
        first, mine = flat(PENDING[0].cfg), flat(tree)
        for key in sorted(first.keys() | mine.keys()):
            if not _varies(key) and first.get(key) != mine.get(key):
                raise ConfigError(
                    f"inference.shared=true: the points differ in {key} ({first.get(key)} and "
                    f"{mine.get(key)}); one inference service serves one model and base, so "
                    f"shared points may differ only in algorithm.*, model.lora.rank/alpha/"
                    f"dropout, trainer.*, seed, max_steps and how they are watched"
                )
    limit = cfg.inference.max_loras
    if limit is not None and len(PENDING) + 1 > limit:
        raise PlanError(
            f"inference.max_loras={limit}: the sweep has more points ({len(PENDING) + 1}) than "
            f"adapters the shared inference may hold; raise it, or leave it unset (one per point)"
        )
    return tree


def add_point(cfg: DictConfig) -> None:
    """Check a point of a shared-inference sweep and keep it for `run_shared`."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra = HydraConfig.get()
    try:
        tree = check_point(cfg, hydra.mode == RunMode.MULTIRUN)
    except (ConfigError, PlanError):
        forget_points()
        raise
    root = Path(hydra.runtime.output_dir).resolve()
    PENDING.append(Point(tree, root, list(hydra.overrides.task)))
    if cfg.dry_run:
        return
    print(
        f"{point_name(root)}: {' '.join(hydra.overrides.task)} (starts once every point of "
        f"the sweep is known, beside the others, on one shared inference service)",
        flush=True,
    )


def forget_points(points: list[Point] | None = None) -> None:
    """Drop the points kept so far (the sweep is refused, or stopped before they started):
    their directories are still empty."""
    for point in PENDING if points is None else points:
        for path in (point.root, point.root.parent):
            try:
                path.rmdir()
            except OSError:
                break
    PENDING.clear()


def service_config(points: list[DictConfig]) -> DictConfig:
    """The shared service's config: the first point's, holding an adapter per point of up to
    the largest rank among them."""
    cfg = copy.deepcopy(points[0])
    inf = cfg.inference
    inf.max_loras = inf.max_loras or len(points)
    inf.max_lora_rank = inf.max_lora_rank or max(p.model.lora.rank for p in points)
    return cfg


def print_service_plan(cfg: DictConfig) -> None:
    """Dry run: the service's processes, once, before the first point's plan."""
    if not PENDING:
        print("shared inference service (one for every point of the sweep):")
        print(format_plan(plan(cfg, service=True), cfg), flush=True)


# --- running ------------------------------------------------------------------------------


@dataclass
class Unit:
    """The service, or one point: its run directory, roles, and how it is watched."""

    name: str
    cfg: DictConfig
    run: RunDir
    plan: RunPlan
    children: list[Child]
    watch: Watch
    follow: Follow | None = None
    status: str = "running"


def warm_up_once(first: DictConfig, sweep_dir: Path, token: str) -> Path:
    """The first point's warm-up, its trainer alone (`base/`); returns the weights
    every point starts from."""
    return warm_up(first, RunDir(sweep_dir / BASE), token, "base")


def prepare(points: list[Point], sweep_dir: Path, token: str, base: Path) -> list[Unit]:
    """Write the service's and every point's run directory, each starting from `base`; the
    service comes first."""
    configs = [typed(p.cfg) for p in points]
    added = [f"model.path={base}", "warmup.steps=0"]
    group = sweep_group()
    for cfg in configs:
        cfg.model.path, cfg.warmup.steps = str(base), 0
        cfg.wandb.group = cfg.wandb.group or group  # every point in the sweep's wandb group
    service_plan = plan(service_config(configs), service=True)
    service_cfg = service_plan.config
    run = RunDir(sweep_dir / SERVICE)
    run.create(service_cfg, token, service_plan.to_json())
    units = [Unit(SERVICE, service_cfg, run, service_plan, [], Watch(service_cfg, run, []))]
    for point, given in zip(points, configs, strict=True):
        run, run_plan = RunDir(point.root), plan(given)
        cfg = run_plan.config
        run.create(cfg, token, run_plan.to_json())
        run.add_overrides(point.overrides + added)
        units.append(Unit(point_name(point.root), cfg, run, run_plan, [], Watch(cfg, run, [])))
    return units


def start(unit: Unit, token: str) -> None:
    unit.children = start_children(unit.plan, unit.run, token)
    record_pids(unit.run, unit.children)  # as a run alone records them: audits, resume checks
    unit.watch = Watch(unit.cfg, unit.run, unit.children)


def wait_listening(unit: Unit) -> None:
    """Wait for the service's servers to listen (each restarted, within limits, meanwhile)."""
    deadline = time.monotonic() + unit.watch.ready_s
    for proc in unit.plan.processes:
        while not unit.run.address_file(proc.name).exists():
            unit.watch.check()
            if time.monotonic() > deadline:
                raise RunFailed(
                    f"{proc.name} did not become ready in {unit.watch.ready_s:.0f} s "
                    "(timeouts.ready_s)"
                )
            time.sleep(0.1)
        print(f"ready: {proc.name} (shared by every point)", flush=True)


def end(unit: Unit, status: str) -> None:
    """Stop a point's roles and write its summary."""
    stop_children(unit.children)
    unit.watch.save_wall_time()
    mode = unit.follow.close(exit_code=0 if status == "finished" else 1) if unit.follow else ""
    print(f"{unit.name} {status}: {unit.run.root}", flush=True)
    finish_run(unit.cfg, unit.run, unit.watch.wall_time(), mode, status)
    unit.status = status
    if status != "finished":
        print(f"{unit.name}: {resume_command(unit.run)}", file=sys.stderr, flush=True)


def supervise(service: Unit, points: list[Unit]) -> None:
    """Until every point has ended: restart roles that die or hang, end a point that fails
    (the others go on), end every point if the service fails, and show progress."""
    while running := [p for p in points if p.status == "running"]:
        try:
            service.watch.check()
        except RunFailed as err:
            print(f"error: the shared inference failed: {err}", file=sys.stderr, flush=True)
            for point in running:
                end(point, "failed")
            return
        for point in running:
            try:
                point.watch.check()
            except RunFailed as err:
                print(f"error: {point.name}: {err}", file=sys.stderr, flush=True)
                end(point, "failed")
                continue
            assert point.follow is not None
            point.follow.poll()
            finishing = {c.name for c in point.children if c.role in FINISHING_ROLES}
            if point.watch.done == finishing:
                end(point, "finished")
        time.sleep(POLL_S)


def run_pending(sweep_dir: Path) -> int:
    """Run the sweep's kept points, if any (a dry run keeps them only to check them); returns
    how many did not finish."""
    if not PENDING or PENDING[0].cfg["dry_run"]:
        PENDING.clear()
        return 0
    return run_shared(sweep_dir)


def run_shared(sweep_dir: Path) -> int:
    """Run the kept points together (see the module's docstring); returns how many did not
    finish."""
    points, token = list(PENDING), secrets.token_hex(16)
    PENDING.clear()
    print(f"sweep {sweep_dir}: {len(points)} points sharing one inference service", flush=True)
    first = typed(points[0].cfg)
    cluster = cluster_of(first)
    if cluster.spans_nodes:  # jobs of their own
        return cluster.run_shared(points, sweep_dir, token)
    with _interrupts():
        try:
            if first.warmup.steps > 0:
                base = warm_up_once(first, sweep_dir, token)
            else:  # built (or converted) once, with the first point's seed, for every point
                base = ensure_checkpoint(first.model)
        except (KeyboardInterrupt, RunFailed) as err:
            forget_points(points)  # nothing of theirs has started
            if isinstance(err, KeyboardInterrupt):
                raise SystemExit(130) from None
            print(f"error: {err}", file=sys.stderr, flush=True)
            return len(points)
        units = prepare(points, sweep_dir, token, base)
        return run_units(units, token)


def submit_shared(points: list[Point], sweep_dir: Path, token: str, first: DictConfig) -> int:
    """On Slurm: one inference job for the sweep, and each point's own jobs (control: its
    queue and orchestrator; trainer), all held until every one is in, then released together;
    nothing is left behind when one cannot be submitted. Returns 0: the jobs run on."""
    from launcher.clusters.slurm.submit import preflight, submit_together

    base = Path(first.model.path) if first.model.path else None
    units = prepare(points, sweep_dir, token, base or ensure_checkpoint(first.model))
    try:
        partition = preflight(units[0].cfg, units[0].plan)
        for unit in units[1:]:
            preflight(unit.cfg, unit.plan)
        submit_together([(unit.cfg, unit.plan, unit.run) for unit in units], partition)
    except BaseException:
        for unit in units:
            shutil.rmtree(unit.run.root, ignore_errors=True)
        raise
    status = override("run_dir", sweep_dir)
    print(f"sweep status (every point): uv run rl action=status {status}", flush=True)
    return 0


def resume_point(cfg: DictConfig, run_plan: RunPlan, run: RunDir) -> None:
    """Resume one point of a shared-inference sweep that has ended: the point's roles, and the
    sweep's service again (which takes back every point's newest adapter)."""
    from launcher.clusters.run_dir import running_roles

    service = RunDir(shared_service(run.root))
    if not service.config.exists():
        raise ConfigError(
            f"resume={run.root}: its sweep's shared inference ({service.root}) is gone"
        )
    if running_roles(service):
        raise ConfigError(
            f"resume={run.root}: the sweep's shared inference is still running (its other "
            f"points); resume this point once the sweep has ended"
        )
    service_plan = plan(
        typed(OmegaConf.to_container(service.load_config(), resolve=True)), service=True
    )
    service_cfg = service_plan.config
    units = [
        Unit(SERVICE, service_cfg, service, service_plan, [], Watch(service_cfg, service, [])),
        Unit(point_name(run.root), cfg, run, run_plan, [], Watch(cfg, run, [])),
    ]
    with _interrupts():
        if run_units(units, run.token()):
            raise SystemExit(1)


def run_units(units: list[Unit], token: str) -> int:
    """Start the service, then every point beside it, and supervise them to the end; returns
    how many points did not finish."""
    service, *points = units
    try:
        start(service, token)
        wait_listening(service)
        group = sweep_group()
        for point in points:
            start(point, token)
            point.follow = Follow(point.cfg, point.run, True, group, prefix=f"{point.name}: ")
            print(f"{point.name} started: {point.run.root}", flush=True)
        supervise(service, points)
    except KeyboardInterrupt:
        print("interrupted: stopping every point", file=sys.stderr, flush=True)
        _end_all(units, "interrupted")
        raise SystemExit(130) from None
    except RunFailed as err:
        print(f"error: the shared inference failed: {err}", file=sys.stderr, flush=True)
        _end_all(units, "failed")
    stop_children(service.children)
    return sum(point.status != "finished" for point in points)


@contextlib.contextmanager
def _interrupts() -> Iterator[None]:
    """Ctrl-C and SIGTERM stop the sweep (also where SIGINT came ignored: a background job)."""
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    previous_int = signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _end_all(units: list[Unit], status: str) -> None:
    for unit in units[1:]:
        if unit.status == "running":
            end(unit, status)
    stop_children(units[0].children)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class SweepEnd(Callback):
    """Hydra calls this when a multirun ends (conf/config.yaml, `hydra.callbacks`): it runs
    the points kept for a shared inference service, then writes the sweep's comparison
    (`sweep_summary.md`, `sweep.png`: launcher/sweeps/summary.py)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir).resolve()
        try:
            failed = run_pending(sweep_dir)
        except (ConfigError, PlanError) as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        target = write_sweep_summary(sweep_dir)
        if target is not None:
            print(f"sweep summary: {target} (plot {target.parent / 'sweep.png'})", flush=True)
        if failed:
            print(f"error: {failed} point(s) of the sweep did not finish", file=sys.stderr)
            raise SystemExit(1)
