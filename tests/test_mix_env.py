"""environment=mix: single-turn environments in one run, drawn by weight, each prompt scored
by the environment it came from; a short run through the launcher logs each member's reward."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from rl.envs import make_environment
from rl.envs.mix import MEMBER
from tests.support.runs import compose_run, run_to_end


def test_members_are_drawn_by_weight_and_score_their_own_prompts() -> None:
    env = make_environment(compose_run("environment=mix").environment)  # 0.75 / 0.25
    drawn = Counter(e.info[MEMBER] for e in env.train_examples())
    assert drawn[0] == 3 * drawn[1]
    held_out = Counter(e.info[MEMBER] for e in env.eval_examples())
    assert held_out == {0: 150, 1: 50}
    reverse = next(e for e in env.eval_examples() if e.info[MEMBER] == 0)
    arithmetic = next(e for e in env.eval_examples() if e.info[MEMBER] == 1)
    assert env.score(reverse, reverse.answer) == 1.0 and env.exact_match(reverse, reverse.answer)
    assert env.metrics(arithmetic, arithmetic.answer) == {"arithmetic/reward": 1.0}
    assert not env.exact_match(arithmetic, reverse.answer)
    # The same seed draws the same pool; the members' own examples are unchanged.
    again = make_environment(compose_run("environment=mix").environment)
    assert [e.prompt for e in again.train_examples()] == [e.prompt for e in env.train_examples()]


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ("[{option: reverse_text}]", "give two or more"),
        ("[{option: reverse_text},{option: nope}]", "no environment option 'nope'"),
        ("[{option: reverse_text},{option: wordle}]", "wordle is multi-turn"),
        ("[{option: reverse_text,weight: 0},{option: arithmetic}]", "each weight above 0"),
    ],
)
def test_a_mix_it_cannot_make_is_refused(members: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_environment(compose_run("environment=mix", f"environment.args.members={members}")
                         .environment)  # fmt: skip


@pytest.mark.slow
def test_a_short_mixed_run_logs_each_members_reward(tmp_path: Path) -> None:
    records = run_to_end(tmp_path / "run", tmp_path / "cache", "environment=mix", "max_steps=3",
                         "environment.prompts_per_step=32", WANDB_MODE="disabled")  # fmt: skip
    train = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    # Each member's groups that had signal were trained on (tied ones, as an untrained model's
    # arithmetic mostly is, are dropped), and their rewards logged by member.
    logged = {k for r in train for k in r if k.startswith("env/")}
    assert logged == {"env/reverse_text/reward", "env/arithmetic/reward"}, logged
