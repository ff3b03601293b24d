"""The run directory: the one module that knows its layout.

Every process of a run (the launcher, a Slurm job's supervisor, each role) finds the others and
the run's state here, on a shared filesystem on a cluster. Its top level holds what a user
reads; what the processes keep for each other lives in `.relay/`:

    config.yaml            the resolved run config (written once by the launcher)
    plan.json              the RunPlan: processes, jobs and the values derived for them
    api_key                the key of the inference servers' OpenAI API, for clients (0600)
    metrics.jsonl          one record per line, each with a `kind` (rl/core/records.py)
    summary.json, reward.png   written when the run ends (status: finished, failed, ...)
    logs/<process>.log     each process's output
    rollouts/samples.jsonl samples kept for inspection
    rollouts/eval_N.jsonl  the first completions of version N's held-out eval
    weights/step_N/        published policy versions (HF layout, SHA256SUMS of its files, then
                           COMPLETE written last)
    weights/PUBLISHED      the versions the trainer published and keeps: only these are loaded
                           or pruned (any other step_N there is a stray, warned of and left)
    weights/BROADCAST      the newest version every server confirmed (broadcast transport)
    weights/BROADCAST_NEXT the update the trainer is sending: version and weight group
    checkpoints/step_N/    DCP checkpoints (COMPLETE last); checkpoints/reference/
    wandb/                 the run's wandb run (logged live by the launcher)
    slurm/<job>/           Slurm runs: each job's submitit folder and supervisor log
    .relay/                the internals:
        token              the run's secret, its keys derived from it (mode 0600; rl/core/auth.py)
        overrides.json     the command-line overrides it was started (and resumed) with
        config.yaml        the config as the launcher last wrote it: a resume refuses a
                           config.yaml that differs from it (edited by hand)
        pids.json          local launcher: each role's process group id
        wall_s             seconds the launcher has run the run, over all its launches
        metrics.followed   how far the launcher has shown and logged metrics.jsonl
        wandb_id           the id of the run's wandb run
        addresses/<name>.json  where a role's server listens (written once it listens)
        heartbeats/<name>.<pid>  each role process's heartbeat
        queue.sqlite       the rollout queue's store (and its -wal file)
        queue.marks.json   the store's high-water marks, to detect a store that lost commits
        carried/after_N.json  the groups with signal batch N drew beyond its own, for batch N + 1
        scores.json        the rewards and advantages the run's samples can hold, declared by
                           the orchestrator as it starts (the queue and trainer check them)
        control/           the supervisor's checkpoint request and the trainer's answer
        kv/, replicas/     prefill/decode hand-over files; nodes of a spanning vLLM replica
        jobs.json, failure.json, complete, done/<role>, ended/   Slurm runs (Kubernetes
                           runs all but jobs.json)
        kubernetes.json    a Kubernetes run, where it was submitted from: its objects
        submission         a Kubernetes run, on the volume: the submission it holds

A sweep with shared inference (`inference.shared`) keeps, beside its points' run directories,
`inference/` (the service's run directory: its config, token, addresses, logs) and `base/`
(the one warm-up every point starts from); each point's adapter is served under
`point_name(point)` and loaded from that point's own `weights/` (`shared_point`).

Torch-free (the launcher imports it). Writes that others read while a run is live are atomic
(a temporary file renamed into place), and appends to metrics.jsonl go through one lock. A
write that meets a full disk raises rl/core/disk.py's DiskFull naming the file, and leaves no
temporary file behind.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl.core.disk import writing

# Written last into a directory (a checkpoint, published weights, a built model): whoever sees
# it may read the rest.
COMPLETE = "COMPLETE"
BROADCAST = "BROADCAST"
BROADCAST_NEXT = "BROADCAST_NEXT"
PUBLISHED = "PUBLISHED"
CONFIG = "config.yaml"
PLAN = "plan.json"
METRICS = "metrics.jsonl"
TOKEN = "token"
API_KEY = "api_key"
INTERNAL = ".relay"
STEP_PREFIX = "step_"


SERVICE = "inference"  # a shared-inference sweep's service directory, beside its points
BASE = "base"  # its one warm-up, beside its points
BASES = "bases"  # a sweep's shared bases, one per group of points that warm up alike
POINT_NAME = re.compile(r"[^A-Za-z0-9._-]")


SWEEP_POINT = re.compile(r"(\d+)-")
RUN_TIME = re.compile(r"\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}")
"""A single run's directory name (conf/config.yaml's hydra.run.dir): its start time."""


def sweep_point(run: Path) -> int | None:
    """Hydra's number of the sweep point whose directory `run` is (`N-<overrides>`), or None
    for a single run (its directory is its start time, `2026-12-06_03-15-09`)."""
    found = SWEEP_POINT.match(run.name)
    if found is None or RUN_TIME.fullmatch(run.name):
        return None
    return int(found[1])


def point_name(point: Path) -> str:
    """The name a sweep point's adapter is served under by the shared inference: `point-N`
    for Hydra's N-th point (its directory `N-<overrides>`), else the directory's name."""
    number = sweep_point(point)
    if number is not None:
        return f"point-{number}"
    return POINT_NAME.sub("_", point.name)[:64]


def shared_service(point: Path) -> Path:
    """The inference service directory of a sweep point that shares it."""
    return point.parent / SERVICE


def point_dirs(sweep: Path) -> list[Path]:
    """The run directories of a sweep's points (a shared-inference sweep's service and base
    are not points)."""
    found = (config.parent for config in sweep.glob(f"*/{CONFIG}"))
    return sorted(p for p in found if p.name not in (SERVICE, BASE, BASES))


def shared_point(service: Path, name: str) -> Path | None:
    """The run directory of the sweep point served as `name`, or None."""
    return next((p for p in point_dirs(service.parent) if point_name(p) == name), None)


def mark_complete(folder: Path, sync: bool = False) -> None:
    """Write the COMPLETE marker into `folder` (after an fsync of it with `sync`)."""
    with writing(folder / COMPLETE), open(folder / COMPLETE, "w") as f:
        if sync:
            f.flush()
            os.fsync(f.fileno())


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE).exists()


CHECKSUMS = "SHA256SUMS"
"""In published weights: the SHA-256 of each of its files, recorded by the trainer."""


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def write_checksums(folder: Path) -> None:
    """Record the SHA-256 of every file under `folder` in its CHECKSUMS."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    sums = {str(p.relative_to(folder)): file_digest(p) for p in files}
    (folder / CHECKSUMS).write_text(json.dumps(sums, indent=0))


def checksum_problem(folder: Path) -> str | None:
    """What is wrong with `folder`'s files against its CHECKSUMS (None: each file is as the
    trainer recorded it, and no weights file is unrecorded)."""
    try:
        sums = json.loads((folder / CHECKSUMS).read_text())
    except (OSError, ValueError) as exc:
        return f"{folder} has no readable {CHECKSUMS} ({type(exc).__name__}): not published whole"
    unrecorded = [p.name for p in folder.glob("*.safetensors") if p.name not in sums]
    if unrecorded:
        return f"{folder / unrecorded[0]} is not among the files the trainer recorded"
    for name, expected in sums.items():
        path = folder / name
        if path.is_symlink() or not path.is_file():
            return f"{path} is missing, or a symbolic link"
        if file_digest(path) != expected:
            return f"{path} does not match the SHA-256 the trainer recorded (corrupt or changed)"
    return None


KV_FILES = "kv"
"""Under a run directory: the KV prefill/decode replicas hand over through files."""


def write_atomic(path: Path, text: str, durable: bool = False) -> None:
    """Write `path` through a temporary file renamed into place: readers never see half. With
    `durable`, the file and then its directory are fsynced: the new text survives a crash."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with writing(path, partial=tmp):
        tmp.write_text(text)
        if durable:
            fsync_path(tmp)
        tmp.rename(path)
        if durable:
            fsync_path(path.parent)


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's (its entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line with a single write, under the file's lock (several roles append to
    metrics.jsonl, and a resuming trainer rewrites it). A line the disk had no room for is cut
    off again: every reader reads whole lines."""
    data = memoryview((json.dumps(record) + "\n").encode())
    with writing(path), open(path, "ab", buffering=0) as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        end = os.fstat(f.fileno()).st_size
        try:
            while data:  # one write, unless the disk fills part way
                data = data[f.write(data) :]
        except OSError:
            os.ftruncate(f.fileno(), end)
            raise


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON line of `path` ([] when it does not exist)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def drop_records(path: Path, drop: Callable[[dict[str, Any]], bool]) -> int:
    """Remove the JSON lines for which `drop` is true, in place and under the file's lock;
    returns how many went."""
    if not path.exists():
        return 0
    with open(path, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        lines = [line for line in f.read().splitlines() if line.strip()]
        kept = [line for line in lines if not drop(json.loads(line))]
        f.seek(0)
        f.write("".join(line + "\n" for line in kept))
        f.truncate()
    return len(lines) - len(kept)


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as dotted keys and their values."""
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flat(value, f"{prefix}{key}."))
    return out


def step_versions(folder: Path) -> list[int]:
    """The N of every complete `step_N` in `folder`, ascending."""
    found = []
    for path in folder.glob(f"{STEP_PREFIX}*"):
        number = path.name.removeprefix(STEP_PREFIX)
        if number.isdigit() and is_complete(path):
            found.append(int(number))
    return sorted(found)


@dataclass(frozen=True)
class RunDir:
    """Paths and small file operations of one run directory."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    # --- written by the launcher -----------------------------------------------------------

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def plan(self) -> Path:
        return self.root / PLAN

    @property
    def internal(self) -> Path:
        """What the run's processes keep for each other, apart from what a user reads."""
        return self.root / INTERNAL

    @property
    def token_file(self) -> Path:
        return self.internal / TOKEN

    @property
    def pids(self) -> Path:
        return self.internal / "pids.json"

    def is_run(self) -> bool:
        """Whether this looks like a run directory (a config and a token)."""
        return self.config.exists() and self.token_file.exists()

    def has_old_layout(self) -> bool:
        """Whether an earlier Relay wrote this run directory: its internals (the token first)
        at the top level, not in `.relay/`."""
        return (self.root / TOKEN).exists() and not self.token_file.exists()

    def create(self, cfg: Any, token: str, plan_json: str | None = None) -> None:
        """Write a new run's config (resolved), plan and token; the token file must not exist
        yet and is readable by its owner only, as is the run directory itself (on a cluster's
        shared filesystem other users would otherwise read its logs, rollouts and weights)."""
        from omegaconf import OmegaConf

        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)
        self.logs.mkdir(exist_ok=True)
        self.internal.mkdir(exist_ok=True)
        from rl.core.auth import derive

        with writing(self.root):
            self.write_config(OmegaConf.to_yaml(cfg, resolve=True))
            if plan_json is not None:
                self.plan.write_text(plan_json)
            fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token)
            fd = os.open(self.root / API_KEY, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(derive(token, ["inference"])["inference"])

    def token(self) -> str:
        return self.token_file.read_text().strip()

    @property
    def overrides_file(self) -> Path:
        return self.internal / "overrides.json"

    def overrides(self) -> list[str]:
        """The command-line overrides the run was started with (and resumed with, after)."""
        try:
            return json.loads(self.overrides_file.read_text())
        except FileNotFoundError:
            return []

    def add_overrides(self, overrides: list[str]) -> None:
        write_atomic(self.overrides_file, json.dumps(self.overrides() + overrides))

    @property
    def config_written(self) -> Path:
        return self.internal / CONFIG

    def write_config(self, text: str) -> None:
        """The run's config.yaml, and the launcher's own copy of it (`edited_config` compares
        them)."""
        write_atomic(self.config_written, text)
        write_atomic(self.config, text)

    def edited_config(self) -> list[str]:
        """The settings whose values in config.yaml are not those the launcher wrote, as
        `key: written -> found` (none for a run written before the launcher kept its copy)."""
        import yaml

        if not self.config_written.exists():
            return []
        written = flat(yaml.safe_load(self.config_written.read_text()) or {})
        found = flat(yaml.safe_load(self.config.read_text()) or {})
        return [
            f"{key}: {written.get(key, '(none)')} -> {found.get(key, '(none)')}"
            for key in sorted(set(written) | set(found))
            if written.get(key) != found.get(key)
        ]

    def load_config(self) -> Any:
        """The config as written (not re-validated: rl.core.runtime.load_run_config does that)."""
        from omegaconf import OmegaConf

        return OmegaConf.load(self.config)

    def read_plan(self) -> dict[str, Any]:
        return json.loads(self.plan.read_text())

    def read_pids(self) -> dict[str, int]:
        try:
            return json.loads(self.pids.read_text())
        except FileNotFoundError:
            return {}

    def write_pids(self, pids: dict[str, int]) -> None:
        write_atomic(self.pids, json.dumps(pids))

    # --- results ---------------------------------------------------------------------------

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def reward_plot(self) -> Path:
        return self.root / "reward.png"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts" / "samples.jsonl"

    def append_metrics(self, record: dict[str, Any]) -> None:
        append_jsonl(self.metrics, record)

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics)

    def eval_samples(self, version: int) -> Path:
        """The first completions of version `version`'s held-out eval, for inspection (and
        wandb's table of them)."""
        return self.root / "rollouts" / f"eval_{version}.jsonl"

    def append_rollout(self, record: dict[str, Any]) -> None:
        self.rollouts.parent.mkdir(exist_ok=True)
        append_jsonl(self.rollouts, record)

    # --- processes and servers -------------------------------------------------------------

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, process: str) -> Path:
        return self.logs / f"{process}.log"

    @property
    def addresses(self) -> Path:
        return self.internal / "addresses"

    def address_file(self, name: str) -> Path:
        return self.addresses / f"{name}.json"

    def write_address(self, name: str, host: str, port: int) -> None:
        """Record where `name` listens (atomically)."""
        self.addresses.mkdir(parents=True, exist_ok=True)
        info = {"host": host, "port": port, "pid": os.getpid()}
        write_atomic(self.address_file(name), json.dumps(info))

    def kv_files(self, replica: str) -> Path:
        """The KV a prefill/decode `replica` hands over through files (the file connector)."""
        return self.internal / KV_FILES / replica

    def replica_nodes(self, instance: str) -> Path:
        """Where the processes of inference `instance` spanning nodes find each other's
        starts (rl/inference/vllm/front.py's SpanningReplica)."""
        return self.internal / "replicas" / instance

    @property
    def heartbeats(self) -> Path:
        return self.internal / "heartbeats"

    def heartbeat(self, name: str, pid: int) -> Path:
        """The file process `pid` of role process `name` beats into (a counter)."""
        return self.heartbeats / f"{name}.{pid}"

    def heartbeats_of(self, name: str) -> list[Path]:
        """The heartbeat files of every process of `name` (a trainer has one per rank)."""
        return sorted(self.heartbeats.glob(f"{name}.*[0-9]"))

    @property
    def metrics_followed(self) -> Path:
        """How far the launcher has shown and logged metrics.jsonl (a byte offset)."""
        return self.internal / "metrics.followed"

    @property
    def wandb_id(self) -> Path:
        """The id of the run's wandb run, which a resumed run logs on into."""
        return self.internal / "wandb_id"

    @property
    def warm_up_lock(self) -> Path:
        """Held while a sweep's shared base warms up (launcher/sweeps/base.py)."""
        return self.internal / "warm-up.lock"

    @property
    def wall_time(self) -> Path:
        """Seconds the launcher has run this run, summed over its launches (resumes)."""
        return self.internal / "wall_s"

    def read_address(self, name: str) -> str | None:
        """The base URL `name` last wrote, if it has written one."""
        try:
            info = json.loads(self.address_file(name).read_text())
        except FileNotFoundError:
            return None
        return f"http://{info['host']}:{info['port']}"

    @property
    def queue_store(self) -> Path:
        return self.internal / "queue.sqlite"

    @property
    def queue_marks(self) -> Path:
        return self.internal / "queue.marks.json"

    @property
    def scores(self) -> Path:
        return self.internal / "scores.json"

    def write_scores(self, bounds: dict[str, Any]) -> None:
        write_atomic(self.scores, json.dumps(bounds))

    def read_scores(self) -> dict[str, Any] | None:
        """What `write_scores` wrote (None: nothing yet)."""
        try:
            return json.loads(self.scores.read_text())
        except FileNotFoundError:
            return None
        except ValueError:
            return {}  # unreadable: refused where it is parsed

    def carried(self, batch: int) -> Path:
        """The groups batch `batch` drew beyond its own, carried into the next batch."""
        return self.internal / "carried" / f"after_{batch}.json"

    # --- weights ---------------------------------------------------------------------------

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    def weights_for(self, version: int) -> Path:
        """Where policy `version` is published (HF layout)."""
        return self.weights / f"{STEP_PREFIX}{version}"

    @property
    def published_record(self) -> Path:
        return self.weights / PUBLISHED

    def recorded_versions(self) -> list[int] | None:
        """The versions the trainer recorded as published and kept, ascending (None: no record,
        a run from before the trainer kept one)."""
        try:
            record = json.loads(self.published_record.read_text())
        except FileNotFoundError:
            return None
        except ValueError:
            return []  # half a record is none: nothing loads until the trainer writes it again
        if not isinstance(record, list):
            return []
        return sorted({v for v in record if isinstance(v, int) and not isinstance(v, bool)})

    def published_versions(self) -> list[int]:
        """The versions with complete published weights that the trainer recorded, ascending
        (every complete `step_N`, for a run from before the record)."""
        recorded = self.recorded_versions()
        if recorded is None:
            return step_versions(self.weights)
        return [v for v in recorded if is_complete(self.weights_for(v))]

    def newest_version(self) -> int:
        """The highest complete published version, or -1. Polled while inference waits for
        weights: it checks the highest numbers first, not every kept version."""
        recorded = self.recorded_versions()
        if recorded is None:
            if not self.weights.is_dir():
                return -1
            steps = (n for n in os.listdir(self.weights) if n.startswith(STEP_PREFIX))
            numbers = (n.removeprefix(STEP_PREFIX) for n in steps)
            recorded = sorted(int(n) for n in numbers if n.isdigit())
        for version in reversed(recorded):
            if is_complete(self.weights_for(version)):
                return version
        return -1

    def start_record(self) -> None:
        """Start the record of published versions, as the trainer starts (before it publishes
        anything, so nothing it did not write gets in): empty for a new run, the complete
        versions there for a run from before the record."""
        if self.recorded_versions() is None:
            self.weights.mkdir(parents=True, exist_ok=True)
            self._write_record(step_versions(self.weights))

    def record_published(self, version: int) -> None:
        """Record `version` (complete in `weights/`) as published: the trainer's alone to
        call, after `start_record`."""
        self._write_record(sorted({*(self.recorded_versions() or []), version}))

    def _write_record(self, versions: list[int]) -> None:
        write_atomic(self.published_record, json.dumps(versions), durable=True)

    def stray_versions(self) -> list[Path]:
        """`step_N` directories in `weights/` the trainer did not record: never loaded, never
        pruned (empty without a record)."""
        recorded = self.recorded_versions()
        if recorded is None or not self.weights.is_dir():
            return []
        kept = {self.weights_for(v).name for v in recorded}
        return sorted(
            path
            for path in self.weights.glob(f"{STEP_PREFIX}*")
            if path.name.removeprefix(STEP_PREFIX).isdigit() and path.name not in kept
        )

    def prune_versions(self, keep: int) -> list[Path]:
        """Delete all but the newest `keep` published versions (version 0, the weights RL
        starts from, stays), and return the stray directories left alone."""
        found = [v for v in self.published_versions() if v > 0]
        gone = found[: max(len(found) - keep, 0)]
        recorded = self.recorded_versions()
        if gone and recorded is not None:  # out of the record first: never recorded but gone
            self._write_record([v for v in recorded if v not in gone])
        for version in gone:
            shutil.rmtree(self.weights_for(version), ignore_errors=True)
        return self.stray_versions()

    def newest_policy(self) -> int:
        """The newest version the trainer published, on disk or by broadcast (-1: none): no
        sample can come from a newer one."""
        return max(self.newest_version(), self.broadcast_version())

    def record_broadcast(self, version: int) -> None:
        """Record that every inference server holds `version` (broadcast transport)."""
        write_atomic(self.weights / BROADCAST, str(version))

    def announce_broadcast(self, version: int, group: str, host: str, port: int) -> None:
        """Record the update the trainer is about to send: servers join only this group, for
        only this version."""
        self.weights.mkdir(parents=True, exist_ok=True)
        update = {"version": version, "group": group, "host": host, "port": port}
        write_atomic(self.weights / BROADCAST_NEXT, json.dumps(update))

    def announced_broadcast(self) -> dict[str, Any] | None:
        """The update the trainer announced last (None: none)."""
        try:
            return json.loads((self.weights / BROADCAST_NEXT).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def broadcast_version(self) -> int:
        """The newest version the trainer broadcast and every server confirmed, or -1."""
        try:
            return int((self.weights / BROADCAST).read_text())
        except FileNotFoundError:
            return -1

    # --- checkpoints and control -----------------------------------------------------------

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint_for(self, step: int) -> Path:
        return self.checkpoints / f"{STEP_PREFIX}{step}"

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint, if any."""
        steps = step_versions(self.checkpoints)
        return self.checkpoint_for(steps[-1]) if steps else None

    def prune_checkpoints(self, keep: int, named: list[int]) -> list[int]:
        """Delete all but the newest `keep` complete checkpoints and those of the `named`
        steps; returns the steps deleted. Called once a new checkpoint is complete, so the
        newest is never one being written."""
        steps = step_versions(self.checkpoints)
        gone = [s for s in steps[: max(len(steps) - keep, 0)] if s not in set(named)]
        for step in gone:
            shutil.rmtree(self.checkpoint_for(step), ignore_errors=True)
        return gone

    def resume_point(self) -> str:
        """Where a resume of this run starts, in words: the step after the newest checkpoint."""
        steps = step_versions(self.checkpoints)
        if not steps:
            return "step 1: no checkpoint yet, so the warm-up runs again"
        return f"step {steps[-1] + 1}, after checkpoint step_{steps[-1]}"

    def remove_unfinished(self) -> list[Path]:
        """Delete what a stopped trainer left half-written, and return it: checkpoints without
        their COMPLETE marker and published weights' temporary directories (nothing reads
        either; on a full disk, their space is what the run's summary needs). Only once every
        role of the run has stopped."""
        found = [p for p in self.checkpoints.glob(f"{STEP_PREFIX}*") if not is_complete(p)]
        found += self.weights.glob(f"{STEP_PREFIX}*.tmp")
        for path in found:
            shutil.rmtree(path, ignore_errors=True)
        return found

    @property
    def reference(self) -> Path:
        """The KL reference's weights (the policy RL started from): a DCP checkpoint."""
        return self.checkpoints / "reference"

    @property
    def control(self) -> Path:
        return self.internal / "control"

    @property
    def checkpoint_request(self) -> Path:
        """Created by a job supervisor: checkpoint at the current step and stop."""
        return self.control / "checkpoint-request"

    @property
    def generating(self) -> Path:
        """The orchestrator's progress on the batch it is making (`Progress`), for the console
        to say what a run waits for when no step ends."""
        return self.internal / "generating.json"

    @property
    def trainer_waiting(self) -> Path:
        """The batch the trainer waits for (its number), there only while it waits: no step is
        under way then, so a Ctrl-C stops it at once (launcher/clusters/local/launch.py)."""
        return self.internal / "trainer-waiting"

    @property
    def checkpointed(self) -> Path:
        """The trainer's answer to a checkpoint request: the step it checkpointed."""
        return self.control / "checkpointed"

    # --- Slurm runs ------------------------------------------------------------------------

    @property
    def jobs(self) -> Path:
        """The run's Slurm job ids by role group, and the partition."""
        return self.internal / "jobs.json"

    @property
    def failure(self) -> Path:
        """Why the run ended early (written once: the first job to notice wins)."""
        return self.internal / "failure.json"

    @property
    def kubernetes(self) -> Path:
        """A Kubernetes run's record where it was submitted from: its namespace, name on the
        cluster, objects and submission count."""
        return self.internal / "kubernetes.json"

    @property
    def submission(self) -> Path:
        """On a Kubernetes run's volume: the submission whose config the directory holds."""
        return self.internal / "submission"

    def record_failure(self, reason: str, job: str | None = None) -> bool:
        """Record why the run ended, once (the first job to notice wins); True if this call
        did."""
        try:
            fd = os.open(self.failure, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({"reason": reason, "job": job}, f, indent=2)
        return True

    def failure_reason(self) -> str | None:
        """Why the run ended early, if a job has recorded it."""
        try:
            return json.loads(self.failure.read_text())["reason"]
        except FileNotFoundError:
            return None

    @property
    def complete(self) -> Path:
        """Created by the control job once trainer and orchestrator are done."""
        return self.internal / "complete"

    def done(self, role: str) -> Path:
        return self.internal / "done" / role

    def mark_done(self, role: str) -> None:
        """Record that `role` finished its part of the run."""
        self.done(role).parent.mkdir(exist_ok=True)
        self.done(role).touch()

    @property
    def ended(self) -> Path:
        """jobs.json and failure.json of earlier submissions of a resumed run."""
        return self.internal / "ended"

    def end_submission(self) -> int:
        """Move jobs.json and failure.json (if any) into ended/ as jobs-N.json and
        failure-N.json, N counting the submissions ended before; returns N."""
        self.ended.mkdir(exist_ok=True)
        attempt = len(list(self.ended.glob("jobs-*.json")))
        for path in (self.jobs, self.failure):
            if path.exists():
                path.rename(self.ended / f"{path.stem}-{attempt}{path.suffix}")
        return attempt

    @property
    def slurm(self) -> Path:
        """Each Slurm job's submitit folder, with its supervisor's log."""
        return self.root / "slurm"

    def submitit_folder(self, job: str) -> Path:
        return self.slurm / job
