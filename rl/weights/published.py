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

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rl.core.rundir import RunDir, checksum_problem, is_complete, shared_point


class RefusedWeights(ValueError):
    """A load request the server refuses; its served weights and version stay as they were."""


def published_dir(run_dir: Path | None, version: Any, path: Any = None) -> Path:
    """The directory of `version` as this run published it, or `RefusedWeights`.

    `path`, when the caller names one, must be that same directory: `<run>/weights/step_N`,
    resolved, so that neither the step directory nor anything above it inside the run may be a
    symbolic link elsewhere. A published version is one whose directory is complete.
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
    if not is_complete(real):
        published = layout.published_versions()
        raise RefusedWeights(
            f"version {version} is not published in {layout.weights} (no complete {expected.name};"
            f" published: {published[-5:]})"
        )
    if problem := checksum_problem(real):
        raise RefusedWeights(problem)
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


def checked_tensors(folder: Path) -> Iterator[tuple[str, Any]]:
    """Every tensor of the safetensors files in `folder`, by name, each checked finite as it is
    read; a truncated, corrupt or unreadable file, or a symbolic link, is `RefusedWeights`."""
    from safetensors import SafetensorError, safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise RefusedWeights(f"{folder} holds no *.safetensors files")
    for file in files:
        if file.is_symlink():
            raise RefusedWeights(f"{file} is a symbolic link")
        try:
            with safe_open(file, "pt") as reader:
                for name in reader.keys():
                    tensor = reader.get_tensor(name)
                    check_finite(name, tensor, str(file))
                    yield name, tensor
        except (SafetensorError, OSError) as exc:
            raise RefusedWeights(f"{file} is not a readable safetensors file: {exc}") from exc


def read_checkpoint(folder: Path) -> dict[str, Any]:
    """All tensors of `folder`, checked (the embedded engine copies them in afterwards)."""
    return dict(checked_tensors(folder))


def check_checkpoint(folder: Path) -> None:
    """Read and check every tensor of `folder`, one at a time (memory: the largest tensor), for
    a server that loads the files itself afterwards (vLLM)."""
    for _ in checked_tensors(folder):
        pass
