"""code_repair: the generated corpus, each tool, the reward, a scripted policy that solves tasks
through the same tool interface the model uses, a random policy that does not, and a short RL
run with SmolLM2 through the launcher."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rl.core.model import build_char_tokenizer
from rl.core.records import Completion, Episode
from rl.envs import Environment, Example, RewardOutOfRange, make_environment
from rl.envs.code_repair import CodeRepair
from rl.envs.code_repair.environment import _report
from rl.envs.code_repair.tasks import Task, make_task
from rl.envs.code_repair.tools import ToolCall
from rl.orchestrator.advantages import group_mean
from rl.orchestrator.episodes import run_episodes
from rl.orchestrator.scoring import score_group
from tests.support.runs import ROOT, compose_run

SAMPLE = 12  # eval tasks the scripted and random policies play


@pytest.fixture(scope="module")
def env() -> CodeRepair:
    cfg = compose_run(
        "environment=code_repair",
        f"environment.eval_size={SAMPLE}",
        "environment.args.max_episode_tokens=100000",  # the tiny tokenizer spends one per char
    )
    environment = make_environment(cfg.environment)
    environment.use_tokenizer(build_char_tokenizer(64))
    return environment  # type: ignore[return-value]


def execute(
    env: CodeRepair, task: Task, name: str, args: dict[str, Any], files: dict[str, str]
) -> Any:
    return env.execute(ToolCall(name, args), files, task)


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_tasks_are_reproducible_many_and_held_out() -> None:
    assert make_task(0, "train", 5) == make_task(0, "train", 5)
    assert make_task.__wrapped__(0, "eval", 3) == make_task(0, "eval", 3)  # drawn again, uncached
    train = {json.dumps(make_task(0, "train", i).files) for i in range(2000)}
    held_out = {json.dumps(make_task(0, "eval", i).files) for i in range(200)}
    assert len(train) == 2000 and not train & held_out
    assert make_task(1, "train", 5) != make_task(0, "train", 5)
    for task in (make_task(0, "eval", i) for i in range(200)):  # scored on cases never shown
        shown = {call for _, call, _ in task.cases}
        assert task.held_out_failing > 0 and not shown & {call for call, _ in task.held_out}


def test_the_fix_repairs_every_failing_test_and_the_bug_is_real(env: CodeRepair) -> None:
    for index in range(6):
        task = env.task("eval", index)
        results = env.run_tests(task, dict(task.files))
        assert isinstance(results, list) and len(results) == task.tests
        assert sum(not ok for _, ok, _ in results) == task.failing_at_start > 0
        path, bad, good = task.fix
        fixed = {**task.files, path: task.files[path].replace(bad, good)}
        assert all(ok for _, ok, _ in env.run_tests(task, fixed))  # type: ignore[union-attr]


def test_each_tool(env: CodeRepair) -> None:
    task = env.task("eval", 0)
    files = dict(task.files)
    path, bad, good = task.fix
    listing, ok = execute(env, task, "list_files", {}, files)
    assert ok and listing.splitlines() == sorted(task.files)
    assert execute(env, task, "read_file", {"path": path}, files) == (task.files[path], True)
    text, ok = execute(env, task, "read_file", {"path": "../../etc/passwd"}, files)
    assert not ok and text.startswith("error: no file '../../etc/passwd'")
    report, ok = execute(env, task, "run_tests", {}, files)
    assert ok and report.startswith(f"{task.tests - task.failing_at_start} passed, ")
    assert report.count("FAILED test_") == task.failing_at_start and "expected" in report
    text, ok = execute(env, task, "edit_file", {"path": path, "old": "", "new": "x"}, files)
    assert not ok and "occurs 0 times" in text
    text, ok = execute(env, task, "edit_file", {"path": path, "old": bad, "new": good}, files)
    assert ok and files[path] == task.files[path].replace(bad, good)
    assert execute(env, task, "run_tests", {}, files) == (f"{task.tests} passed, 0 failed", True)


def test_model_code_runs_in_the_sandbox(env: CodeRepair) -> None:
    task = env.task("eval", 1)
    init = next(p for p in task.files if p.endswith("__init__.py"))
    escape = Path("/tmp/relay-code-repair-escape")
    files = {**task.files, init: f"open({str(escape)!r}, 'w').write('x')\n"}
    report, _ = execute(env, task, "run_tests", {}, files)
    assert "Read-only file system" in report and not escape.exists()
    files = {**task.files, init: "while True:\n    pass\n"}
    assert execute(env, task, "run_tests", {}, files)[0].startswith("error: the tests were stopped")
    # Six processes left running by each of the six cases: more than a run may hold (32) by
    # the last case, unless each case's end ends them.
    left_running = (
        "import os, time\nfor _ in range(6):\n    if os.fork() == 0:\n        time.sleep(60)\n"
    )
    files = {**task.files, init: task.files[init] + left_running}
    left_behind = execute(env, task, "run_tests", {}, files)
    assert left_behind == execute(env, task, "run_tests", {}, task.files)


def test_reward_counts_fixed_tests_not_edited_tests(env: CodeRepair) -> None:
    example = env.eval_examples()[2]
    task = env.task("eval", 2)
    path, bad, good = task.fix
    test_file = next(p for p in task.files if p.startswith("tests/"))
    assert env.reward(example, ["I am done."]) == 0.0
    cheat = call("edit_file", path=test_file, old="assert got ==", new="assert True or got ==")
    first = task.files[test_file].split("assert got ==")[0]
    assert first and env.reward(example, [cheat]) == 0.0  # the original tests are what counts
    fix = call("edit_file", path=path, old=bad, new=good)
    assert env.reward(example, [fix]) == 1.0 and env.exact_match(example, [fix])
    breaks_one = call("edit_file", path=path, old=good.split("\n")[1], new="    return None")
    assert env.reward(example, [fix, breaks_one]) == 0.0


def init_edit(task: Task, code: str) -> str:
    """An edit_file call that appends `code` to the package's `__init__.py`."""
    path = next(p for p in task.files if p.endswith("__init__.py"))
    first = task.files[path].splitlines()[0]
    return call("edit_file", path=path, old=first, new=f"{first}\n{code}")


def test_the_package_cannot_forge_test_results(env: CodeRepair) -> None:
    example = env.eval_examples()[2]
    task = env.task("eval", 2)
    fake = json.dumps([[f"test_fake_{i}", True, ""] for i in range(48)])
    claim = json.dumps({test: ["returned", repr(want)] for test, _, want in task.cases})
    forgeries = [
        # A results line on stdout, printed after the runner's own (what the runner once read).
        f"import atexit\natexit.register(print, '@@relay-test-results@@' + {fake!r})",
        # A report of the package's own on the runner's channel, with every expected value.
        f"import os\nos.write(3, {claim!r}.encode())",
        # Results equal to anything: `==` is never asked of the package's objects.
        "class _Equal:\n    def __eq__(self, other):\n        return True\n"
        + "".join(f"{name} = lambda *a, **k: _Equal()\n" for name in _function_names(task)),
    ]
    for code in forgeries:
        edit = init_edit(task, code)
        assert env.reward(example, [edit]) == 0.0, code
        assert not env.exact_match(example, [edit])
        assert 0.0 <= env.score(example, [edit]) <= 1.0


def _function_names(task: Task) -> list[str]:
    return sorted({call.split("(")[0] for _, call, _ in task.cases})


def test_a_package_that_writes_the_report_and_exits_scores_0(env: CodeRepair) -> None:
    """The forgery found in live runs: the package writes, at import, a report claiming every
    test passed (in the runner's former format, with the expected values its tests show) on the
    report channel, directly or through /proc, then exits before the runner can. The report is
    written by a parent that never runs the package's code now; the fix still scores 1."""
    example = env.eval_examples()[2]
    task = env.task("eval", 2)
    claim = json.dumps({test: ["returned", repr(want)] for test, _, want in task.cases})
    channels = ["3", "os.open('/proc/1/fd/3', os.O_WRONLY)"]  # the runner is the run's PID 1
    for channel in channels:
        forgery = (
            f"import os\ntry:\n    os.write({channel}, {claim!r}.encode())\n"
            "except OSError:\n    pass\nos._exit(0)"
        )
        edit = init_edit(task, forgery)
        assert env.reward(example, [edit]) == 0.0, channel
        assert not env.exact_match(example, [edit])
    path, bad, good = task.fix
    fix = call("edit_file", path=path, old=bad, new=good)
    assert env.reward(example, [fix]) == 1.0 and env.exact_match(example, [fix])


REACH = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def _refused(attempt):
    try:
        attempt()
        return 'reached'
    except OSError as err:
        return errno.errorcode[err.errno]
def _ptrace_attach():
    if libc.ptrace(16, 1, 0, 0) != 0:  # PTRACE_ATTACH to the run's PID 1
        raise OSError(ctypes.get_errno(), 'ptrace')
def _pidfd_getfd():
    if libc.syscall(438, os.pidfd_open(1), 3, 0) < 0:  # PID 1's fd 3, by pidfd_getfd
        raise OSError(ctypes.get_errno(), 'pidfd_getfd')
def _reach(*args):
    return (
        _refused(lambda: os.fstat(3)),
        _refused(lambda: os.open('/proc/1/fd/3', os.O_WRONLY)),
        _refused(lambda: open('/proc/1/mem', 'rb')),
        _refused(_ptrace_attach),
        _refused(_pidfd_getfd),
    )
"""


def test_only_a_whole_report_counts() -> None:
    """One ended line per case, in order, or no report at all: empty, cut short, out of order,
    or with anything else on the channel, every case counts as crashed (so the score is 0)."""
    lines = ['[0, "returned", "3"]\n', '[1, "raised", "ValueError: x"]\n']
    assert _report("".join(lines), 2) == [("returned", "3"), ("raised", "ValueError: x")]
    rejected = [
        "",
        lines[0],
        "".join(lines)[:-1],
        "".join(reversed(lines)),
        "".join(lines) + lines[1],
        "".join(lines) + "forged\n",
        '{"test_a": ["returned", "3"]}',
        lines[0] + '[1, "passed", "3"]\n',
        lines[0] + '[1, "returned", 3]\n',
    ]
    for channel in rejected:
        assert _report(channel, 2) is None, channel


def test_no_case_reaches_the_report_channel(env: CodeRepair) -> None:
    """The package's code, run for a case, finds no report channel of its own (fd 3), cannot
    open the runner's through /proc, read its memory, trace it or take its descriptor."""
    task = env.task("eval", 2)
    init = next(p for p in task.files if p.endswith("__init__.py"))
    probes = "".join(f"{name} = _reach\n" for name in _function_names(task))
    files = {**task.files, init: task.files[init] + REACH + probes}
    outcome = env.run_tests(task, files)
    assert isinstance(outcome, list) and len(outcome) == task.tests, outcome
    refused = ("EBADF", "EACCES", "EACCES", "EPERM", "EPERM")
    for (_, ok, message), (_, called, _) in zip(outcome, task.cases, strict=True):
        assert not ok and message.startswith(f"{called} returned {refused!r}, expected"), message


def test_the_reward_is_scored_on_held_out_cases(env: CodeRepair) -> None:
    """A package that answers exactly what its visible tests ask (a table of their expected
    values for the buggy function) passes them all and scores 0: the held-out cases ask that
    function what the tests never show. The package as given fails the held-out cases its bug
    shows in; the real fix passes them all."""
    example = env.eval_examples()[2]
    task = env.task("eval", 2)
    path, bad, good = task.fix
    name = good.split("(")[0].removeprefix("def ")
    table = {c[len(name) + 1 : -1]: want for _, c, want in task.cases if c.startswith(f"{name}(")}
    lookup = f"def {name}(*args):\n    return {table!r}[', '.join(map(repr, args))]"
    edit = init_edit(task, lookup)
    report, _ = execute(env, task, "run_tests", {}, env.files(example, [edit]))
    assert report == f"{task.tests} passed, 0 failed"
    assert env.reward(example, [edit]) == 0.0 and not env.exact_match(example, [edit])
    asked = [c for c, _ in task.held_out if c.startswith(f"{name}(")]
    assert asked and not set(asked) & {c for _, c, _ in task.cases}
    assert env.passed(example, [edit]) == len(task.held_out) - len(asked)  # each a KeyError
    assert 0 < task.held_out_failing <= len(asked)
    assert env.passed(example, []) == len(task.held_out) - task.held_out_failing
    fix = call("edit_file", path=path, old=bad, new=good)
    assert env.passed(example, [fix]) == len(task.held_out)


def test_a_reward_outside_the_declared_range_is_an_error(env: CodeRepair) -> None:
    class Broken(Environment):
        name = "broken"
        reward_range = (0.0, 1.0)

        def __init__(self, value: float) -> None:
            self.value = value

        def train_examples(self) -> list[Example]:
            return []

        eval_examples = train_examples

        def reward(self, example: Example, completion: Any) -> float:
            return self.value

        def exact_match(self, example: Example, completion: Any) -> bool:
            return False

    example = Example("p", "a")
    assert Broken(0.25).score(example, "c") == 0.25
    assert Broken(1.0 + 1e-12).score(example, "c") == 1.0  # float rounding is clamped
    for value in (48.0, -0.5, float("nan"), float("inf")):
        with pytest.raises(RewardOutOfRange, match=r"environment broken: reward .* \[0, 1\]"):
            Broken(value).score(example, "c")
    unbounded = Broken(-7.5)
    unbounded.reward_range = (-math.inf, math.inf)  # a range no one can know: finite is all
    assert unbounded.score(example, "c") == -7.5
    unbounded.value = math.nan
    with pytest.raises(RewardOutOfRange):
        unbounded.score(example, "c")
    assert env.reward_range == (0.0, 1.0)


def test_call_bonus_rewards_well_formed_calls_only_when_nothing_was_fixed(
    env: CodeRepair, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(env, "args", replace(env.args, call_bonus=0.1))
    example = env.eval_examples()[3]
    path, bad, good = json.loads(example.answer)
    assert env.reward(example, [call("list_files"), "done"]) == pytest.approx(0.05)
    assert env.reward(example, [call("list_files"), call("nope")]) == pytest.approx(0.05)
    assert env.reward(example, ["<tool_call>{oops</tool_call>"]) == 0.0
    assert env.reward(example, [call("edit_file", path=path, old=bad, new=good)]) == 1.0


class ScriptedClient:
    """Stands in for inference: answers each episode with its policy's next turn (the text; its
    token ids are stand-ins that nothing decodes)."""

    def __init__(self, env: CodeRepair, examples: list[Example], policy: Any) -> None:
        self.openings = [(env.prompt_ids(e), e) for e in examples]
        self.policy = policy
        self.turns = [0] * len(examples)

    def complete_all(
        self, prompts: list[list[int]], n: int, max_tokens: int, t: float, seeds: Any = None
    ) -> Any:
        return [self.answer(prompt) for prompt in prompts]

    def answer(self, prompt: list[int]) -> Completion:
        i = next(i for i, (ids, _) in enumerate(self.openings) if prompt[: len(ids)] == ids)
        text = self.policy(self.openings[i][1], self.turns[i])
        self.turns[i] += 1
        ids = [4 + ord(c) % 50 for c in text] or [4]
        return Completion(prompt, ids, [-1.0] * len(ids), text, "stop", 0, 0)


def play(env: CodeRepair, examples: list[Example], policy: Any) -> list[Episode]:
    """Episodes of `policy(example, turn) -> text` through the orchestrator's rollout loop."""
    client = ScriptedClient(env, examples, policy)
    tokenizer = env.template.tokenizer  # type: ignore[union-attr]
    return run_episodes(client, env, tokenizer, examples, 1, 96, 1.0, 100_000)  # type: ignore[arg-type]


def scripted(example: Example, turn: int) -> str:
    path, bad, good = json.loads(example.answer)
    script = [
        call("list_files"),
        call("read_file", path=path),
        call("run_tests"),
        call("edit_file", path=path, old=bad, new=good) + call("run_tests"),
        "The tests pass now.",
    ]
    return script[min(turn, len(script) - 1)]


def test_a_scripted_policy_solves_tasks_through_the_tool_interface(env: CodeRepair) -> None:
    examples = env.eval_examples()
    choices = play(env, examples, scripted)
    for example, choice in zip(examples, choices, strict=True):
        assert choice.turns[-1] == "The tests pass now."
        assert len(choice.env_spans) == 4  # one tool turn after each tool-calling turn
        assert "passed, 0 failed" in choice.text
        group = score_group(env, group_mean, example, [choice])
        sample = group.samples[0]
        assert sample.reward == 1.0
        assert sample.env_metrics == {
            "tool_calls": 5, "tool_errors": 0, "edits": 1, "test_runs": 2, "turns": 5,
            "answered": 1.0,
        }  # fmt: skip
        assert env.exact_match(example, choice.turns)


def test_a_random_policy_scores_low(env: CodeRepair) -> None:
    rng = random.Random(0)
    words = ["x", "return", "0", "xs", "(", ")", "if", "+", "-", "def", "\n"]

    def random_turn(example: Example, turn: int) -> str:
        files = sorted(env.task(**example.info).files)
        kind = rng.choice(["list", "read", "edit", "run", "junk", "stop"])
        if kind == "list":
            return call("list_files")
        if kind == "read":
            return call("read_file", path=rng.choice(files + ["nope.py"]))
        if kind == "edit":
            old, new = (" ".join(rng.choices(words, k=rng.randint(1, 2))) for _ in range(2))
            return call("edit_file", path=rng.choice(files), old=old, new=new)
        if kind == "run":
            return call("run_tests")
        if kind == "junk":
            return "<tool_call>{" + " ".join(rng.choices(words, k=5))
        return "done"

    examples = env.eval_examples()
    choices = play(env, examples, random_turn)
    rewards = [env.reward(e, c.turns) for e, c in zip(examples, choices, strict=True)]
    assert sum(rewards) / len(rewards) < 0.2, rewards


@pytest.mark.slow
def test_rl_steps_with_smollm2_log_reward_and_tool_statistics(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        "experiment=code_repair_smollm2",
        "max_steps=2",
        "environment.prompts_per_step=1",
        "environment.group_size=2",
        "environment.eval_size=1",
        "environment.max_tokens=24",
        "environment.args.max_turns=2",
        f"hydra.run.dir={run_dir}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "launcher.cli", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert 0.0 <= record["reward/mean"] <= 1.0
        assert record["env/turns"] >= 1 and record["env/tool_calls"] >= 0
        assert 0 <= record["env/tool_errors"] <= record["env/tool_calls"]
    assert [r["step"] for r in records if "eval/exact_match" in r] == [0, 2]
    assert (run_dir / "rollouts" / "samples.jsonl").exists()
