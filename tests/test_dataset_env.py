"""environment=dataset: prompts from a JSONL or Parquet file or a saved `datasets` folder,
rewards from plain functions with weights (TRL's reward_funcs / reward_weights), and a short
run through the launcher on docs/environments.md's example."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl.envs import make_environment
from tests.support.runs import ROOT, compose_run, run_to_end

EXAMPLE = ROOT / "docs" / "examples" / "dataset"
REWARDS = [f"{EXAMPLE / 'rewards.py'}:letters_in_place", f"{EXAMPLE / 'rewards.py'}:no_longer"]


def dataset(path: Path, *overrides: str):
    cfg = compose_run("environment=dataset", f"environment.args.path={path}", *overrides)
    return make_environment(cfg.environment)


def rows() -> list[dict]:
    return [json.loads(x) for x in (EXAMPLE / "words.jsonl").read_text().splitlines()]


def test_a_jsonl_file_with_weighted_reward_functions() -> None:
    env = dataset(EXAMPLE / "words.jsonl", f"environment.args.rewards=[{','.join(REWARDS)}]",
                  "environment.args.reward_weights=[3,1]", "environment.eval_size=64")  # fmt: skip
    assert len(env.eval_examples()) == 64 and len(env.train_examples()) == len(rows()) - 64
    example = env.eval_examples()[0]
    assert example.info == {"word": example.answer[::-1]}  # the row's other fields
    answer = example.answer
    assert env.score(example, answer) == 1.0 and env.exact_match(example, f" {answer}\n")
    half_wrong = answer[0] + "#" * (len(answer) - 1) + "!" * len(answer)  # 1 letter, 2x long
    in_place, no_longer = 1 / len(answer), 0.0
    assert env.score(example, half_wrong) == pytest.approx(0.75 * in_place + 0.25 * no_longer)
    assert env.metrics(example, half_wrong) == {"letters_in_place": in_place, "no_longer": 0.0}
    plain = dataset(EXAMPLE / "words.jsonl")  # no functions: exact match of the answer
    assert plain.score(example, answer) == 1.0 and plain.score(example, answer + "x") == 0.0


def test_parquet_and_a_saved_datasets_folder_hold_the_same_examples(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    saved = datasets.Dataset.from_list(rows())
    saved.to_parquet(str(tmp_path / "words.parquet"))
    saved.save_to_disk(str(tmp_path / "saved"))
    seen = [
        [(e.prompt, e.answer) for e in dataset(path).train_examples()]
        for path in (EXAMPLE / "words.jsonl", tmp_path / "words.parquet", tmp_path / "saved")
    ]
    assert seen[0] == seen[1] == seen[2] and len(seen[0]) == len(rows()) - 64


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([], "environment.args.path: required"),
        (["environment.args.path=nowhere.jsonl"], "no such file or folder"),
        (["environment.args.path={bad}"], "line 2: Expecting value"),
        (["environment.args.path={words}", "environment.args.prompt_field=question"],
         "row 1 has no field 'question' (environment.args.prompt_field); its fields: prompt"),
        (["environment.args.path={words}", "environment.args.rewards=[nope_module:f]"],
         "importing nope_module failed"),
        (["environment.args.path={words}", f"environment.args.rewards=[{REWARDS[0]}]",
          "environment.args.reward_weights=[1,2]"], "one non-negative weight per reward function"),
    ],
)  # fmt: skip
def test_a_bad_dataset_is_refused_in_one_line(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "b"}\nnot json\n')
    given = [o.format(bad=bad, words=EXAMPLE / "words.jsonl") for o in overrides]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_environment(compose_run("environment=dataset", *given).environment)


def test_a_reward_function_out_of_range_stops_with_its_name(tmp_path: Path) -> None:
    (tmp_path / "loud.py").write_text("def loud(completion, **row):\n    return 2.0\n")
    env = dataset(EXAMPLE / "words.jsonl", f"environment.args.rewards=[{tmp_path}/loud.py:loud]")
    with pytest.raises(ValueError, match=r"rewards: loud returned 2.0, not a number in \[0, 1\]"):
        env.score(env.eval_examples()[0], "x")


@pytest.mark.slow
def test_a_short_run_trains_on_the_documented_example(tmp_path: Path) -> None:
    """docs/environments.md's command, 3 steps: the roles find the file and the functions
    (made absolute), and each function's mean is logged."""
    run_dir = tmp_path / "run"
    records = run_to_end(
        run_dir, tmp_path / "cache", "environment=dataset",
        "environment.args.path=docs/examples/dataset/words.jsonl",
        "environment.args.rewards=[docs/examples/dataset/rewards.py:letters_in_place,"
        "docs/examples/dataset/rewards.py:no_longer]",
        "environment.args.reward_weights=[0.8,0.2]", "environment.max_tokens=12", "max_steps=3",
        WANDB_MODE="disabled",
    )  # fmt: skip
    train = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        mixed = 0.8 * r["env/letters_in_place"] + 0.2 * r["env/no_longer"]
        assert r["reward/mean"] == pytest.approx(mixed, abs=1e-6)
    config = (run_dir / "config.yaml").read_text()
    assert f"{EXAMPLE / 'rewards.py'}:no_longer" in config  # made absolute for every role
