"""Which of a run's directories this command made: so that a dry or refused run removes only
those, never a directory the user made.

Hydra makes the run's directory (and any missing parents) before Relay's code runs. Its
callback `on_run_start` (a multirun's `on_multirun_start`) comes first: `BeforeHydra` records
there the nearest directory that already exists on the way to the run (or sweep) directory;
everything below it is this command's. (`${now:...}` in the path resolves to the same time
both times: Hydra caches it.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

_existed: list[Path] = []


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


class BeforeHydra(Callback):
    """Records, before Hydra makes the run's directory, the nearest one that exists."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        self._record(OmegaConf.select(config, "hydra.run.dir"))

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._record(OmegaConf.select(config, "hydra.sweep.dir"))

    @staticmethod
    def _record(directory: Any) -> None:
        if directory is not None:
            _existed.append(_nearest_existing(Path(str(directory)).absolute()))


def remove_made(run_dir: Path) -> None:
    """Remove `run_dir` and its parents that this command made, while they are empty; nothing
    that existed before it (or anything, where nothing was recorded)."""
    if not _existed:
        return
    kept = _existed[-1]
    path = run_dir.absolute()
    while path != kept and path.is_relative_to(kept):
        try:
            path.rmdir()
        except OSError:
            return
        path = path.parent
