"""environment=verifiers: load a verifiers 0.4.0 environment by id, score with its rewards, run
its multi-turn game, and roll out against Relay's own inference server.

The environments are the test package in tests/verifiers_envs/relay_reverse (`relay_reverse`,
single-turn, and `relay_reverse_retry`, multi-turn). Rather than installing it into the shared
virtual environment, the tests put its folder on sys.path (and PYTHONPATH for child processes),
which verifiers' loader, an import by name, accepts like an installed package.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rl.envs import make_environment
from tests.support.runs import ROOT, TOKEN, compose_run, embedded_server

ENV_PACKAGES = ROOT / "tests" / "verifiers_envs" / "relay_reverse"


@pytest.fixture(scope="module", autouse=True)
def env_packages_on_path() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ENV_PACKAGES))
        mp.setenv(
            "PYTHONPATH",
            os.pathsep.join(filter(None, [str(ENV_PACKAGES), os.environ.get("PYTHONPATH")])),
        )
        yield


def build(env_id: str, *overrides: str, env_args: str = "{num_tasks: 60}") -> Any:
    cfg = compose_run(
        "environment=verifiers",
        f"environment.args.id={env_id}",
        "environment.eval_size=10",
        f"environment.args.env_args={env_args}",
        *overrides,
    )
    return make_environment(cfg.environment)


@pytest.fixture(scope="module")
def single() -> Any:
    return build("relay_reverse")


@pytest.fixture(scope="module")
def multi() -> Any:
    return build("relay_reverse_retry")


def test_loads_by_id_and_converts_tasks(single: Any) -> None:
    from relay_reverse import ReverseTask

    train, held_out = single.train_examples(), single.eval_examples()
    assert (len(train), len(held_out), single.max_turns) == (50, 10, 1)
    assert not {e.prompt for e in train} & {e.prompt for e in held_out}
    for example in train + held_out:
        task = example.info["task"]
        assert isinstance(task, ReverseTask)
        assert example.prompt == f"reverse: {task.data.name}\n"
        assert example.answer == task.data.name[::-1]
    assert [e.prompt for e in build("relay_reverse").eval_examples()] == [
        e.prompt for e in held_out
    ]  # the seeded split is reproducible


def test_rewards_are_the_weighted_sum(single: Any) -> None:
    example = single.train_examples()[0]
    word = example.answer
    assert single.reward(example, word) == 1.0 and single.exact_match(example, word)
    # exact (weight 0.5) scores 0, similarity (weight 0.5) the LCS ratio.
    near = word[:-1]
    assert single.reward(example, near) == pytest.approx(0.5 * len(near) / len(word))
    assert not single.exact_match(example, near)
    assert single.reward(example, f"  {word}\n") == 1.0  # verifiers strips the reply
    assert single.reward(example, "123") == 0.0


def test_reward_from_inside_a_running_event_loop(single: Any) -> None:
    example = single.train_examples()[1]

    async def caller() -> float:
        return single.reward(example, example.answer)

    assert asyncio.run(caller()) == 1.0


def test_eval_env_args_load_a_separate_eval_taskset() -> None:
    env = build("relay_reverse", "environment.args.eval_env_args={seed: 7}")
    assert len(env.train_examples()) == 60 and len(env.eval_examples()) == 10
    assert {e.prompt for e in env.eval_examples()} != {e.prompt for e in env.train_examples()[:10]}


def test_prompt_rendering_folds_system_prompt_and_messages() -> None:
    import verifiers.v1 as vf

    from rl.envs.verifiers_env import render_prompt

    data = vf.TaskData(
        prompt=[vf.UserMessage(content="first"), vf.UserMessage(content="second")],
        system_prompt="be brief",
    )
    assert render_prompt(data) == "be brief\n\nfirst\n\nsecond"
    assert render_prompt(vf.TaskData(prompt="just this\n")) == "just this\n"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ((), "environment.args.id: required"),
        (("environment.args.id=no_such_env_here",), "no installed verifiers environment"),
        (("environment.args.id=json",), "'json' is not a loadable verifiers 0.4.0 environment"),
        (
            ("environment.args.id=relay_reverse", "environment.args.env_args={num_taskz: 3}"),
            "env_args for relay_reverse: num_taskz: Extra inputs are not permitted",
        ),
        (("+environment.args.idd=x",), "environment.args.idd: unknown"),
        (
            (
                "environment.eval_size=60",
                "environment.args.id=relay_reverse",
                "environment.args.env_args={num_tasks: 60}",
            ),
            "no training tasks left",
        ),
    ],  # fmt: skip
)
def test_bad_settings_raise_a_clear_error(overrides: tuple[str, ...], message: str) -> None:
    cfg = compose_run("environment=verifiers", *overrides)
    with pytest.raises(ValueError, match=message):
        make_environment(cfg.environment)


FAILING_REWARDS = """
import asyncio

async def boom(trace) -> float:
    if trace.last_reply == "boom":
        raise ValueError("reward exploded")
    return 0.0

async def slow(trace) -> float:
    if trace.last_reply == "slow":
        await asyncio.sleep(30)
    return 0.0
"""


def test_reward_errors_score_zero_then_stop_the_run(tmp_path: Path) -> None:
    rewards = tmp_path / "failing_rewards.py"
    rewards.write_text(FAILING_REWARDS)
    plugged = f"{{boom: {{fn: '{rewards}:boom'}}, slow: {{fn: '{rewards}:slow'}}}}"
    env = build(
        "relay_reverse",
        "environment.args.reward_timeout_s=0.5",
        "environment.args.max_consecutive_reward_errors=3",
        env_args=f"{{num_tasks: 60, task: {{rewards: {plugged}}}}}",
    )
    example = env.train_examples()[0]
    assert env.reward(example, example.answer) == 1.0  # plugged rewards joined the sum (at 0)
    assert env.reward(example, "boom") == 0.0  # an error: logged, scored 0
    assert env.reward(example, "slow") == 0.0  # a timeout: the same
    assert env.reward(example, example.answer[:2]) > 0.0  # a success resets the count
    env.reward(example, "boom")  # errors are not cached: scored again, and counted
    env.reward(example, "slow")
    with pytest.raises(RuntimeError, match="3 reward errors in a row, the last: .*exploded"):
        env.reward(example, "boom")


def test_multi_turn_game_replies_and_rewards(multi: Any) -> None:
    example = multi.train_examples()[0]
    word, answer = example.info["task"].data.name, example.answer
    assert multi.max_turns == 8 and example.prompt == f"reverse: {word}\n"
    assert multi.respond(example, ["nope"]) == f"\nno. reverse: {word}\n"
    assert multi.respond(example, ["nope", "again"]) == f"\nno. reverse: {word}\n"
    assert multi.respond(example, [answer]) is None  # solved: the game is over
    assert multi.respond(example, ["a", "b", "c"]) is None  # max_attempts=3
    # solved (weight 0.5) + speed (weight 0.5, 1 / attempts) recorded by the game's run().
    assert multi.reward(example, [answer]) == 1.0 and multi.exact_match(example, [answer])
    assert multi.reward(example, ["nope", answer]) == 0.75
    assert not multi.exact_match(example, ["nope", answer])
    assert multi.reward(example, ["a", "b", "c"]) == 0.0
    assert multi.reward(example, ["nope"]) == 0.0  # Relay cut the episode after one turn
    capped = build("relay_reverse_retry", "environment.args.max_turns=3")
    assert capped.max_turns == 3


# --- real rollouts against Relay's embedded inference server ------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with embedded_server(tmp_path_factory) as server:
        yield server


@pytest.mark.slow
def test_single_turn_rollout_on_relay_inference(server: Any, single: Any) -> None:
    from rl.inference.client import InferenceClient

    client = InferenceClient(server.run_dir, ["inference-0"], TOKEN, server.cfg.model.name)
    examples = single.eval_examples()[:4]
    choices = client.complete_all([e.prompt for e in examples], 2, 12, 1.0)
    assert len(choices) == 8
    for i, choice in enumerate(choices):
        assert len(choice.token_ids) == len(choice.logprobs) > 0
        reward = single.reward(examples[i // 2], choice.text)
        assert 0.0 <= reward <= 1.0


@pytest.mark.slow
def test_multi_turn_rollout_on_relay_inference(server: Any, multi: Any) -> None:
    from rl.inference.client import InferenceClient
    from rl.orchestrator.episodes import run_episodes

    client = InferenceClient(server.run_dir, ["inference-0"], TOKEN, server.cfg.model.name)
    examples = multi.eval_examples()[:3]
    episodes = run_episodes(client, multi, server.tokenizer, examples, 2, 8, 1.0, 128)
    assert len(episodes) == 6
    for i, episode in enumerate(episodes):
        example, turns = examples[i // 2], episode.turns
        # The game ends when the model is right or after three attempts.
        assert turns[-1].strip() == example.answer or len(turns) == 3
        assert len(episode.env_spans) == len(turns) - 1
        reply = f"\nno. reverse: {example.info['task'].data.name}\n"
        reply_ids = server.tokenizer(reply, add_special_tokens=False)["input_ids"]
        for start, end in episode.env_spans:
            assert episode.completion_ids[start:end] == reply_ids
        assert 0.0 <= multi.reward(example, turns) <= 1.0
    assert any(episode.env_spans for episode in episodes)  # the game did answer


# --- a few RL steps through the launcher ---------------------------------------------------


@pytest.mark.slow
def test_few_rl_steps_through_the_launcher(tmp_path: Path) -> None:
    """The multi-turn game (the single-turn path is the orchestrator's ordinary one)."""
    env_id = "relay_reverse_retry"
    run_dir = tmp_path / "run"
    overrides = [
        "environment=verifiers",
        f"environment.args.id={env_id}",
        "environment.args.env_args={num_tasks: 200}",
        "environment.eval_size=8",
        "environment.prompts_per_step=4",
        "environment.group_size=4",
        "environment.max_tokens=8",
        "environment.eval_every=2",
        "warmup.steps=3",
        "max_steps=3",
        f"hydra.run.dir={run_dir}",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "launcher.cli", *overrides],
        cwd=ROOT,
        env={**os.environ, "RELAY_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in records if "loss" in r)
    assert [r["step"] for r in records if "eval/exact_match" in r][-1] == 3
    # Episodes hold the game's replies between model turns.
    samples = (run_dir / "rollouts" / "samples.jsonl").read_text().splitlines()
    assert any("\nno. reverse: " in json.loads(line)["completion"] for line in samples)
