"""Losses and advantage estimators: small pure functions over token tensors, in registries.

Shapes: `logprobs`, `inference_logprobs`, `mask` are [batch, tokens] over completion tokens
(mask 1 where the token was sampled by the policy); `advantages` is [batch].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

LossFn = Callable[..., tuple[Tensor, dict[str, float]]]


def default_loss(
    logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    prob_diff_pos: float,
    prob_diff_neg: float,
    log_ratio_coef: float,
) -> tuple[Tensor, dict[str, float]]:
    """Importance-weighted policy gradient with a DPPO-style trust-region mask.

    Per token: weight = stop_grad(pi/mu) * A on log pi (a weighted likelihood, so the
    gradient is the importance-sampled policy gradient). A token is masked out when the
    trainer already moved its probability past the behaviour policy's by more than the
    threshold in the advantage's direction (p - mu > pos for A > 0, mu - p > neg for A < 0).
    A small squared log-ratio term keeps the trainer near the inference policy. The sum is
    normalised by the number of completion tokens in the batch.
    """
    mask = mask.to(logprobs.dtype)
    adv = advantages[:, None].to(logprobs.dtype)
    log_ratio = logprobs - inference_logprobs
    ratio = torch.exp(log_ratio.detach())
    prob_diff = torch.exp(logprobs.detach()) - torch.exp(inference_logprobs)
    masked = ((adv > 0) & (prob_diff > prob_diff_pos)) | ((adv < 0) & (prob_diff < -prob_diff_neg))
    keep = mask * (~masked).to(mask.dtype)
    tokens = mask.sum().clamp(min=1.0)
    pg = -(ratio * adv * logprobs * keep).sum() / tokens
    reg = log_ratio_coef * (log_ratio.pow(2) * mask).sum() / tokens
    with torch.no_grad():
        stats = {
            "masked_fraction": float((masked.to(mask.dtype) * mask).sum() / tokens),
            "ratio_mean": float((ratio * mask).sum() / tokens),
            "mismatch_kl": float(((ratio - 1 - log_ratio.detach()) * mask).sum() / tokens),
        }
    return pg + reg, stats


LOSSES: dict[str, LossFn] = {"default": default_loss}
