"""code_repair, an agentic environment: fix the planted bug of a small Python package with tools.

The model gets the task in the chat template of its tokenizer with four tools (`list_files`,
`read_file`, `edit_file`, `run_tests`); each turn's tool calls are executed and their results
sent back as tool turns; a turn without a tool call ends the episode (as do `max_turns` turns
or `max_episode_tokens` tokens, enforced by the orchestrator). Packages come from `tasks.py`
(seeded, thousands, held-out eval split); the tools' wire format is `tools.py`'s.

An episode's files are the task's files plus the edits of its turns, replayed in order, so the
environment keeps no state per episode. Model-written code only ever runs in `sandbox.py`,
`sandboxes` at a time. `run_tests` reports on the task's visible tests (`tests/` in its files);
the reward comes from its held-out cases instead (`tasks.py`: more calls of the same functions,
none of them a call the tests show, never shown to the model), run after the episode on the
edited package (edits to the tests do not count): the fraction of the cases that failed at the
start and pass now, less any that passed at the start and fail now (so 1 when all pass, 0 for
no change); with `call_bonus`, an episode that fixed nothing earns up to that much for making
well-formed tool calls.

Results cannot be forged by the code under test. Each run executes `runner.py` in the sandbox:
a parent that never imports the package forks a child per case, which does, and only the
parent, which no child can reach (see there), writes the report on file descriptor 3: one line
per case of what its call returned (a repr) or raised. The verdicts are made here, outside the
sandbox, against the expected values the task generator computed; the sandbox never holds
them. A report that is not exactly one well-formed line per case, in order, counts as a crash
for every case: empty, cut short, or with anything else on the channel. So the most a package
can claim is "my function returned X" for a case, which it could as well have done by
returning X, and X must come from a working function, as the held-out cases are never shown:
the reward stays what the cases measure, within 0..1 (`reward_range`).
"""

from __future__ import annotations

import ast
import json
import logging
import tempfile
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from rl.core.chat import ChatTemplate
from rl.envs import Environment, Example, check_args
from rl.envs.code_repair import sandbox
from rl.envs.code_repair.tasks import Task, make_task
from rl.envs.code_repair.tools import Tool, ToolCall, parse_tool_calls

log = logging.getLogger(__name__)
SYSTEM = "You are a careful Python programmer. You fix bugs with the tools you are given."
RUNNER = "relay_run_tests.py"  # runner.py, as the run's directory holds it
RUNNER_SOURCE = (Path(__file__).parent / "runner.py").read_text()
TOOLS = [
    Tool("list_files", "List the files of the package and its tests.", {}),
    Tool("read_file", "Read one file.", {"path": {"type": "string", "description": "As listed."}}),
    Tool(
        "edit_file",
        "Replace the one occurrence of `old` in a file with `new`.",
        {
            "path": {"type": "string", "description": "As listed."},
            "old": {"type": "string", "description": "Exact text that occurs once in the file."},
            "new": {"type": "string", "description": "The replacement."},
        },
    ),
    Tool("run_tests", "Run the package's tests and show which fail.", {}),
]


@dataclass(frozen=True)
class CodeRepairArgs:
    train_tasks: int = 4000
    """Training packages (eval packages are `environment.eval_size`, from their own stream)."""
    max_turns: int = 6
    """Model turns per episode."""
    max_episode_tokens: int = 1536
    """Model and tool tokens per episode, after the prompt."""
    sandboxes: int = 2
    """Sandboxed test runs at once, across all episodes."""
    wall_s: float = 10.0
    """Wall-clock limit of one test run."""
    memory_mb: int = 512
    """Address-space limit of one test run."""
    python: str = "/usr/bin/python3"
    """Interpreter for the tests; it runs as an unprivileged user, so it must be readable by all."""
    max_result_chars: int = 1500
    """A tool result longer than this is cut."""
    call_bonus: float = 0.0
    """Reward, when no failing test was fixed, of an episode whose every turn made a well-formed
    tool call (less for fewer turns): shaping for models that do not call tools yet."""


class CodeRepair(Environment):
    name = "code_repair"
    chat = True  # turns end with the template's end-of-turn token

    def __init__(self, env_cfg: Any) -> None:
        self.args = check_args(dict(env_cfg.args), CodeRepairArgs())
        if self.args.max_turns < 1 or self.args.sandboxes < 1:
            raise ValueError("environment.args.max_turns and .sandboxes must be >= 1")
        if not 0.0 <= self.args.call_bonus <= 1.0:
            raise ValueError(f"environment.args.call_bonus={self.args.call_bonus}: must be in 0..1")
        if not Path(self.args.python).exists():
            raise ValueError(f"environment.args.python={self.args.python}: no such interpreter")
        caps = sandbox.check()
        log.info("code_repair sandbox: memory and processes capped per run by %s", caps)
        self.seed = env_cfg.seed
        self.max_turns = self.args.max_turns
        self.max_episode_tokens = self.args.max_episode_tokens
        self.concurrency = self.args.sandboxes
        self.reward_range = (0.0, 1.0)  # fixed tests' share, or up to call_bonus <= 1
        self.tools = {t.name: t for t in TOOLS}
        self.slots = threading.BoundedSemaphore(self.args.sandboxes)
        self.limits = sandbox.Limits(wall_s=self.args.wall_s, memory_mb=self.args.memory_mb)
        self.template: ChatTemplate | None = None
        self.schemas = [t.schema() for t in TOOLS]
        self._train = [self._example("train", i) for i in range(self.args.train_tasks)]
        self._eval = [self._example("eval", i) for i in range(env_cfg.eval_size)]
        self._score = lru_cache(maxsize=4096)(self._score_uncached)

    def _example(self, split: str, index: int) -> Example:
        task = self.task(split, index)
        prompt = (
            f"The Python package `{task.package}` has a bug: some of its tests fail. Find it, "
            "fix it with edit_file, and check with run_tests. When the tests pass, answer "
            "without a tool call."
        )
        return Example(prompt, json.dumps(task.fix), {"split": split, "index": index})

    def task(self, split: str, index: int) -> Task:
        return make_task(self.seed, split, index)

    def train_examples(self) -> list[Example]:
        return self._train

    def eval_examples(self) -> list[Example]:
        return self._eval

    # The chat side: prompts and tool turns in the model's template.

    def use_tokenizer(self, tokenizer: Any) -> None:
        self.template = ChatTemplate(tokenizer)

    def prompt_ids(self, example: Example) -> list[int]:
        assert self.template is not None, "use_tokenizer first"
        opening = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": example.prompt},
        ]
        return self.template.prompt_ids(opening, self.schemas)

    def respond(self, example: Example, turns: list[str]) -> str | None:
        """The tool turn answering the latest model turn; None when it called no tool."""
        assert self.template is not None, "use_tokenizer first"
        calls, errors = parse_tool_calls(turns[-1], self.tools)
        if not calls and not errors:
            return None
        files = self.files(example, turns[:-1])
        task = self.task(**example.info)
        results = [self.execute(call, files, task)[0] for call in calls]
        results += [f"error: {e}" for e in errors]
        cap = self.args.max_result_chars
        cut = [r if len(r) <= cap else r[:cap] + "\n[cut]" for r in results]
        return self.template.after_turn([{"role": "tool", "content": r} for r in cut], self.schemas)

    # Tools. Each returns (text for the model, whether the call did what it asked).

    def execute(self, call: ToolCall, files: dict[str, str], task: Task) -> tuple[str, bool]:
        args = call.arguments
        if call.name == "list_files":
            return "\n".join(sorted(files)), True
        if call.name == "read_file":
            if args["path"] not in files:
                return f"error: no file {args['path']!r}; files: {', '.join(sorted(files))}", False
            return files[args["path"]], True
        if call.name == "edit_file":
            return _edit(files, args["path"], args["old"], args["new"])
        outcome = self.run_tests(task, files)
        return _summary(outcome), isinstance(outcome, list)

    def files(self, example: Example, turns: list[str]) -> dict[str, str]:
        """The task's files after the edits of `turns`, in order."""
        files = dict(self.task(**example.info).files)
        for turn in turns:
            for call in parse_tool_calls(turn, self.tools)[0]:
                if call.name == "edit_file":
                    _edit(
                        files, call.arguments["path"], call.arguments["old"], call.arguments["new"]
                    )
        return files

    def run_tests(self, task: Task, files: dict[str, str]) -> list[list[Any]] | str:
        """[[test, passed, message], ...] of `task`'s visible tests on the package in `files`
        (its test files are not used: the task's own tests are), or what went wrong."""
        outcome = self.run_cases(task.package, [call for _, call, _ in task.cases], files)
        if isinstance(outcome, str):
            return outcome
        return [
            [test, *_verdict(call, want, *said)]
            for (test, call, want), said in zip(task.cases, outcome, strict=True)
        ]

    def run_cases(
        self, package: str, calls: list[str], files: dict[str, str]
    ) -> list[tuple[str, str]] | str:
        """("returned", repr) or ("raised", error) of each call on the package in `files`, by
        `runner.py` in the sandbox, or what went wrong. No test file enters the sandbox."""
        with self.slots, tempfile.TemporaryDirectory(prefix="relay-code-") as tmp:
            root = Path(tmp)
            for rel, text in files.items():
                if not rel.startswith("tests/"):  # they hold the expected values
                    (root / rel).parent.mkdir(parents=True, exist_ok=True)
                    (root / rel).write_text(text)
            (root / RUNNER).write_text(RUNNER_SOURCE)
            argv = [self.args.python, "-I", RUNNER]
            result = sandbox.run(argv, root, self.limits, stdin=json.dumps([package, calls]))
        if result.timed_out or result.returncode in (128 + 9, 128 + 24):  # SIGKILL, SIGXCPU
            limits = f"{self.limits.wall_s:g} s wall clock, {self.limits.cpu_s} s CPU"
            return f"the tests were stopped by the time limit ({limits})"
        observed = _report(result.channel, len(calls))
        return _crash(result) if observed is None else observed

    # Scoring: on the held-out cases.

    def _score_uncached(self, split: str, index: int, package: tuple[tuple[str, str], ...]) -> int:
        task = self.task(split, index)
        outcome = self.run_cases(task.package, [call for call, _ in task.held_out], dict(package))
        if isinstance(outcome, str):
            return 0
        return sum(
            _verdict(call, want, *said)[0]
            for (call, want), said in zip(task.held_out, outcome, strict=True)
        )

    def passed(self, example: Example, turns: list[str]) -> int:
        """Held-out cases of the task that pass on the episode's edited package."""
        files = self.files(example, turns)
        package = tuple(sorted((p, t) for p, t in files.items() if not p.startswith("tests/")))
        return self._score(example.info["split"], example.info["index"], package)

    def reward(self, example: Example, completion: list[str]) -> float:
        task = self.task(**example.info)
        passing_at_start = len(task.held_out) - task.held_out_failing
        fixed = self.passed(example, completion) - passing_at_start
        if fixed > 0:
            return fixed / task.held_out_failing
        calling = sum(bool(parse_tool_calls(t, self.tools)[0]) for t in completion)
        return self.args.call_bonus * calling / max(1, len(completion))

    def exact_match(self, example: Example, completion: list[str]) -> bool:
        return self.passed(example, completion) == len(self.task(**example.info).held_out)

    def metrics(self, example: Example, completion: list[str]) -> dict[str, float]:
        """Tool-use statistics of one episode."""
        files = dict(self.task(**example.info).files)
        counts = {"tool_calls": 0, "tool_errors": 0, "edits": 0, "test_runs": 0}
        for turn in completion:
            calls, errors = parse_tool_calls(turn, self.tools)
            counts["tool_calls"] += len(calls) + len(errors)
            counts["tool_errors"] += len(errors)
            for call in calls:
                if call.name == "edit_file":
                    ok = _edit(files, **call.arguments)[1]
                    counts["edits"] += ok
                    counts["tool_errors"] += not ok
                counts["test_runs"] += call.name == "run_tests"
        last = parse_tool_calls(completion[-1], self.tools) if completion else ([], [])
        return {
            **counts,
            "turns": len(completion),
            "answered": float(not last[0] and not last[1]),
        }


def _edit(files: dict[str, str], path: str, old: str, new: str) -> tuple[str, bool]:
    if path not in files:
        return f"error: no file {path!r}; files: {', '.join(sorted(files))}", False
    found = files[path].count(old) if old else 0
    if found != 1:
        return f"error: `old` occurs {found} times in {path}; it must occur exactly once", False
    files[path] = files[path].replace(old, new, 1)
    return f"edited {path}", True


def _summary(outcome: list[list[Any]] | str) -> str:
    if isinstance(outcome, str):
        return f"error: {outcome}"
    failed = [f"FAILED {name}: {message}" for name, ok, message in outcome if not ok]
    passed = len(outcome) - len(failed)
    return "\n".join([f"{passed} passed, {len(failed)} failed", *failed])


def _report(channel: str, cases: int) -> list[tuple[str, str]] | None:
    """The runner's report: `cases` lines `[index, kind, text]`, each index in turn, each line
    ended; None for anything else."""
    lines = channel.split("\n")
    if lines.pop() != "" or len(lines) != cases:  # the last line is ended too
        return None
    observed = []
    for index, line in enumerate(lines):
        case = _case_line(line, index)
        if case is None:
            return None
        observed.append(case)
    return observed


def _case_line(line: str, index: int) -> tuple[str, str] | None:
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    if not isinstance(entry, list) or [type(part) for part in entry] != [int, str, str]:
        return None
    if entry[0] != index or entry[1] not in ("returned", "raised"):
        return None
    return entry[1], entry[2]


def _verdict(call: str, want: Any, kind: str, text: str) -> tuple[bool, str]:
    """Whether a test passed, judged here against its expected value, and why not."""
    if kind == "raised":
        return False, f"{call} raised {text}"
    try:
        right = ast.literal_eval(text) == want  # plain data only: never the package's objects
    except Exception:  # noqa: BLE001 - an unreadable repr is a wrong answer
        right = False
    return right, "" if right else f"{call} returned {text}, expected {want!r}"


def _crash(result: sandbox.Result) -> str:
    return f"the test run crashed (exit {result.returncode}): {result.stderr.strip()[-600:]}"
