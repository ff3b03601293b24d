"""The `rl` command: a thin Hydra entry that composes the run and calls `launch`.

Config errors (an unknown option, key or type, a cross-group contradiction) end in one line
on stderr naming the key and what is valid, with a non-zero exit and nothing started; so does
a full disk met before the roles start. `rl action=status [run_dir=<dir>]` is answered before
Hydra is imported (launcher/watch/status.py); `rl --help` lists the settings and `rl --help <key>`
prints one's whole description (launcher/help.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rl.core.paths import CONF

if TYPE_CHECKING:
    from omegaconf import DictConfig

CONF_DIR = str(CONF)


def _run(cfg: DictConfig) -> None:
    """What Hydra calls with the composed config (once per point of a sweep)."""
    from launcher.errors import ConfigError, PlanError, check_added_keys
    from launcher.run import launch
    from rl.core.disk import as_disk_full

    try:
        check_added_keys()
        launch(cfg)
    except (ConfigError, PlanError) as err:
        # SystemExit passes through Hydra's job wrapper without its multi-line report.
        sys.stderr.write(f"error: {err}\n")
        sys.exit(2)
    except Exception as err:
        # A full disk before the roles started (the run directory, the model's cache).
        full = as_disk_full(err, Path.cwd())
        if full is None:
            raise
        sys.stderr.write(f"error: {full}\n")
        sys.exit(1)


def _hydra_entry() -> None:
    """Compose the run from the command line and conf/ with Hydra, and run it."""
    import hydra

    from rl.core.config import register

    register()
    hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")(_run)()


def main() -> None:
    """Console entry point of `rl`."""
    # Every role is a process importing torch: without a bytecode cache each would compile it
    # from source again (~6 s of CPU a process, every run), so the run's processes write one.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    from launcher.watch.status import fast_status

    try:
        if fast_status(sys.argv[1:]):
            return
        if {"--help", "-h"} & set(sys.argv[1:]):
            _help([a for a in sys.argv[1:] if not a.startswith("-")])
            return
    except BrokenPipeError:  # `rl --help | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    from launcher.errors import one_line

    # Let composition errors reach us so they can be reported in one line.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        _hydra_entry()
    except KeyboardInterrupt:  # Ctrl-C before the run's own handling (composing, planning)
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except Exception as err:  # noqa: BLE001 - only config errors are summarised
        message = one_line(err)
        if message is None:
            raise
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)


def _help(words: list[str]) -> None:
    """`rl --help [overrides]`: the groups and settings; `rl --help <key> ...`: the whole
    description of each key given (a setting, group or section)."""
    from launcher.errors import ConfigError
    from launcher.help import describe, format_help

    overrides = [w for w in words if "=" in w]
    keys = [w for w in words if "=" not in w]
    try:
        print(describe(keys, overrides) if keys else format_help(overrides))
    except ConfigError as err:
        sys.stderr.write(f"error: {err}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
