"""Whether two runs of one config are the same run: their records, field by field, and the
weights of their last published version, byte by byte.

What may differ between two runs that are the same run: how long things took and when
(`time/`, `at/`, `timestamp`, the warm-up's elapsed time), the throughput that follows from
it, memory, and the queue's depth when a rank fetched its shard (how far ahead the
orchestrator happened to be).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from rl.core.rundir import RunDir

TIMING = ("time/", "at/", "throughput/", "memory/", "timestamp", "warmup/elapsed_s", "queue/depth")


def timeless(record: dict[str, Any]) -> dict[str, Any]:
    """A record without the fields that measure timing, throughput or memory."""
    return {k: v for k, v in record.items() if not k.startswith(TIMING)}


def records_by_step(
    run_dir: Path, ignore: tuple[str, ...] = ()
) -> dict[tuple[str, int], dict[str, Any]]:
    """Every record of the run by (kind, step), timing left out (the file's order is the order
    in which roles happened to append), and records of the kinds in `ignore`."""
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] in ignore:
            continue
        key = (record["kind"], record["step"])
        assert key not in found, f"{run_dir}: {key} recorded twice"
        found[key] = timeless(record)
    return found


def weights_digest(run_dir: Path) -> tuple[int, str]:
    """The newest published version and the sha256 of its tensor files."""
    run = RunDir(Path(run_dir))
    version = run.newest_version()
    digest = hashlib.sha256()
    for path in sorted(run.weights_for(version).glob("*.safetensors")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return version, digest.hexdigest()


def differences(first: Path, second: Path, ignore: tuple[str, ...] = ()) -> list[str]:
    """How two runs differ (empty: they are the same run): records missing from either (of
    kinds not in `ignore`), each field that differs, and the last published weights."""
    a, b = records_by_step(first, ignore), records_by_step(second, ignore)
    found = [f"{key} only in {first}" for key in sorted(a.keys() - b.keys())]
    found += [f"{key} only in {second}" for key in sorted(b.keys() - a.keys())]
    for key in sorted(a.keys() & b.keys()):
        for field in sorted(a[key].keys() | b[key].keys()):
            if a[key].get(field) != b[key].get(field):
                found.append(f"{key} {field}: {a[key].get(field)!r} != {b[key].get(field)!r}")
    if weights_digest(first) != weights_digest(second):
        found.append(f"weights: {weights_digest(first)} != {weights_digest(second)}")
    return found
