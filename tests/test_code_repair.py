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
    train = {json.dumps(make_task(0, "train", i).files) for i in range(2000)}
    held_out = {json.dumps(make_task(0, "eval", i).files) for i in range(200)}
    assert len(train) == 2000 and not train & held_out
    assert make_task(1, "train", 5) != make_task(0, "train", 5)


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
