"""`rl --help`: each config group's options, then every setting with its default and the first
sentence of its description, read from the schema's field docstrings (rl/core/config.py) without
importing anything heavy; a line that does not show its whole description says how to read it:
`rl --help <key>` (a setting, or a group or section for each of its settings) prints it whole.
`rl --cfg job` still prints the whole composed config."""

from __future__ import annotations

import ast
import dataclasses
import re
import textwrap
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rl.core import config
from rl.core.paths import CONF

HEADER = """\
rl: Relay, asynchronous RL for LLMs. Compose a run from config groups and override keys:
  uv run rl model=qwen3_0_6b environment=gsm8k max_steps=200
  uv run rl -m algorithm.lr=1e-6,3e-6          (a sweep: one run per point)
  uv run rl model=glm5 parallel=ep8 cluster=slurm dry_run=true
  uv run rl --cfg job --resolve                 (the whole composed config, values resolved)
"""
FOOTER = """\
A description that goes on ends in (more: rl --help <key>): that prints it whole, and
rl --help <group or section> every description in it (e.g. rl --help algorithm).
dry_run=true prints the plan without starting anything; action=status shows the newest run;
resume=<run dir> continues one; with cluster=kubernetes, action=manifests prints the run's
objects. Docs: README.md, docs/."""
WIDTH = 90
"""Of a setting's description in the list; `rl --help <key>` wraps it whole to this width."""


def field_docs() -> dict[str, dict[str, str]]:
    """Each schema class's fields and their docstrings (the string under each field)."""
    tree = ast.parse(Path(config.__file__).read_text())
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = docs.setdefault(node.name, {})
        for field, doc in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)
            ):
                fields[field.target.id] = doc.value.value
    return docs


def first_sentence(text: str, width: int = WIDTH) -> str:
    flat = " ".join(text.split()).replace("e.g. ", "e.g.\0").replace("i.e. ", "i.e.\0")
    sentence = re.split(r"(?<=[.;])\s", flat, maxsplit=1)[0].rstrip(".;").replace("\0", " ")
    return sentence if len(sentence) <= width else sentence[: width - 3] + "..."


def summary(text: str, key: str) -> str:
    """A setting's description for its line of the list: the first sentence, and where that
    is not all of it (cut, or more sentences follow) how to read the rest."""
    whole = " ".join(text.split()).rstrip(".")
    if first_sentence(text) == whole:
        return whole
    more = f" (more: rl --help {key})"
    return first_sentence(text, max(WIDTH - len(more), 40)) + more


def _schema_class(field: dataclasses.Field) -> type | None:
    """The schema dataclass a field holds (a group or a nested section), if it holds one."""
    found = getattr(config, str(field.type).split(" ")[0], None)
    return found if dataclasses.is_dataclass(found) else None


def _lines(cls: type, prefix: str, docs: dict[str, dict[str, str]], values: Any) -> list[str]:
    lines = []
    for field in dataclasses.fields(cls):
        if _schema_class(field) is not None:
            continue  # listed as a section of its own
        key = f"{prefix}{field.name}"
        shown = _value(values, key)
        if len(shown) > 30:
            shown = shown[:27] + "..."
        doc = summary(docs.get(cls.__name__, {}).get(field.name, ""), key)
        lines.append(f"  {key}{shown}".ljust(44) + f" {doc}")
    return lines


def _value(values: Any, key: str) -> str:
    """`=value` as the config composed it ("" where it did not compose, or holds None)."""
    value = None if values is None else OmegaConf.select(values, key)
    return "" if value is None else f"={getattr(value, 'value', value)}"


def composed(overrides: list[str]) -> Any:
    """The config `rl <overrides>` composes, resolved (None when it does not compose: the
    help then shows no values)."""
    from hydra import compose, initialize_config_dir

    config.register()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    except Exception:  # noqa: BLE001 - the help still shows groups and descriptions
        return None


def found_options(groups: list[str]) -> dict[str, list[str]]:
    """Each group's options where `rl` finds them: conf/, and the `conf` of each installed
    environment package (hydra_plugins/relay_environments.py)."""
    from hydra import initialize_config_dir

    from launcher.errors import group_options

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return {group: group_options(group) for group in groups}


def sections() -> list[tuple[str, type]]:
    """The run-level keys, then each group and nested section, with its schema class."""
    found: list[tuple[str, type]] = [("", config.RunConfig)]
    for field in dataclasses.fields(config.RunConfig):
        cls = _schema_class(field)
        if cls is not None:
            found.append((field.name, cls))
            found += [
                (f"{field.name}.{inner.name}", _schema_class(inner))
                for inner in dataclasses.fields(cls)
                if _schema_class(inner) is not None
            ]
    return found


def format_help(overrides: list[str]) -> str:
    """The help, with the values the given overrides compose to (the defaults without)."""
    docs = field_docs()
    values = composed(overrides)
    out = [HEADER, "Config groups (group=option; [the default]):"]
    chosen = {
        key: value
        for entry in OmegaConf.load(CONF / "config.yaml").defaults
        if OmegaConf.is_dict(entry)
        for key, value in entry.items()
    }
    groups = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")
    for group, options in found_options(groups).items():
        default = chosen.get(group)
        marked = [f"[{o}]" if o == default else o for o in options]
        out.append(f"  {group:<12} {', '.join(marked)}")
    out.append(
        "  hydra/launcher=relay_slurm  (sweep points as Slurm array tasks, sized from the run)"
    )
    out.append("")
    out.append("Settings (key=value as composed with any overrides given, then what it is):")
    for name, cls in sections():
        title = first_sentence(docs.get("RunConfig", {}).get(name.split(".")[0], ""))
        if name:
            out.append(f"{name}: {title}" if "." not in name else f"{name}:")
        out += _lines(cls, f"{name}." if name else "", docs, values)
    out.append("")
    out.append(FOOTER)
    return "\n".join(out)


def describe(keys: list[str], overrides: list[str]) -> str:
    """The whole description of each of `keys` (a setting; a group or section: each of its
    settings), with its value as `overrides` compose it; ConfigError for a key the schema
    does not have."""
    from launcher.errors import ConfigError, unknown_key

    docs, values = field_docs(), composed(overrides)
    out: list[str] = []
    for key in keys:
        found = [
            (f"{name}.{field.name}" if name else field.name, cls, field)
            for name, cls in sections()
            for field in dataclasses.fields(cls)
            if _schema_class(field) is None
        ]
        chosen = [entry for entry in found if entry[0] == key or entry[0].startswith(f"{key}.")]
        if not chosen:
            raise ConfigError(unknown_key(key))
        for name, cls, field in chosen:
            text = " ".join(docs.get(cls.__name__, {}).get(field.name, "").split())
            out.append(f"{name}{_value(values, name)}")
            out += textwrap.wrap(text, WIDTH, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(out)
