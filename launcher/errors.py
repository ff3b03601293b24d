"""The launcher's two user errors, and turning Hydra and OmegaConf composition errors into one
line a user can act on.

A leaf: every launcher module raises these, so this one imports none of them.
"""

from __future__ import annotations

import re

from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A run config that cannot start (already phrased for the user)."""


class PlanError(ValueError):
    """A config that cannot run; the message names the key and what would be valid."""


def _options(group: str) -> list[str]:
    from hydra.core.global_hydra import GlobalHydra

    gh = GlobalHydra.instance()
    if not gh.is_initialized():
        return []
    return sorted(gh.hydra.config_loader.get_group_options(group))  # type: ignore[union-attr]


def one_line(err: BaseException) -> str | None:
    """A one-line message for a config error, or None when `err` is not one."""
    if isinstance(err, PlanError):
        return str(err)
    if isinstance(err, MissingConfigException):
        match = re.search(r"'([\w/]+)/([^'/]+)'", str(err))
        if match:
            group, option = match.groups()
            valid = err.options or _options(group)
            return f"{group}={option}: no such option; valid: {', '.join(sorted(valid))}"
        return str(err).splitlines()[0]
    if isinstance(err, ConfigCompositionException | OmegaConfBaseException):
        cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
        text = str(cause).splitlines()
        head = text[0].strip() if text else type(err).__name__
        key = next((line for line in text if line.strip().startswith("full_key:")), "")
        key = key.split(":", 1)[1].strip() if key else ""
        return f"{key}: {head}" if key and key not in head else head
    return None
