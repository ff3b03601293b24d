"""Wordle: feedback and reward on known games, the multi-turn rollout, and the loss mask token
by token from the orchestrator's episode through the wire to the trainer's micro-batch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rl.core import wire
from rl.core.model import encode_prompt, ensure_checkpoint, load_tokenizer
from rl.core.records import Completion, Sample
from rl.envs import Example, make_environment
from rl.envs.wordle import feedback, parse_guess
from rl.inference.client import InferenceClient
from rl.orchestrator.advantages import group_mean
from rl.orchestrator.episodes import run_episodes
from rl.orchestrator.scoring import score_group
from rl.trainer.batches import micro_batch
from tests.support.runs import TOKEN, compose_run, embedded_server


@pytest.fixture(scope="module")
def env() -> Any:
    return make_environment(compose_run("environment=wordle").environment)


@pytest.mark.parametrize(
    ("guess", "secret", "marks"),
    [
        ("crane", "crane", "ggggg"),
        ("crane", "cigar", "gyyxx"),
        ("speed", "abide", "xxyxy"),  # the second e finds no e left, d is elsewhere
        ("eerie", "creep", "yyyxx"),  # both e of creep go to the first two, then r
        ("lllll", "hello", "xxggx"),
    ],
)
def test_feedback_marks_repeated_letters_as_the_game_does(
    guess: str, secret: str, marks: str
) -> None:
    assert feedback(guess, secret) == marks


def test_reward_respond_and_exact_match(env: Any) -> None:
    example = Example(env.prompt(), "cigar")
    assert parse_guess(" Crane\nfeedback") == "crane"
    assert env.respond(example, [" crane"]) == "\nfeedback: gyyxx\nguess 2:"
    assert env.respond(example, [" crane", " cigar"]) is None  # solved
    assert env.respond(example, [" crane"] * 6) is None  # out of guesses
    assert "not a valid guess" in env.respond(example, [" cat"])
    assert env.reward(example, [" crane", " cigar"]) == 1.0
    assert env.exact_match(example, [" crane", " cigar"])
    # Unsolved: half of the best guess's (2 x greens + yellows) / 10; crane gives g y y.
    assert env.reward(example, [" xxxxx", " crane"]) == pytest.approx(0.5 * 4 / 10)
    assert env.reward(example, [" cat"]) == 0.0
    assert not env.exact_match(example, [" crane"])


def test_splits_are_disjoint_and_seeded(env: Any) -> None:
    train = {e.answer for e in env.train_examples()}
    held_out = {e.answer for e in env.eval_examples()}
    assert len(held_out) == 64 and not train & held_out
    again = make_environment(compose_run("environment=wordle").environment)
    assert [e.answer for e in again.eval_examples()] == [e.answer for e in env.eval_examples()]


def test_bad_settings_are_named() -> None:
    for override, named in (
        ("+environment.args.turns=3", "turns"),
        ("environment.args.max_turns=0", "max_turns"),
        ("environment.args.partial_credit=48", "partial_credit"),  # rewards past 0..1
    ):
        with pytest.raises(ValueError, match=named):
            make_environment(compose_run("environment=wordle", override).environment)


class ScriptedClient:
    """An inference client that plays fixed guesses, with token ids from the real tokenizer."""

    def __init__(self, tokenizer: Any, guesses: list[str]) -> None:
        self.tokenizer, self.guesses, self.calls = tokenizer, guesses, []

    def complete_all(
        self,
        prompts: list[list[int]],
        n: int,
        max_tokens: int,
        temperature: float,
        seeds: Any = None,
    ):
        self.calls.append(prompts)
        text = self.guesses[len(self.calls) - 1]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.append(self.tokenizer.eos_token_id)
        version = len(self.calls)
        return [
            Completion(p, ids, [-0.5] * len(ids), text, "stop", version, version) for p in prompts
        ]


def test_masks_cover_exactly_the_models_tokens(env: Any) -> None:
    """Only the model's guesses (and their EOS) carry loss: every feedback token is masked,
    after the episode has gone through scoring, the wire format and the trainer's batching."""
    cfg = compose_run("environment=wordle")
    tokenizer = load_tokenizer(ensure_checkpoint(cfg.model))
    example = Example(env.prompt(), "cigar")
    client = ScriptedClient(tokenizer, [" crane", " xyzzy", " cigar"])
    (choice,) = run_episodes(client, env, tokenizer, [example], 1, 8, 1.0, 512)
    assert choice.turns == [" crane", " xyzzy", " cigar"]
    # Each request carried the whole transcript so far, as token ids.
    prompt = encode_prompt(tokenizer, example.prompt)
    assert client.calls[0] == [prompt]
    assert client.calls[2][0] == prompt + choice.completion_ids[: choice.env_spans[1][1]]
    assert (choice.min_version, choice.max_version) == (1, 3)

    group = score_group(env, group_mean, example, [choice, choice])
    (decoded,), _ = wire.decode(wire.encode([group.to_dict()]))
    sample = Sample.parse(decoded["samples"][0])
    batch = micro_batch([sample], tokenizer.pad_token_id, torch.device("cpu"))
    mask = batch["mask"][0].tolist()
    sequence = batch["ids"][0].tolist()

    model_text = "".join(
        tokenizer.decode([t], skip_special_tokens=True)
        for t, m in zip(sequence, mask, strict=True)
        if m
    )
    assert model_text == " crane xyzzy cigar"
    masked_completion = tokenizer.decode(
        [t for t, m in zip(sequence[len(prompt) :], mask[len(prompt) :], strict=True) if not m]
    )
    assert masked_completion == env.respond(example, [" crane"]) + env.respond(
        example, [" crane", " xyzzy"]
    )
    # Token by token: position i carries loss iff it lies in a model turn.
    spans = sample.env_spans
    for i in range(len(sample.completion_ids)):
        in_env = any(begin <= i < end for begin, end in spans)
        assert mask[len(prompt) + i] is (not in_env)
    assert sum(mask) == sample.trained_tokens
    # The environment's tokens carry no inference logprob either.
    assert torch.all(batch["inference_logprobs"][0][~batch["mask"][0]] == 0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # Six turns of transcript outgrow the tiny model's 128 positions; its rotary embedding
    # serves longer sequences, so the server is allowed 512.
    with embedded_server(
        tmp_path_factory, "environment=wordle", "model.inference.max_model_len=512"
    ) as server:
        yield server


@pytest.mark.slow
def test_real_rollout_against_the_embedded_server(server: Any, env: Any) -> None:
    client = InferenceClient(server.run_dir, ["inference-0"], TOKEN, "tiny")
    examples = env.train_examples()[:3]
    choices = run_episodes(client, env, server.tokenizer, examples, 4, 8, 1.0, 512)
    assert len(choices) == 12
    for example, choice in zip([e for e in examples for _ in range(4)], choices, strict=True):
        turns = choice.turns
        assert 1 <= len(turns) <= 6
        # An unsolved game uses every guess; one environment reply between model turns.
        assert len(choice.env_spans) == len(turns) - 1
        if not env.exact_match(example, turns):
            assert len(turns) == 6
        assert len(choice.logprobs) == len(choice.completion_ids)
        assert 0.0 <= env.reward(example, turns) <= 1.0
        text = server.tokenizer.decode(choice.completion_ids, skip_special_tokens=True)
        assert text.count("feedback:") == len(turns) - 1
