"""Every `rl` command that README.md and docs/ print in a code block runs as printed, so that
none can rot: at `dry_run=true` where it would train (a dry run plans hardware this machine
lacks and says so), and where the page shows the `error:` line it answers, that line.

The commands run in a checkout as the pages describe it: the repository's folders linked into
a scratch directory (so that sweeps' and dry runs' outputs land there), docs/environments.md's
`relay-games` package next to it and visible as installed, its `my_conf` folder in it, and
tests/verifiers_envs on PYTHONPATH (README's `uv pip install -e` of the example package)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.runs import ROOT
from tests.test_env_plugins import declare, doc_files, write_package

RL = str(Path(sys.executable).with_name("rl"))
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
COMMAND = re.compile(r"^\s*(?:\$ )?uv run rl\b(.*)$")
LINKED = ("conf", "sweeps", "docs", "tests", "launcher", "rl", ".venv-vllm")
# What a dry run cannot stand for: these print or plan and start nothing.
RUNS_AS_IS = ("dry_run=true", "--help", "--cfg", "action=status")


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str
    error: str | None  # the `error:` line the page shows it answering

    def argv(self) -> list[str]:
        args = shlex.split(self.text, comments=True)
        if self.error is None and not any(flag in args for flag in RUNS_AS_IS):
            args.append("dry_run=true")
        return [RL, *args]


def printed_commands() -> list[Command]:
    """Each `uv run rl ...` line of a fenced block (with its `\\` continuations) and the line
    printed after it when that is an error."""
    found = []
    for page in PAGES:
        lines, fenced, i = page.read_text().splitlines(), False, 0
        while i < len(lines):
            line = lines[i]
            fenced ^= line.lstrip().startswith("```")
            match = COMMAND.match(line) if fenced else None
            start = i
            if match:
                text = match.group(1)
                while text.rstrip().endswith("\\"):
                    i += 1
                    text = text.rstrip()[:-1] + " " + lines[i].strip()
                after = lines[i + 1].strip() if i + 1 < len(lines) else ""
                error = after if after.startswith("error:") else None
                name = str(page.relative_to(ROOT))
                found.append(Command(name, start + 1, text.strip(), error))
            i += 1
    return found


COMMANDS = printed_commands()


def checkout(root: Path) -> tuple[Path, dict[str, str]]:
    """A directory standing for the checkout, and the environment the pages' commands run in."""
    here = root / "relay"
    here.mkdir()
    for name in LINKED:
        if (ROOT / name).exists():
            (here / name).symlink_to(ROOT / name)
    package = write_package(root)  # root/relay-games: `../relay-games` from the checkout
    site = root / "site"
    games = {name: f"relay_games.{name}:{cls}" for name, cls in
             (("repeat_digits", "RepeatDigits"), ("guess_number", "GuessNumber"))}  # fmt: skip
    declare(site, "relay-games", games)
    for path, text in doc_files_of("my_conf").items():
        (here / path).parent.mkdir(parents=True, exist_ok=True)
        (here / path).write_text(text)
    verifiers_envs = ROOT / "tests" / "verifiers_envs" / "relay_reverse"
    path = [str(site), str(package), str(verifiers_envs), str(ROOT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "WANDB_MODE": "disabled",
           "PWD": str(here)}  # fmt: skip
    return here, env


def doc_files_of(folder: str) -> dict[str, str]:
    """The files under `folder` that docs/environments.md lists (`# <folder>/<path>` first)."""
    text = (ROOT / "docs" / "environments.md").read_text()
    listed = re.findall(rf"```\w*\n# ({folder}/\S+)\n(.*?)```", text, re.S)
    return dict(listed)


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict[Command, subprocess.CompletedProcess]:
    here, env = checkout(tmp_path_factory.mktemp("docs"))

    def run(command: Command) -> subprocess.CompletedProcess:
        argv = [os.path.expandvars(a.replace("$PWD", str(here))) for a in command.argv()]
        return subprocess.run(argv, cwd=here, env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(COMMANDS, pool.map(run, COMMANDS), strict=True))


def test_the_pages_print_commands() -> None:
    pages = {c.page for c in COMMANDS}
    assert {"README.md", "docs/coming_from_trl.md", "docs/environments.md"} <= pages, pages
    assert doc_files(), "docs/environments.md lists no relay-games files"
    assert doc_files_of("my_conf"), "docs/environments.md lists no my_conf files"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.page}:{c.line}")
def test_a_printed_command_runs_as_printed(
    command: Command, answers: dict[Command, subprocess.CompletedProcess]
) -> None:
    answer = answers[command]
    said = f"{command.page}:{command.line}: {' '.join(command.argv())}\n{answer.stderr[-3000:]}"
    if command.error is None:
        assert answer.returncode == 0, said
        assert "error:" not in answer.stderr, said
    else:
        assert answer.returncode != 0, said
        assert command.error in answer.stderr.splitlines(), said
