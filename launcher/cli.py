"""The `rl` command: a thin Hydra entry that composes the run and calls `launch`.

Config errors (an unknown option, key or type, a cross-group contradiction) end in one line
on stderr naming the key and what is valid, with a non-zero exit and nothing started; so does
a full disk met before the roles start.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from rl.core.config import register
from rl.core.paths import CONF

register()
CONF_DIR = str(CONF)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_entry(cfg: DictConfig) -> None:
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


def main() -> None:
    """Console entry point of `rl`."""
    from launcher.errors import one_line

    if {"--help", "-h"} & set(sys.argv[1:]):
        from launcher.help import format_help

        print(format_help([a for a in sys.argv[1:] if not a.startswith("-")]))
        return
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


if __name__ == "__main__":
    main()
