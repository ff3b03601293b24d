"""Environments of other packages, found through the `relay.environments` entry point group.

The package is the one docs/environments.md shows, written from that page's listings, so the
page stays true: its environments play as the page says, the planner finds them by name
without importing them, unknown and clashing names fail in one line, and the slow test
installs the package as a user would and trains on it through `rl`.

The fast tests make a package visible as installed by writing its metadata (a `.dist-info`
folder, what an installer writes and `importlib.metadata` reads) into a folder on `sys.path`
and PYTHONPATH; nothing is installed into the shared virtual environment.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

from launcher.help import format_help
from launcher.plan.planner import plan
from rl.core.config import EnvironmentConfig
from rl.core.kinds import is_train
from rl.core.paths import CONF
from rl.envs import (
    BUILT_IN,
    ENTRY_POINT_GROUP,
    Example,
    config_packages,
    make_environment,
    registry,
)
from tests.support.runs import ROOT, compose_run

DOC = ROOT / "docs" / "environments.md"
PACKAGE = "relay-games"
SEARCH_PATH = "hydra.searchpath=[pkg://relay_games.conf]"


def doc_files() -> dict[str, str]:
    """The package's files by path, as docs/environments.md shows them: each fenced block whose
    first line is `# relay-games/<path>`, and the files its tree marks `(empty)`."""
    text = DOC.read_text()
    listed = re.findall(r"```\w*\n# relay-games/(\S+)\n(.*?)```", text, re.S)
    empty = re.findall(r"^ +(\S+) +\(empty\)$", text, re.M)
    return {**dict.fromkeys(empty, ""), **dict(listed)}


def write_package(root: Path) -> Path:
    """The documented package's source tree, as root/relay-games."""
    package = root / PACKAGE
    for path, text in doc_files().items():
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text(text)
    return package


def declare(site: Path, dist: str, points: dict[str, str]) -> None:
    """Distribution `dist`'s metadata with entry points `points`, as an installer writes it."""
    info = site / f"{dist.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    lines = [f"[{ENTRY_POINT_GROUP}]", *(f"{name} = {value}" for name, value in points.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


def on_path(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """`folder` importable here and in child processes."""
    monkeypatch.syspath_prepend(str(folder))
    inherited = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), inherited])))


def rl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(autouse=True)
def forget_packages() -> Iterator[None]:
    """Each test's packages are its own: forget the modules of them it imported."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("relay_"):
            del sys.modules[name]


@pytest.fixture
def games(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The documented package, importable and declared with its pyproject's entry points."""
    package = write_package(tmp_path)
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    declare(package, project["name"], project["entry-points"][ENTRY_POINT_GROUP])
    on_path(monkeypatch, package)
    return package


def environment_config(package: Path, option: str, **overrides: Any) -> DictConfig:
    """The package's config option `option`, checked against the schema as `rl` does."""
    option_file = package / "relay_games" / "conf" / "environment" / f"{option}.yaml"
    merged = OmegaConf.merge(OmegaConf.structured(EnvironmentConfig), OmegaConf.load(option_file))
    return OmegaConf.merge(merged, overrides)


def test_repeat_digits_scores_the_share_of_digits_copied(games: Path) -> None:
    env = make_environment(environment_config(games, "repeat_digits", args={"length": 3}))
    assert type(env).__module__ == "relay_games.repeat_digits"
    assert (env.name, env.max_turns, len(env.eval_examples())) == ("repeat_digits", 1, 64)
    assert all(re.fullmatch(r"repeat: \d{3}\n", e.prompt) for e in env.train_examples())
    example = Example("repeat: 123\n", "123")
    assert env.score(example, " 123\n") == 1.0 and env.exact_match(example, "123")
    assert env.score(example, "124") == pytest.approx(2 / 3)
    assert env.score(example, "1234") == pytest.approx(3 / 4)
    assert env.score(example, "") == 0.0 and not env.exact_match(example, "124")
    with pytest.raises(ValueError, match="environment.args.digits: unknown; valid: length"):
        make_environment(environment_config(games, "repeat_digits", args={"digits": 3}))


def test_guess_number_answers_higher_or_lower_until_found(games: Path) -> None:
    env = make_environment(environment_config(games, "guess_number"))
    assert (env.name, env.max_turns, len(env.eval_examples())) == ("guess_number", 7, 32)
    example = Example("find my number from 1 to 100. guess:", "37")
    assert env.respond(example, ["50"]) == "\nlower. guess:"
    assert env.respond(example, ["50", " 25"]) == "\nhigher. guess:"
    assert env.respond(example, ["50", "25", "no idea"]) == "\nhigher. guess:"
    assert env.respond(example, ["50", "25", "37"]) is None
    assert env.respond(example, ["1"] * 7) is None  # out of guesses
    assert env.score(example, ["50", "25", "37"]) == 1.0
    assert env.exact_match(example, ["50", "25", "37"])
    assert env.score(example, ["1"] * 7) == 0.0


def test_an_unknown_name_lists_installed_environments(games: Path) -> None:
    out = rl("environment.name=guess_numbr", "dry_run=true")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    names = re.search(r"valid: (.*) \(installed packages", lines[0]).group(1).split(", ")
    assert names == [*BUILT_IN, "guess_number", "repeat_digits"]  # installed ones by name
    assert lines[0] in DOC.read_text()  # the page shows this very line


@pytest.mark.parametrize(
    "search_path",
    ["", SEARCH_PATH, "--config-dir={package}/relay_games/conf"],
    ids=["installed-package", "installed-package-named", "config-dir"],
)
def test_the_package_s_config_options_compose(games: Path, search_path: str) -> None:
    """Every way of reaching the package's YAML, without a warning from Hydra (its search path
    skips a package without `conf/__init__.py`, with one): installed, with no flag (Relay's
    search-path plugin finds it through its entry points), named on the search path, or
    through --config-dir."""
    option = ["environment=repeat_digits", "environment.args.length=6"]
    flags = [search_path.format(package=games)] if search_path else []
    out = rl(*flags, *option, "--cfg", "job")
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    env = OmegaConf.create(out.stdout).environment
    assert (env.name, env.max_tokens, env.eval_size, env.args) == (
        "repeat_digits",
        8,
        64,
        {"length": 6},
    )


def test_installed_packages_options_are_found_without_importing_them(
    games: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The search-path plugin's list: the documented package's `conf`, not a module that
    declares an environment but ships no options; tests compose, and --help lists, the
    package's options as `rl` does."""
    (tmp_path / "relay_bare.py").write_text("raise ImportError('relay_bare was imported')\n")
    declare(tmp_path, "relay-bare", {"bare": "relay_bare:Bare"})
    on_path(monkeypatch, tmp_path)
    assert config_packages() == {"relay_games.conf": "relay-games"}
    assert not {"relay_games", "relay_bare"} & set(sys.modules)
    assert compose_run("environment=guess_number").environment.max_tokens == 4
    listed = next(line for line in format_help([]).splitlines() if "environment " in line)
    names = set(listed.split(None, 1)[1].replace("[", "").replace("]", "").split(", "))
    assert {"guess_number", "repeat_digits"} <= names, listed
    # Another Hydra application's search path (one without Relay's conf/) is left alone.
    assert "pkg://relay_games.conf" in search_path(CONF)
    assert "pkg://relay_games.conf" not in search_path(tmp_path)


def search_path(config_dir: Path) -> list[str]:
    """The search path Hydra builds for an application whose configs are in `config_dir`."""
    from hydra._internal.utils import create_config_search_path

    return [element.path for element in create_config_search_path(str(config_dir)).get_path()]


def test_the_plan_finds_a_package_s_environment_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "relay_heavy.py").write_text("raise ImportError('relay_heavy was imported')\n")
    declare(tmp_path, "relay-heavy", {"heavy": "relay_heavy:Heavy"})
    on_path(monkeypatch, tmp_path)
    cfg = compose_run("environment.name=heavy")
    assert plan(cfg).run_name == "heavy-tiny"
    assert "relay_heavy" not in sys.modules
    with pytest.raises(ImportError, match="relay_heavy was imported"):
        make_environment(cfg.environment)  # what the orchestrator does


def test_a_package_reusing_a_built_in_name_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    declare(tmp_path, "relay-impostor", {"reverse_text": "relay_impostor:Reverse"})
    on_path(monkeypatch, tmp_path)
    expected = (
        "environment reverse_text: package relay-impostor declares it (relay_impostor:Reverse) "
        "in the relay.environments entry point group, but Relay has one of that name built in; "
        "rename that entry point or uninstall relay-impostor"
    )
    out = rl("dry_run=true")  # environment=reverse_text, the default
    assert (out.returncode, out.stderr) == (2, f"error: {expected}\n")
    with pytest.raises(ValueError) as refused:
        make_environment(compose_run().environment)
    assert str(refused.value) == expected


def test_two_packages_declaring_one_name_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    declare(tmp_path, "relay-first", {"digits": "relay_first:Digits"})
    declare(tmp_path, "relay-second", {"digits": "relay_second:Digits"})
    on_path(monkeypatch, tmp_path)
    with pytest.raises(ValueError, match=r"package relay-\w+ declares it too; rename") as refused:
        registry()
    assert {"relay-first", "relay-second"} <= set(re.findall(r"relay-\w+", str(refused.value)))


def test_an_entry_point_to_something_else_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    declare(tmp_path, "relay-wrong", {"decoder": "json:JSONDecoder"})
    on_path(monkeypatch, tmp_path)
    with pytest.raises(ValueError, match="json:JSONDecoder is not a subclass of rl.envs.Env"):
        make_environment(compose_run("environment.name=decoder").environment)


@pytest.mark.slow
def test_trains_on_an_installed_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Install the documented package (into a folder of its own), then train three steps on
    its single-turn environment through `rl`, with the config option it ships (found with no
    flag, as the page says)."""
    uv = shutil.which("uv")
    assert uv, "installing the package needs uv (pip install uv)"
    site = tmp_path / "site"
    install = [uv, "pip", "install", "--quiet", "--no-deps", "--python", sys.executable]
    out = subprocess.run(
        [*install, "--target", str(site), str(write_package(tmp_path))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(site), "WANDB_MODE": "disabled"}
    env["RELAY_CACHE"] = str(tmp_path / "cache")
    small = ["max_steps=3", "warmup.steps=0", "environment.eval_size=8", "environment.eval_every=0"]
    small += ["environment.prompts_per_step=4", "environment.group_size=2"]
    out = rl("environment=repeat_digits", *small, f"hydra.run.dir={run_dir}", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if is_train(r)]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(r["samples"] == 8 and 0.0 <= r["reward/mean"] <= 1.0 for r in train)
    cfg = OmegaConf.load(run_dir / "config.yaml")
    assert (cfg.name, cfg.environment.name, cfg.environment.max_tokens) == (
        "repeat_digits-tiny",
        "repeat_digits",
        8,  # from the package's config option
    )
    # Every logged reward is the package's: recompute it with the installed environment.
    on_path(monkeypatch, site)
    environment = make_environment(cfg.environment)
    samples = [json.loads(line) for line in (run_dir / "rollouts" / "samples.jsonl").open()]
    assert samples and all(s["prompt"] == f"repeat: {s['answer']}\n" for s in samples)
    for sample in samples:
        example = Example(sample["prompt"], sample["answer"])
        assert sample["reward"] == environment.score(example, sample["completion"])
