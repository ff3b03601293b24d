"""What an inference server checks before it loads weights from disk (both backends).

`/admin/load_weights` is an admin route, but what it is asked to load must still be a policy
this run published: a path outside the run (or a symbolic link out of it), a version nobody
published, a file unlike the SHA-256 the trainer recorded (SHA256SUMS), a truncated or corrupt
file, or a tensor
holding NaN or Inf would otherwise become the served policy (NaN weights make the server sample
pad tokens with null logprobs while reporting the version as healthy). Each such request is
refused with `RefusedWeights` (answered 400) before anything changes: the server keeps serving
the weights and version it had. An older published version loads like any other: the
orchestrator decides which version generates each batch (rl/core/derive.py), and a restarted
server that came back on the newest is told to load the one the schedule wants.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rl.core.rundir import CHECKSUMS, RunDir, shared_point


class RefusedWeights(ValueError):
    """A load request the server refuses; its served weights and version stay as they were."""


def published_dir(run_dir: Path | None, version: Any, path: Any = None) -> Path:
    """The directory of `version` as this run published it, or `RefusedWeights`.

    `path`, when the caller names one, must be that same directory: `<run>/weights/step_N`,
    resolved, so that neither the step directory nor anything above it inside the run may be a
    symbolic link elsewhere. A published version is one the trainer recorded (`PUBLISHED`)
    whose directory is complete; its files are checked against SHA256SUMS as they are read
    (`verified_files`), not here: a file changed after a check here would be loaded unchecked.
    """
    if run_dir is None:
        raise RefusedWeights("this server has no run directory to load published weights from")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise RefusedWeights(f"version={version!r}: a published version is an integer >= 0")
    layout = RunDir(run_dir)
    expected = layout.weights_for(version)
    real = expected.resolve()
    if real != layout.weights.resolve() / expected.name:
        raise RefusedWeights(f"{expected} is a symbolic link out of the run's weights directory")
    if path is not None and Path(str(path)).resolve() != real:
        raise RefusedWeights(
            f"path={path} is not version {version}'s published weights ({expected})"
        )
    published = layout.published_versions()
    if version not in published:
        raise RefusedWeights(
            f"version {version} is not published in {layout.weights} (the trainer's record "
            f"holds {published[-5:]})"
        )
    return real


def loading_from(run_dir: Path | None, shared: bool, adapter: str | None) -> Path | None:
    """The run directory whose published weights a load request may name: the server's own,
    or, for a sweep's shared inference (`run_dir` its service directory), the point whose
    adapter the request names."""
    if not shared or run_dir is None:
        return run_dir
    if not adapter:
        raise RefusedWeights(
            "this is a sweep's shared inference: its base is the same for every point, and a "
            "load names the point's adapter"
        )
    point = shared_point(run_dir, adapter)
    if point is None:
        raise RefusedWeights(f"adapter={adapter!r}: no point of this sweep is served by that name")
    return point


def check_finite(name: str, tensor: Any, source: str) -> None:
    """Refuse a floating-point tensor holding NaN or Inf, naming it."""
    import torch

    if not tensor.is_floating_point():
        return
    if tensor.element_size() == 1:  # float8 kinds have no isfinite of their own
        tensor = tensor.to(torch.float16)
    if not bool(torch.isfinite(tensor).all()):
        raise RefusedWeights(f"{source}: tensor {name} holds NaN or Inf")


def recorded_sums(folder: Path) -> dict[str, str]:
    """The SHA-256 the trainer recorded of each file of `folder` (SHA256SUMS), by path inside
    it; `RefusedWeights` if there is no such record, or a weights file is not in it."""
    try:
        sums = json.loads((folder / CHECKSUMS).read_text())
    except (OSError, ValueError) as exc:
        raise RefusedWeights(
            f"{folder} has no readable {CHECKSUMS} ({type(exc).__name__}): not published whole"
        ) from None
    readable = isinstance(sums, dict) and all(
        isinstance(v, str) and isinstance(k, str) and k and ".." not in Path(k).parts
        and not Path(k).is_absolute() for k, v in sums.items()
    )  # fmt: skip
    if not readable:
        raise RefusedWeights(f"{folder / CHECKSUMS} is not a record of files inside {folder}")
    unrecorded = [p.name for p in folder.glob("*.safetensors") if p.name not in sums]
    if unrecorded:
        raise RefusedWeights(
            f"{folder / unrecorded[0]} is not among the files the trainer recorded"
        )
    return sums


def _open_file(path: Path) -> Any:
    """`path` opened to read: a regular file, not through a symbolic link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise RefusedWeights(f"{path} is missing, or a symbolic link ({exc.strerror})") from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise RefusedWeights(f"{path} is not a regular file")
    return f


def _changed(path: Path) -> RefusedWeights:
    return RefusedWeights(
        f"{path} does not match the SHA-256 the trainer recorded (corrupt or changed)"
    )


def verified_files(folder: Path) -> Iterator[tuple[str, bytes]]:
    """Each file the trainer recorded of `folder`, read whole into memory and only then checked
    against its SHA-256 (`RefusedWeights` where one differs): what is loaded is the bytes that
    were checked, whatever happens to the file afterwards. (Safetensors read through a memory
    map would take a file rewritten under it: a truncation there kills the reader with
    SIGBUS.)"""
    for name, expected in sorted(recorded_sums(folder).items()):
        with _open_file(folder / name) as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() != expected:
            raise _changed(folder / name)
        yield name, data


def private_copy(folder: Path, into: Path) -> Path:
    """A copy of the files the trainer recorded of `folder` in `into` (made here, this process's
    alone), each checked against its SHA-256 as it is copied: for a server that reads the
    files itself (vLLM), what it reads can no longer change. Nothing is left on a refusal."""
    try:
        for name, expected in sorted(recorded_sums(folder).items()):
            digest = hashlib.sha256()
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with _open_file(folder / name) as source, open(target, "xb") as out:
                while chunk := source.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != expected:
                raise _changed(folder / name)
    except BaseException:
        shutil.rmtree(into, ignore_errors=True)
        raise
    return into


def checked_tensors(folder: Path, recorded: bool = True) -> Iterator[tuple[str, Any]]:
    """Every tensor of the safetensors files in `folder`, by name, each checked finite as it is
    read; a truncated, corrupt, changed or unreadable file, or a symbolic link, is
    `RefusedWeights`. `recorded`: a published version's files, read into memory and checked
    against the trainer's record (`verified_files`); else files nobody rewrites (the model's
    own checkpoint, a private copy), read through a memory map a tensor at a time."""
    from safetensors import SafetensorError, safe_open

    found = False
    if recorded:
        for name, data in verified_files(folder):
            if "/" not in name and name.endswith(".safetensors"):
                found = True
                yield from tensors_of(data, folder / name)
    for file in [] if recorded else sorted(folder.glob("*.safetensors")):
        found = True
        if file.is_symlink():
            raise RefusedWeights(f"{file} is a symbolic link")
        try:
            with safe_open(file, "pt") as reader:
                for name in reader.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    tensor = reader.get_tensor(name)
                    check_finite(name, tensor, str(file))
                    yield name, tensor
        except (SafetensorError, OSError) as exc:
            raise RefusedWeights(f"{file} is not a readable safetensors file: {exc}") from exc
    if not found:
        raise RefusedWeights(f"{folder} holds no *.safetensors files")


def tensors_of(data: bytes, source: Path) -> Iterator[tuple[str, Any]]:
    """The tensors of one safetensors file's bytes, each checked finite."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise RefusedWeights(f"{source} is not a readable safetensors file: {exc}") from exc
    for key, tensor in tensors.items():
        check_finite(key, tensor, str(source))
        yield key, tensor


def read_checkpoint(folder: Path, recorded: bool = True) -> dict[str, Any]:
    """All tensors of `folder`, checked (the embedded engine copies them in afterwards)."""
    return dict(checked_tensors(folder, recorded))


def check_checkpoint(folder: Path) -> None:
    """Read and check every tensor of `folder`, one at a time (memory: the largest tensor), for
    a server that loads the files itself afterwards (vLLM: its private copy)."""
    for _ in checked_tensors(folder, recorded=False):
        pass
