"""The launcher's two user errors, and turning Hydra and OmegaConf composition errors into one
line a user can act on.

A leaf: every launcher module raises these, so this one imports none of them.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import typing
from functools import cache


class ConfigError(ValueError):
    """A run config that cannot start (already phrased for the user)."""


class PlanError(ValueError):
    """A config that cannot run; the message names the key and what would be valid."""


def refuse(key: str, message: str) -> typing.NoReturn:
    """Raise the PlanError `key: message`."""
    raise PlanError(f"{key}: {message}")


def group_options(group: str) -> list[str]:
    """The options of config group `group` on the search path of the initialised Hydra
    (Relay's conf/ and installed environment packages'); none when Hydra is not initialised."""
    from hydra.core.global_hydra import GlobalHydra

    gh = GlobalHydra.instance()
    if not gh.is_initialized():
        return []
    return sorted(gh.hydra.config_loader.get_group_options(group))  # type: ignore[union-attr]


def one_line(err: BaseException) -> str | None:
    """A one-line message for a config error, or None when `err` is not one."""
    from hydra.errors import (
        ConfigCompositionException,
        MissingConfigException,
        OverrideParseException,
    )
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(err, PlanError):
        return str(err)
    if isinstance(err, OverrideParseException):  # e.g. `key=[--x=1]`: its items need quotes
        return (
            f"cannot read the override {err.override!r}: {str(err).splitlines()[0]} (quote "
            "an item holding '=' or spaces: 'key=[\"--mpi=pmix\"]')"
        )
    if isinstance(err, MissingConfigException):
        match = re.search(r"'([\w/]+)/([^'/]+)'", str(err))
        if match:
            group, option = match.groups()
            valid = err.options or group_options(group)
            return f"{group}={option}: no such option; valid: {', '.join(sorted(valid))}"
        return str(err).splitlines()[0]
    if isinstance(err, ConfigCompositionException | OmegaConfBaseException):
        cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
        text = str(cause).splitlines()
        head = text[0].strip() if text else type(err).__name__
        key = next((line for line in text if line.strip().startswith("full_key:")), "")
        key = key.split(":", 1)[1].strip() if key else ""
        if re.match(r"Key '[^']+' not in '\w+'", head) and key:
            return unknown_key(_given_key(key))
        if re.match(r"Key '[^']+' is not in struct", head):
            return not_in_config(err, cause)
        if head.startswith("Ambiguous value for argument"):
            return (
                f"{head}: to sweep over the values add -m (--multirun); for a list write "
                "key=[a,b]; for a string with a comma, quote it"
            )
        return f"{key}: {head}" if key and key not in head else head
    return None


def unknown_key(key: str) -> str:
    """`key: no such setting`, with the closest real one when there is one."""
    parent, _, leaf = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in schema_keys() if k.rpartition(".")[0] == parent}
    if siblings:  # the group is right: compare the last part alone
        match = [siblings[m] for m in difflib.get_close_matches(leaf, siblings, 1, 0.75)]
    else:
        match = difflib.get_close_matches(key, schema_keys(), n=1, cutoff=0.75)
    hint = f"; did you mean {match[0]}?" if match else " (uv run rl --help lists them)"
    return f"{key}: no such setting{hint}"


def not_in_config(err: BaseException, cause: BaseException) -> str:
    """`key: not in the config`, for an override of a key that a free-form dict (an
    environment's `args`, `model.hf_config`, ...) does not have: the closest key it has, and
    the `+key=value` that adds a new one (Hydra's own hint, which OmegaConf's error drops)."""
    typed = re.search(r"^Could not override '([^']+)'", str(err), re.M)
    missing = str(getattr(cause, "full_key", ""))
    key = typed.group(1) if typed else missing
    if missing.startswith(f"{key}."):  # a dict given whole, with a key its target lacks
        key = missing
    add = re.search(r"^To append to your config use (\+.*)$", str(err), re.M)
    adding = add.group(1) if add else f"+{key}=<value>"
    parent = getattr(cause, "parent_node", None)
    siblings = [str(k) for k in parent.keys()] if parent is not None else []
    close = difflib.get_close_matches(missing.rpartition(".")[2], siblings, 1, 0.75)
    if close:
        prefix = missing.rpartition(".")[0]
        return f"{key}: not in the config; did you mean {prefix}.{close[0]}? (to add it: {adding})"
    return f"{key}: not in the config; to add it, write {adding}"


def _given_key(key: str) -> str:
    """The whole key as typed on the command line that OmegaConf's `key` (where it stopped
    recognising it) is the start of; `key` itself if none is."""
    for arg in sys.argv[1:]:
        typed = arg.lstrip("+~").split("=", 1)[0]
        if typed == key or typed.startswith(f"{key}."):
            return typed
    return key


def schema_keys() -> list[str]:
    """Every dotted key of the run's schema (rl/core/config.py's RunConfig and its groups)."""
    return _schema()[0]


def open_keys() -> list[str]:
    """The schema's free-form dicts, where `+key.name=value` adds an entry."""
    return _schema()[1]


@cache
def _schema() -> tuple[list[str], list[str]]:
    from rl.core.config import RunConfig

    keys: list[str] = []
    dicts: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            key, kind = prefix + field.name, hints[field.name]
            keys.append(key)
            if typing.get_origin(kind) is dict:
                dicts.append(key)
            nested = [t for t in (kind, *typing.get_args(kind)) if dataclasses.is_dataclass(t)]
            if nested:
                walk(nested[0], f"{key}.")

    walk(RunConfig, "")
    return keys, dicts


def check_added_keys() -> None:
    """ConfigError for a `+key=value` that adds a key the schema does not have (Hydra adds it
    silently, and nothing would read it). Adding to a free-form dict (`environment.args`,
    `cluster.sbatch_extra`, `model.hf_config`) and choosing a config group are fine."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task))
    for override in overrides:
        key = override.key_or_group
        if not override.is_add() or key in schema_keys() or group_options(key):
            continue
        if any(key.startswith(f"{d}.") for d in open_keys()):
            continue
        raise ConfigError(f"{override.input_line}: {unknown_key(key).split(': ', 1)[1]}")
