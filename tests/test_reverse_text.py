"""reverse_text: reward by hand, the split, and bad settings."""

from __future__ import annotations

import pytest

from rl.envs import Example, make_environment
from rl.envs.reverse_text import lcs_length, lcs_ratio
from tests.support.runs import compose_run


def test_lcs_by_hand() -> None:
    assert lcs_length("olleh", "olleh") == 5
    assert lcs_length("oleh", "olleh") == 4
    assert lcs_length("abc", "xyz") == 0
    assert lcs_ratio("oleh", "olleh") == pytest.approx(4 / 5)
    assert lcs_ratio("ollehxxxxx", "olleh") == pytest.approx(5 / 10)  # padding is penalised
    assert lcs_ratio("", "") == 1.0


def test_reward_and_exact_match() -> None:
    env = make_environment(compose_run().environment)
    example = Example("reverse: hello\n", "olleh")
    assert env.reward(example, "olleh") == 1.0 and env.exact_match(example, "olleh")
    assert env.reward(example, "olle") == pytest.approx(0.8)
    assert not env.exact_match(example, "olle")


def test_split_is_disjoint_seeded_and_sized() -> None:
    cfg = compose_run("environment.eval_size=50")
    env = make_environment(cfg.environment)
    train, held_out = env.train_examples(), env.eval_examples()
    assert len(held_out) == 50
    assert not {e.prompt for e in held_out} & {e.prompt for e in train}
    for e in train:
        assert 3 <= len(e.answer) <= 6 and e.prompt == f"reverse: {e.answer[::-1]}\n"
    again = make_environment(cfg.environment).eval_examples()
    assert again == held_out


def test_unknown_argument_is_named() -> None:
    cfg = compose_run("+environment.args.maxlen=9")
    with pytest.raises(ValueError, match="environment.args.maxlen: unknown; valid: max_len"):
        make_environment(cfg.environment)
