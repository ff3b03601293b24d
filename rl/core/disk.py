"""A full disk, said in one line: found in whatever a writer raised, naming what was being
written and how much space was left there.

A full disk (ENOSPC) or an exhausted quota (EDQUOT) is not a fault that a restart fixes. A role
that meets one ends with one line and `EXIT_CODE` (rl/core/runtime.py's `run_role`), and the
launcher ends the run with that line instead of restarting the role
(launcher/clusters/processes.py).

Writers raise it in many shapes: an OSError; SQLite's "database or disk is full"; safetensors'
Rust I/O error ("os error 28"); DCP's CheckpointException, which holds each rank's error; the
RuntimeError torch.save raises over the OSError of the file object it writes through.
`no_space` finds it in all of them, and `writing(path)` turns it into `DiskFull` naming `path`
(also where the number is lost, as in DCP's RuntimeError, but no block is left). A large write
whose size is known beforehand asks `check_room` first, and is not started without room.

Torch-free (the launcher imports it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path

EXIT_CODE = 74
"""The exit status of a role that met a full disk (sysexits' EX_IOERR); Relay's roles exit
with it for nothing else."""
REASONS = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded"}
LINE = re.compile(r"(?:disk full|disk quota exceeded) writing .*")
"""A `DiskFull` line, as found in a role's log."""
RUST_IO = re.compile(r"\(os error (\d+)\)")
NOT_FAILURES = (KeyboardInterrupt, SystemExit, GeneratorExit)
"""BaseExceptions that are no write's failure (DCP's CheckpointException is one that is)."""


def no_space(err: BaseException, outside: BaseException | None = None) -> int | None:
    """ENOSPC or EDQUOT when `err`, what caused it, or a rank's failure inside it (DCP) is a
    full disk; else None. `outside` is the exception being handled where `err` was raised
    (its implicit context, not its cause: not looked at)."""
    seen: set[int] = {id(outside)}
    stack: list[object] = [err]
    while stack:
        found = stack.pop()
        if not isinstance(found, BaseException) or id(found) in seen:
            continue
        seen.add(id(found))
        if isinstance(found, DiskFull):
            return found.errno
        if isinstance(found, OSError) and found.errno in REASONS:
            return found.errno
        full_db = getattr(found, "sqlite_errorname", "") == "SQLITE_FULL"
        if isinstance(found, sqlite3.Error) and full_db:
            return errno.ENOSPC
        rust = RUST_IO.search(str(found))
        if rust and int(rust.group(1)) in REASONS:
            return int(rust.group(1))
        stack += [found.__cause__, found.__context__]
        failures = getattr(found, "failures", None)  # DCP: rank -> (error, traceback)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem holding `path` (its nearest
    existing parent); None when that cannot be read."""
    for folder in (path, *path.parents):
        try:
            stats = os.statvfs(folder)
        except OSError:
            continue
        return stats.f_bavail * stats.f_frsize
    return None


def size(count: float | None) -> str:
    """`count` bytes for people (`1.5 MB`, `3.2 GB`)."""
    if count is None:
        return "an unknown amount"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


class DiskFull(OSError):
    """A write that failed, or was not started, for want of space: `filename` is what was (to
    be) written, `free` the bytes left on its filesystem then, `need` what it would have taken
    where that was known beforehand. `str()` is the one line that says so."""

    def __init__(self, path: Path, code: int, free: int | None, need: int | None = None) -> None:
        super().__init__(code, os.strerror(code), str(path))
        self.free, self.need = free, need

    def __str__(self) -> str:
        why = self.strerror if self.need is None else f"it needs ~{size(self.need)}"
        return (
            f"{REASONS[self.errno]} writing {self.filename} ({why}; {size(self.free)} free on "
            "its filesystem)"
        )


def check_room(path: Path, need: int) -> DiskFull | None:
    """A DiskFull for writing `need` bytes to `path` when its filesystem has less free space,
    else None: a write that would fill the disk part way is better not started (it would leave
    every other writer of the disk without room as well)."""
    free = free_bytes(path)
    if free is None or free >= need:
        return None
    return DiskFull(path, errno.ENOSPC, free, need)


def no_room_left(path: Path) -> bool:
    """Whether the filesystem of `path` has no block left for an unprivileged writer."""
    free = free_bytes(path)
    return free is not None and free == 0


def as_disk_full(
    err: BaseException, path: Path, outside: BaseException | None = None
) -> DiskFull | None:
    """`err` as a DiskFull, or None when it is not a full disk: the DiskFull it is or was
    raised from, else one naming the file the OSError behind it names, else `path`
    (`outside` as for `no_space`)."""
    code = no_space(err, outside)
    if code is None:
        return None
    chain = list(_chain(err, outside))
    inner = next((e for e in chain if isinstance(e, DiskFull)), None)
    if inner is not None:
        return inner
    named = next((e.filename for e in chain if isinstance(e, OSError) and e.filename), path)
    return DiskFull(Path(named), code, free_bytes(Path(named)))


def _chain(err: BaseException | None, outside: BaseException | None) -> Iterator[BaseException]:
    while err is not None and err is not outside:
        yield err
        err = err.__cause__ or err.__context__


@contextlib.contextmanager
def writing(path: Path, partial: Path | None = None) -> Iterator[None]:
    """Raise a full disk met in the block as DiskFull naming `path` (or the DiskFull a write
    inside it raised, which names its own file). `partial` is what the block writes that is
    useless unfinished (a temporary file, or a directory whose COMPLETE marker comes last):
    on a full disk it is removed, so that the space it took is free again.

    Some writers lose the error's number (DCP raises a RuntimeError over a torch.save that ran
    out of room): any failure of the block that leaves no block free on the filesystem of
    `path` counts as a full disk."""
    outside = sys.exc_info()[1]  # being handled around the block: not the block's doing
    try:
        yield
    except NOT_FAILURES:
        raise
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        code = no_space(err, outside) or (errno.ENOSPC if no_room_left(path) else None)
        if code is None:
            raise
        inner = next((e for e in _chain(err, outside) if isinstance(e, DiskFull)), None)
        full = inner or DiskFull(path, code, free_bytes(path))  # before `partial` frees space
        if partial is not None and partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)
        elif partial is not None:
            partial.unlink(missing_ok=True)
        if full is err:
            raise
        raise full from err
