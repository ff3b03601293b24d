"""Policy-gradient losses with importance-ratio correction, in a registry.

Every loss is a pure function of token tensors of shape [batch, tokens] over completion tokens:
`logprobs` (trainer, with gradient), `inference_logprobs` (the behaviour policy that sampled
them), `advantages` [batch], and `mask` (1 where a token was sampled by the policy). It returns
a per-token loss [batch, tokens] and token masks for the metrics; `reduce` turns the per-token
loss into the scalar to differentiate, under the chosen normalisation. With r = pi/mu:

- default: sg(r) * A on log pi, masked where the trainer's probability has already moved past
  mu by more than a threshold in the advantage's direction, plus c * (log r)^2.
- aipo (INTELLECT-2): -min(r, delta) * A; no gradient once r passes delta.
- grpo (PPO clip): -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A), optional k3 KL to a
  reference model.
- gspo: the same clipped surrogate with the sequence ratio s = exp(mean_t log r) in place of r.
- cispo (MiniMax-M1): -sg(min(r, is_max)) * A * log pi: the weight is clipped, never the
  gradient.

At r = 1 (fully on-policy, no reference KL) every loss has the gradient of -A * log pi.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rl.core.config import Loss


@dataclass(frozen=True)
class LossOutput:
    """Per-token loss and the token masks metrics are made of."""

    per_token: Tensor
    masked: Tensor  # tokens whose gradient the trust region removed
    clipped: Tensor  # tokens whose ratio or weight was clipped


def _ratio(logprobs: Tensor, inference_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    log_ratio = logprobs - inference_logprobs
    return log_ratio, torch.exp(log_ratio)


def default_loss(logprobs: Tensor, inference_logprobs: Tensor, advantages: Tensor, p: Any,
                 **_: Any) -> LossOutput:  # fmt: skip
    adv = advantages[:, None]
    log_ratio, ratio = _ratio(logprobs, inference_logprobs)
    prob_diff = torch.exp(logprobs.detach()) - torch.exp(inference_logprobs)
    masked = ((adv > 0) & (prob_diff > p.prob_diff_pos)) | (
        (adv < 0) & (prob_diff < -p.prob_diff_neg)
    )
    pg = -ratio.detach() * adv * logprobs * (~masked)
    return LossOutput(pg + p.log_ratio_coef * log_ratio.pow(2), masked, torch.zeros_like(masked))


def aipo_loss(logprobs: Tensor, inference_logprobs: Tensor, advantages: Tensor, p: Any,
              **_: Any) -> LossOutput:  # fmt: skip
    _, ratio = _ratio(logprobs, inference_logprobs)
    clipped = ratio.detach() > p.aipo_delta
    per_token = -torch.clamp(ratio, max=p.aipo_delta) * advantages[:, None]
    return LossOutput(per_token, clipped, clipped)


def _clipped_surrogate(ratio: Tensor, adv: Tensor, low: float, high: float) -> LossOutput:
    unclipped = ratio * adv
    clipped_term = torch.clamp(ratio, 1 - low, 1 + high) * adv
    per_token = -torch.minimum(unclipped, clipped_term)
    # The clipped branch is taken (and carries no gradient) where it is the smaller one.
    clipped = (clipped_term < unclipped).detach()
    return LossOutput(per_token, clipped, clipped)


def grpo_loss(logprobs: Tensor, inference_logprobs: Tensor, advantages: Tensor, p: Any,
              ref_logprobs: Tensor | None = None, **_: Any) -> LossOutput:  # fmt: skip
    _, ratio = _ratio(logprobs, inference_logprobs)
    out = _clipped_surrogate(ratio, advantages[:, None], p.clip_low, p.clip_high)
    if p.kl_coef and ref_logprobs is not None:
        # k3 estimator of KL(pi || ref): exp(ref - pi) - (ref - pi) - 1, unbiased and >= 0.
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1
        return LossOutput(out.per_token + p.kl_coef * kl, out.masked, out.clipped)
    return out


def gspo_loss(logprobs: Tensor, inference_logprobs: Tensor, advantages: Tensor, p: Any,
              mask: Tensor, **_: Any) -> LossOutput:  # fmt: skip
    log_ratio, _ = _ratio(logprobs, inference_logprobs)
    lengths = mask.sum(dim=1).clamp(min=1)
    seq_ratio = torch.exp((log_ratio * mask).sum(dim=1) / lengths)
    out = _clipped_surrogate(seq_ratio, advantages, p.seq_clip_low, p.seq_clip_high)
    # Every token of a sequence carries its sequence's loss; with `sequence` normalisation the
    # reduction is the mean over sequences, as GSPO defines it.
    per_token = out.per_token[:, None].expand_as(logprobs)
    clipped = out.clipped[:, None].expand_as(logprobs)
    return LossOutput(per_token, clipped, clipped)


def cispo_loss(logprobs: Tensor, inference_logprobs: Tensor, advantages: Tensor, p: Any,
               **_: Any) -> LossOutput:  # fmt: skip
    _, ratio = _ratio(logprobs, inference_logprobs)
    weight = torch.clamp(ratio.detach(), max=p.is_max)
    clipped = ratio.detach() > p.is_max
    per_token = -weight * advantages[:, None] * logprobs
    return LossOutput(per_token, torch.zeros_like(clipped), clipped)


LossFn = Callable[..., LossOutput]
LOSSES: dict[str, LossFn] = {
    Loss.default: default_loss,
    Loss.aipo: aipo_loss,
    Loss.grpo: grpo_loss,
    Loss.gspo: gspo_loss,
    Loss.cispo: cispo_loss,
}
"""Each `algorithm.loss` (rl/core/config.py's `Loss`, whose every value has one)."""


def reduce(per_token: Tensor, mask: Tensor, mode: str, totals: dict[str, float]) -> Tensor:
    """The scalar loss of a micro-batch, normalised by whole-batch totals so that gradients
    accumulated over micro-batches equal one pass over the batch.

    - token: sum over every completion token / tokens in the batch (each token counts once).
    - sequence: mean over each sequence's tokens, then sum / sequences in the batch (each
      sample counts once, whatever its length).
    - constant (Dr.GRPO): sum / (sequences x max_tokens), a constant free of length bias.
    """
    mask = mask.to(per_token.dtype)
    if mode == "token":
        return (per_token * mask).sum() / totals["tokens"]
    if mode == "sequence":
        per_seq = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_seq.sum() / totals["sequences"]
    if mode == "constant":
        return (per_token * mask).sum() / (totals["sequences"] * totals["max_tokens"])
    raise ValueError(f"algorithm.normalization={mode}: valid: token, sequence, constant")


def loss_stats(out: LossOutput, logprobs: Tensor, inference_logprobs: Tensor,
               mask: Tensor) -> dict[str, Tensor]:  # fmt: skip
    """Sums over this micro-batch's tokens (divide by the batch's tokens for means)."""
    with torch.no_grad():
        m = mask.to(logprobs.dtype)
        log_ratio = logprobs.detach() - inference_logprobs
        ratio = torch.exp(log_ratio)
        big = torch.finfo(ratio.dtype).max
        return {
            "masked_fraction": (out.masked.to(m.dtype) * m).sum(),
            "clipped_fraction": (out.clipped.to(m.dtype) * m).sum(),
            # KL(mu || pi) estimated from tokens sampled by mu (k3): r - 1 - log r.
            "mismatch_kl": ((ratio - 1 - log_ratio) * m).sum(),
            "ratio_mean": (ratio * m).sum(),
            "ratio_max": torch.where(mask.bool(), ratio, -big).max(),
            "ratio_min": torch.where(mask.bool(), ratio, big).min(),
        }
