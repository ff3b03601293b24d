"""Loss and advantages against numbers computed by hand in the test."""

from __future__ import annotations

import math

import pytest
import torch

from rl.advantages import group_mean, rloo, zscore
from rl.algorithms import default_loss

KW = {"prob_diff_pos": 0.2, "prob_diff_neg": 0.2, "log_ratio_coef": 0.0}


def test_group_mean_rloo_zscore_by_hand() -> None:
    rewards = [1.0, 0.0, 0.5, 0.5]  # mean 0.5
    assert group_mean(rewards) == [0.5, -0.5, 0.0, 0.0]
    # RLOO: r_i - mean(others): 1 - 1/3, 0 - 2/3, 0.5 - 1.5/3, 0.5 - 1.5/3
    assert rloo(rewards) == pytest.approx([2 / 3, -2 / 3, 0.0, 0.0])
    # sample std of (0.5, -0.5, 0, 0) = sqrt(0.5 / 3)
    std = math.sqrt(0.5 / 3)
    assert zscore(rewards) == pytest.approx([0.5 / std, -0.5 / std, 0.0, 0.0], rel=1e-5)


def test_on_policy_default_loss_is_plain_policy_gradient() -> None:
    # Two sequences, three token slots; the second sequence has two real tokens.
    logits = torch.tensor([[-0.5, -1.0, -2.0], [-0.3, -0.7, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([0.5, -1.0])
    loss, stats = default_loss(logits, logits.detach(), adv, mask, **KW)
    # ratio 1, nothing masked: loss = -sum(A * logp) / 5 tokens
    expected = -(0.5 * (-0.5 - 1.0 - 2.0) + (-1.0) * (-0.3 - 0.7)) / 5
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    # d loss / d logp = -A / 5 on real tokens, 0 on padding
    assert logits.grad.flatten().tolist() == pytest.approx([-0.1, -0.1, -0.1, 0.2, 0.2, 0.0])
    assert stats["masked_fraction"] == 0.0 and stats["mismatch_kl"] == pytest.approx(0.0)


def test_importance_ratio_weights_the_gradient() -> None:
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    mu = torch.tensor([[math.log(0.4)]])  # p - mu = 0.1 < 0.2: kept
    loss, _ = default_loss(logp, mu, torch.tensor([2.0]), torch.tensor([[1]]), **KW)
    loss.backward()
    # loss = -(0.5/0.4) * 2 * logp  -> gradient -2.5
    assert logp.grad.item() == pytest.approx(-2.5)


@pytest.mark.parametrize(
    ("p", "mu", "adv", "masked"),
    [
        (0.61, 0.40, 1.0, True),  # positive advantage, p - mu = 0.21 > 0.2
        (0.59, 0.40, 1.0, False),  # 0.19: kept
        (0.19, 0.40, -1.0, True),  # negative advantage, mu - p = 0.21 > 0.2
        (0.21, 0.40, -1.0, False),  # 0.19: kept
        (0.10, 0.40, 1.0, False),  # positive advantage pushing p up is never masked
        (0.90, 0.40, -1.0, False),  # negative advantage pushing p down is never masked
    ],
)
def test_probability_difference_mask_edges(p: float, mu: float, adv: float, masked: bool) -> None:
    logp = torch.tensor([[math.log(p)]], requires_grad=True)
    loss, stats = default_loss(
        logp, torch.tensor([[math.log(mu)]]), torch.tensor([adv]), torch.tensor([[1]]), **KW
    )
    loss.backward()
    assert stats["masked_fraction"] == (1.0 if masked else 0.0)
    expected_grad = 0.0 if masked else -(p / mu) * adv
    assert logp.grad.item() == pytest.approx(expected_grad, abs=1e-6)


def test_squared_log_ratio_term() -> None:
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    mu = torch.tensor([[math.log(0.25)]])
    kw = {**KW, "log_ratio_coef": 0.1}
    loss, _ = default_loss(logp, mu, torch.tensor([0.0]), torch.tensor([[1]]), **kw)
    # zero advantage: loss = 0.1 * (log 2)^2, gradient 0.2 * log 2
    assert loss.item() == pytest.approx(0.1 * math.log(2) ** 2)
    loss.backward()
    assert logp.grad.item() == pytest.approx(0.2 * math.log(2))
