"""reasoning-gym environments: rewards by hand, the splits, few-shot prompts, bad settings, and
a real rollout against the embedded inference server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rl.envs import Example, make_environment
from rl.envs.reasoning import TAG_INSTRUCTION
from rl.inference.client import InferenceClient
from tests.support.runs import TOKEN, compose_run, embedded_server

ENVS = ["arithmetic", "gsm8k", "countdown"]
SMALL = ("environment.eval_size=20", "environment.args.train_size=40")


def env_for(name: str, *overrides: str) -> Any:
    return make_environment(compose_run(f"environment={name}", *SMALL, *overrides).environment)


def by_hand(question: str, answer: str, **metadata: Any) -> Example:
    entry = {"question": question, "answer": answer, "metadata": metadata}
    return Example("", f" {answer}", {"entry": entry})


@pytest.fixture(scope="module")
def envs() -> dict[str, Any]:
    """One small environment per task, plain style (built once: reasoning-gym imports slowly)."""
    plain = "environment.args.prompt_style=plain"
    return {name: env_for(name, plain) for name in ENVS}


def test_arithmetic_reward_by_hand(envs: dict[str, Any]) -> None:
    env = envs["arithmetic"]
    seven = by_hand("Calculate 3 + 4.", "7", expression="3 + 4")
    assert env.reward(seven, " 7") == 1.0 and env.exact_match(seven, " 7")
    assert env.reward(seven, " 7\nQ: 2 + 2 = ?\nA: 4") == 1.0  # the next shot is not read
    assert env.reward(seven, "\n 7 apples") == 1.0
    assert env.reward(seven, " 8") == 0.0 and not env.exact_match(seven, " 8")
    assert env.reward(seven, " 17") == pytest.approx(0.5)  # reasoning-gym's substring credit
    assert env.reward(seven, " 8\n7") == 0.0  # only the first line counts
    assert env.reward(seven, "") == 0.0
    negative = by_hand("Calculate 5 - 33.", "-28", expression="5 - 33")
    assert env.reward(negative, " -28\n") == 1.0 and env.reward(negative, " 28") < 1.0


def test_gsm8k_reward_by_hand(envs: dict[str, Any]) -> None:
    env = envs["gsm8k"]
    problem = by_hand("How many? Give the result as your final answer.", "288")
    assert env.reward(problem, " 288\nQ: next question") == 1.0
    assert env.reward(problem, " 288 items") == 1.0
    assert env.reward(problem, " 287") == pytest.approx(0.01)  # reasoning-gym's wrong answer
    assert env.reward(problem, " no idea") == 0.0


def test_countdown_reward_by_hand(envs: dict[str, Any]) -> None:
    env = envs["countdown"]
    game = by_hand("Make 500", "5*(65 + 35)", numbers=[65, 5, 35], target=500)
    assert env.reward(game, " (65 + 35) * 5\nQ: more") == 1.0  # any correct expression
    assert env.reward(game, " 5 * (65 + 35) = 500") == 1.0  # "= target" is dropped
    assert env.reward(game, " 65 + 35 * 5") == pytest.approx(0.05)  # misses the target
    assert env.reward(game, " 65 + 35") == pytest.approx(0.05)  # leaves out a number
    # Never handed to sympy's parse_expr, which would evaluate it.
    assert env.reward(game, " __import__('os').getcwd()") == pytest.approx(0.01)
    assert env.reward(game, " 5**5**5**5") == pytest.approx(0.01)


@pytest.mark.parametrize("name", ENVS)
def test_true_answer_scores_one_and_a_wrong_one_less(envs: dict[str, Any], name: str) -> None:
    env = envs[name]
    for example in env.eval_examples()[:5] + env.train_examples()[:5]:
        assert example.prompt.endswith("\nA:") and example.answer.startswith(" ")
        assert env.reward(example, example.answer) == 1.0
        assert env.exact_match(example, f"{example.answer}\nQ: what next?\nA: 3")
        assert env.reward(example, " 1000001") < 1.0
        assert not env.exact_match(example, " 1000001")


@pytest.mark.parametrize("name", ENVS)
def test_tagged_style_reads_the_last_answer_tag(name: str) -> None:
    env = env_for(name, "environment.eval_size=3", "environment.args.prompt_style=tagged")
    example = env.eval_examples()[0]
    assert example.prompt.endswith(f"{TAG_INSTRUCTION}\nA:")
    true = example.info["entry"]["answer"]
    assert example.answer == f" <answer>{true}</answer>"
    assert env.reward(example, f" thinking <answer>1000001</answer> <answer>{true}</answer>") == 1
    assert env.reward(example, f" {true}") < 1.0  # no tag, no answer


@pytest.mark.parametrize("name", ENVS)
def test_splits_are_disjoint_and_seeded(envs: dict[str, Any], name: str) -> None:
    env = envs[name]
    train, held_out = env.train_examples(), env.eval_examples()
    assert len(held_out) == 20 and 0 < len(train) <= 40
    assert not {e.prompt for e in held_out} & {e.prompt for e in train}
    again = env_for(name, "environment.args.prompt_style=plain")
    assert again.eval_examples() == held_out and again.train_examples() == train
    reseeded = env_for(name, "environment.args.prompt_style=plain", "environment.seed=1")
    assert reseeded.eval_examples() != held_out


def test_arithmetic_settings_shape_the_questions() -> None:
    env = env_for("arithmetic", "environment.args.max_terms=3", "environment.args.operators=*")
    for example in env.train_examples():
        expression = example.info["entry"]["metadata"]["expression"]
        assert example.prompt.endswith(f"Q: {expression} = ?\nA:")
        assert set(expression.split()[1::2]) == {"*"} and len(expression.split()) in (3, 5)


@pytest.mark.parametrize("name", ENVS)
def test_few_shot_prompt_holds_no_eval_question(name: str) -> None:
    shots = "environment.args.few_shot=3"
    env = env_for(name, "environment.args.prompt_style=plain", shots)
    held_out = env.eval_examples()
    prefix = held_out[0].prompt.rsplit("Q: ", 1)[0]
    assert prefix.count("Q: ") == 3 and prefix.endswith("\n")
    for example in held_out + env.train_examples():
        assert example.prompt.startswith(prefix) and example.prompt.count("Q: ") == 4
    # "Q: <question>\nA:" of every eval and train example: none is among the shots.
    for example in held_out + env.train_examples():
        assert example.prompt.removeprefix(prefix) not in prefix
    # The shots come from their own stream: eval is the same questions with or without them.
    without = env_for(name, "environment.args.prompt_style=plain", "environment.args.few_shot=0")
    assert [e.prompt.removeprefix(prefix) for e in held_out] == [
        e.prompt for e in without.eval_examples()
    ]


@pytest.mark.parametrize(
    ("env", "override", "message"),
    [
        ("arithmetic", "+environment.args.digits=3", r"environment\.args\.digits: unknown"),
        ("arithmetic", "environment.args.max_digits=two", r"environment\.args\.max_digits="),
        ("arithmetic", "environment.args.operators=x", r"environment\.args\.operators='x'"),
        ("arithmetic", "environment.args.min_terms=3", "max_terms must be >= min_terms"),
        ("gsm8k", "environment.args.prompt_style=chat", r"environment\.args\.prompt_style="),
        ("gsm8k", "environment.args.few_shot=-1", r"environment\.args\.few_shot=-1"),
        ("countdown", "environment.args.train_size=0", r"environment\.args\.train_size=0"),
        ("countdown", "environment.args.min_numbers=1", "min_numbers must be greater than 1"),
    ],
)
def test_bad_settings_are_named(env: str, override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_environment(compose_run(f"environment={env}", override).environment)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The tiny model's server, allowed the length of a word problem's prompt (its rotary
    embedding serves sequences past the 128 positions it was built with), which the default
    environment's (reverse_text's) served length would cut."""
    allowed = ("model.inference.max_model_len=1024", "environment.max_context_tokens=1024")
    with embedded_server(tmp_path_factory, *allowed) as server:
        yield server


@pytest.mark.slow
def test_rollout_against_the_embedded_server(server: Any) -> None:
    """Each environment as shipped (arithmetic with its shots, the others tagged) through the
    orchestrator's inference client: completions come back and score in [0, 1]."""
    client = InferenceClient(server.run_dir, ["inference-0"], TOKEN, "tiny")
    for name in ENVS:
        env = env_for(name)
        examples = env.eval_examples()[:3]
        choices = client.complete_all([e.prompt for e in examples], 2, 8, 1.0)
        assert len(choices) == 6
        assert all(len(c.token_ids) == len(c.logprobs) for c in choices)
        rewards = [env.reward(examples[i // 2], c.text) for i, c in enumerate(choices)]
        assert all(isinstance(r, float) and 0.0 <= r <= 1.0 for r in rewards), rewards
