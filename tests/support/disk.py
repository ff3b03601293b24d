"""A real full disk for tests: a small tmpfs mounted where a run directory goes (root only, as
on CI; a test is skipped where mounting is not permitted), and filling it to the last byte."""

from __future__ import annotations

import contextlib
import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

MB = 1_000_000


@contextlib.contextmanager
def small_disk(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of `size_bytes` mounted at `path` (made), unmounted afterwards."""
    import pytest

    path.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)]
    try:
        done = subprocess.run(mount, capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def resize(path: Path, size_bytes: int) -> None:
    """Give the tmpfs at `path` a new size (room freed, or taken)."""
    remount = ["mount", "-o", f"remount,size={size_bytes}", str(path)]
    subprocess.run(remount, check=True, capture_output=True)


def fill(path: Path) -> Path:
    """Write a file into the filesystem of folder `path` until it has no byte left."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
        with contextlib.suppress(OSError):
            while f.write(b"\0"):
                pass
    return filler
