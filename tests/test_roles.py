"""Unit tests of the orchestrator's scoring and the trainer's token bookkeeping."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl.core.records import Completion, Episode
from rl.core.rundir import RunDir
from rl.envs import Example, make_environment
from rl.orchestrator.advantages import group_mean
from rl.orchestrator.scoring import no_signal, score_group
from rl.trainer.batches import pad_batch, token_logprobs
from tests.support.runs import compose_run


def choice(text: str, ids: list[int], version: int) -> Episode:
    """A single-turn rollout of `text` (token ids `ids`) sampled by policy `version`."""
    return Episode.of(Completion([1, 5, 6], ids, [-0.1] * len(ids), text, "stop", version, version))


def test_score_group_rewards_advantages_and_versions() -> None:
    env = make_environment(compose_run().environment)
    example = Example("reverse: abc\n", "cba")
    choices = [choice("cba", [7, 8, 9, 2], 4), choice("xyz", [10, 11, 12, 2], 5)]
    group = score_group(env, group_mean, example, choices)
    assert [s.reward for s in group.samples] == [1.0, 0.0]
    assert [s.advantage for s in group.samples] == [0.5, -0.5]
    assert (group.min_version, group.max_version) == (4, 5)
    assert group.samples[1].completion_ids == [10, 11, 12, 2]


def test_newest_version_ignores_incomplete(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    assert run_dir.newest_version() == -1  # no weights/ yet
    for n, complete in ((0, True), (1, True), (2, False)):
        run_dir.weights_for(n).mkdir(parents=True)
        if complete:
            (run_dir.weights_for(n) / "COMPLETE").touch()
    (run_dir.weights / "step_3.tmp").mkdir()
    (run_dir.weights / "9").mkdir()  # not a step_N folder, complete or not
    (run_dir.weights / "9" / "COMPLETE").touch()
    assert run_dir.newest_version() == 1


def test_pad_batch_marks_completion_tokens() -> None:
    ids, attention, completion = pad_batch([[1, 2, 3, 4], [1, 2, 5]], [2, 1], pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 4], [1, 2, 5, 0]]
    assert attention.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert completion.tolist() == [[False, False, True, True], [False, True, True, False]]


class Bigram(torch.nn.Module):
    """A model whose next-token logits depend only on the current token: easy to check."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):  # noqa: ARG002
        return type("Out", (), {"logits": self.table[input_ids]})


def test_token_logprobs_score_each_token_given_its_prefix() -> None:
    torch.manual_seed(0)
    model = Bigram(6)
    ids = torch.tensor([[1, 2, 3, 4]])
    logp, entropy = token_logprobs(model, ids, torch.ones_like(ids))
    table = torch.log_softmax(model.table.detach(), dim=-1)
    expected = [0.0, table[1, 2].item(), table[2, 3].item(), table[3, 4].item()]
    assert logp[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert entropy[0, 1].item() == pytest.approx(-(table[1].exp() * table[1]).sum().item())


def test_length_penalty_shapes_advantages_not_rewards() -> None:
    env = make_environment(compose_run().environment)
    example = Example("reverse: abc\n", "cba")
    choices = [choice("cba", [7, 8, 9, 2], 0), choice("cba", [7, 8, 9, 9, 9, 9, 9, 2], 0)]
    group = score_group(env, group_mean, example, choices, length_penalty=0.5, max_tokens=8)
    # Both exact (reward 1.0); shaped 1 - 0.5*4/8 = 0.75 and 1 - 0.5*8/8 = 0.5, mean 0.625.
    assert [s.reward for s in group.samples] == [1.0, 1.0]
    assert [s.advantage for s in group.samples] == pytest.approx([0.125, -0.125])
    assert not no_signal(group)
    flat = score_group(env, group_mean, example, choices)
    assert no_signal(flat)
