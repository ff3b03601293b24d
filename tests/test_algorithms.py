"""Every loss and estimator against numbers computed by hand in the test."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from rl.core.config import AlgorithmConfig
from rl.orchestrator.advantages import group_mean, rloo, zscore
from rl.trainer.losses import LOSSES, loss_stats, reduce

PARAMS = replace(AlgorithmConfig(name="test"), log_ratio_coef=0.0)


def one_token(name: str, p: float, mu: float, adv: float, **params: float):
    """Loss and d loss / d log p for a single token with probability p under the trainer and
    mu under the inference policy."""
    logp = torch.tensor([[math.log(p)]], requires_grad=True)
    out = LOSSES[name](
        logp,
        torch.tensor([[math.log(mu)]]),
        torch.tensor([adv]),
        replace(PARAMS, **params),
        mask=torch.ones(1, 1),
        ref_logprobs=None,
    )
    loss = reduce(out.per_token, torch.ones(1, 1), "token", {"tokens": 1.0})
    loss.backward()
    return loss.item(), logp.grad.item(), out


def test_group_mean_rloo_zscore_by_hand() -> None:
    rewards = [1.0, 0.0, 0.5, 0.5]  # mean 0.5
    assert group_mean(rewards) == [0.5, -0.5, 0.0, 0.0]
    # RLOO: r_i - mean(others): 1 - 1/3, 0 - 2/3, 0.5 - 1.5/3, 0.5 - 1.5/3
    assert rloo(rewards) == pytest.approx([2 / 3, -2 / 3, 0.0, 0.0])
    std = math.sqrt(0.5 / 3)  # sample std of (0.5, -0.5, 0, 0)
    assert zscore(rewards) == pytest.approx([0.5 / std, -0.5 / std, 0.0, 0.0], rel=1e-5)
    assert zscore([0.3, 0.3]) == [0.0, 0.0]


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_on_policy_every_loss_is_the_plain_policy_gradient(name: str) -> None:
    # Two sequences; the second has two real tokens and one pad.
    logp = torch.tensor([[-0.5, -1.0, -2.0], [-0.3, -0.7, -9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([0.5, -1.0])
    out = LOSSES[name](logp, logp.detach(), adv, PARAMS, mask=mask, ref_logprobs=None)
    totals = {"tokens": 5.0, "sequences": 2.0, "max_tokens": 3.0}
    mode = "sequence" if name == "gspo" else "token"
    reduce(out.per_token, mask, mode, totals).backward()
    if mode == "token":  # d/d logp of -sum(A logp)/5 = -A/5 on real tokens
        expected = [-0.1, -0.1, -0.1, 0.2, 0.2, 0.0]
    else:  # -mean over sequences of A * mean_t logp: -A / (2 x length)
        expected = [-0.5 / 6] * 3 + [1 / 4, 1 / 4, 0.0]
    assert logp.grad.flatten().tolist() == pytest.approx(expected, abs=1e-6)
    assert out.masked.sum() == 0 and out.clipped.sum() == 0


def test_default_importance_weight_and_squared_log_ratio() -> None:
    loss, grad, _ = one_token("default", 0.5, 0.4, 2.0)  # p - mu = 0.1: kept
    assert loss == pytest.approx(-(0.5 / 0.4) * 2.0 * math.log(0.5))
    assert grad == pytest.approx(-2.5)
    loss, grad, _ = one_token("default", 0.5, 0.25, 0.0, log_ratio_coef=0.1)
    assert loss == pytest.approx(0.1 * math.log(2) ** 2)
    assert grad == pytest.approx(0.2 * math.log(2))


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
def test_default_mask_edges(p: float, mu: float, adv: float, masked: bool) -> None:
    _, grad, out = one_token("default", p, mu, adv)
    assert bool(out.masked.item()) is masked
    assert grad == pytest.approx(0.0 if masked else -(p / mu) * adv, abs=1e-6)


@pytest.mark.parametrize(
    ("p", "mu", "grad"),
    [
        (0.3, 0.1, -3.0 * 2.0),  # r = 3 < delta 4: d(-r A)/dlogp = -r A
        (0.5, 0.1, 0.0),  # r = 5 > 4: truncated, no gradient
    ],
)
def test_aipo_truncates_the_ratio(p: float, mu: float, grad: float) -> None:
    loss, g, out = one_token("aipo", p, mu, 2.0)
    assert loss == pytest.approx(-min(p / mu, 4.0) * 2.0)
    assert g == pytest.approx(grad)
    assert bool(out.clipped.item()) is (p / mu > 4.0)


@pytest.mark.parametrize(
    ("r", "adv", "value", "grad"),
    [
        (1.1, 1.0, -1.1, -1.1),  # inside [0.8, 1.28]: surrogate r A
        (1.5, 1.0, -1.28, 0.0),  # above 1 + 0.28 with A > 0: clipped, no gradient
        (1.5, -1.0, 1.5, 1.5),  # A < 0: min picks the unclipped r A, gradient -r A
        (0.5, -1.0, 0.8, 0.0),  # below 1 - 0.2 with A < 0: clipped at 0.8
        (0.5, 1.0, -0.5, -0.5),  # below with A > 0: unclipped
    ],
)
def test_grpo_clip_edges(r: float, adv: float, value: float, grad: float) -> None:
    loss, g, out = one_token("grpo", 0.5 * r, 0.5, adv)
    assert loss == pytest.approx(value)
    assert g == pytest.approx(grad)
    assert bool(out.clipped.item()) is (grad == 0.0)


def test_grpo_k3_kl_to_reference() -> None:
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]])
    params = replace(PARAMS, kl_coef=0.1)
    out = LOSSES["grpo"](logp, logp.detach(), torch.tensor([0.0]), params, ref_logprobs=ref)
    # zero advantage: 0.1 * (exp(d) - d - 1), d = log(0.25/0.5) = -log 2
    d = -math.log(2)
    assert out.per_token.item() == pytest.approx(0.1 * (math.exp(d) - d - 1))
    out.per_token.sum().backward()
    # d/dlogp of exp(ref - logp) - (ref - logp) = -exp(d) + 1
    assert logp.grad.item() == pytest.approx(0.1 * (1 - math.exp(d)))


def test_gspo_uses_the_sequence_ratio() -> None:
    # Token ratios 2 and 1/2: geometric mean 1, so nothing is clipped although each token is.
    logp = torch.tensor([[math.log(0.4), math.log(0.1)]], requires_grad=True)
    mu = torch.tensor([[math.log(0.2), math.log(0.2)]])
    mask = torch.ones(1, 2)
    out = LOSSES["gspo"](logp, mu, torch.tensor([1.0]), PARAMS, mask=mask)
    loss = reduce(out.per_token, mask, "sequence", {"sequences": 1.0})
    assert loss.item() == pytest.approx(-1.0)
    loss.backward()
    # d(-s)/dlogp_t = -s / T = -0.5 for each token
    assert logp.grad.flatten().tolist() == pytest.approx([-0.5, -0.5])
    # A sequence ratio of 1.001 is past 1 + 4e-4: clipped, no gradient.
    logp2 = torch.tensor([[math.log(0.2 * 1.001)]], requires_grad=True)
    out2 = LOSSES["gspo"](logp2, torch.tensor([[math.log(0.2)]]), torch.tensor([1.0]), PARAMS,
                          mask=torch.ones(1, 1))  # fmt: skip
    out2.per_token.sum().backward()
    assert logp2.grad.item() == 0.0 and out2.clipped.all()


@pytest.mark.parametrize(("p", "weight"), [(0.3, 3.0), (0.6, 4.0)])
def test_cispo_clips_the_weight_not_the_gradient(p: float, weight: float) -> None:
    loss, grad, out = one_token("cispo", p, 0.1, 2.0)  # r = 3 (kept) or 6 (clipped to 4)
    assert loss == pytest.approx(-weight * 2.0 * math.log(p))
    assert grad == pytest.approx(-weight * 2.0)
    assert bool(out.clipped.item()) is (p / 0.1 > 4.0)


def test_reductions_by_hand() -> None:
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    totals = {"tokens": 5.0, "sequences": 2.0, "max_tokens": 4.0}
    assert reduce(per_token, mask, "token", totals).item() == pytest.approx(15 / 5)
    assert reduce(per_token, mask, "sequence", totals).item() == pytest.approx((2 + 4.5) / 2)
    assert reduce(per_token, mask, "constant", totals).item() == pytest.approx(15 / 8)
    with pytest.raises(ValueError, match="valid: token, sequence, constant"):
        reduce(per_token, mask, "nope", totals)


def test_stats_count_masked_clipped_and_mismatch() -> None:
    logp = torch.log(torch.tensor([[0.61, 0.5]]))
    mu = torch.log(torch.tensor([[0.4, 0.5]]))
    mask = torch.ones(1, 2)
    out = LOSSES["default"](logp, mu, torch.tensor([1.0]), PARAMS, mask=mask)
    stats = loss_stats(out, logp, mu, mask)
    r = 0.61 / 0.4
    assert stats["masked_fraction"].item() == 1.0  # sums: divide by tokens for fractions
    assert stats["mismatch_kl"].item() == pytest.approx(r - 1 - math.log(r), rel=1e-5)
    assert stats["ratio_max"].item() == pytest.approx(r, rel=1e-5)
    assert stats["ratio_min"].item() == pytest.approx(1.0)


def test_every_configurable_loss_and_advantage_has_its_function() -> None:
    """The registries are keyed by the config's enums, value for value: a new option is one
    enum value and one function, and neither can be added alone."""
    from rl.core.config import Advantage, Loss
    from rl.orchestrator.advantages import ADVANTAGES

    assert list(LOSSES) == list(Loss)
    assert list(ADVANTAGES) == list(Advantage)
