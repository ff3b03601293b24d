"""The LM head in chunks: token log-probabilities without a whole sequence's logits.

A micro-batch of T tokens over a vocabulary of V holds T x V logits, and the loss's float32
log-softmax and its gradient beside them: 131,072 tokens of a 154,880-word vocabulary are over
200 GB. With `trainer.lm_head_chunk` set, the model's LM head computes only what the loss
reads: for each (row, column, target) it is asked for, the log-probability of the target and
the entropy of the distribution, `chunk` positions at a time. Its backward pass computes each
chunk's logits again from the saved head input (the gradient of a log-probability is the
one-hot target less the softmax), so no pass holds more than one chunk's logits; the head's
weight gradient is summed over chunks in float32.

The head stays the model's own module (its weight keeps its name, its FSDP shard and its tie to
the embedding): `enable` replaces its `forward`, which computes logits as before unless a
caller has asked for pairs (`asked`), in which case the model's `logits` output is [N, 2]:
each pair's log-probability and entropy. It runs inside the model's forward, so FSDP has the
head's weight gathered, as for the plain head.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F


def _head(model: Any) -> Any:
    """The model's LM head module (under a PEFT model's wrapping for LoRA), or None for a
    model that has none to name."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    get = getattr(model, "get_output_embeddings", None)
    return get() if get is not None else None


def enable(model: Any, chunk: int) -> None:
    """Give the model's LM head the chunked path (`chunk` positions at a time)."""
    head = _head(model)
    if getattr(head, "bias", None) is not None:
        raise ValueError("trainer.lm_head_chunk: the model's LM head has a bias, not built")
    plain = head.forward
    head.relay_pairs = None

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        pairs = head.relay_pairs
        if pairs is None:
            return plain(hidden)
        rows, cols, targets = pairs
        logp, entropy = ChunkedLogprobs.apply(hidden[rows, cols], head.weight, targets, chunk)
        return torch.stack((logp, entropy.detach()), dim=-1)

    head.forward = forward
    head.relay_chunk = chunk


def enabled(model: Any) -> bool:
    return getattr(_head(model), "relay_chunk", 0) > 0


@contextlib.contextmanager
def asked(model: Any, rows: torch.Tensor, cols: torch.Tensor, targets: torch.Tensor) -> Iterator:
    """Within the block, the model's forward returns as `logits` the [N, 2] log-probability
    and entropy of `targets` [N] at positions (`rows`, `cols`) of its input."""
    head = _head(model)
    head.relay_pairs = (rows, cols, targets)
    try:
        yield
    finally:
        head.relay_pairs = None


def pair_logprobs(
    model: Any, rows: torch.Tensor, cols: torch.Tensor, targets: torch.Tensor, **inputs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's log-probability of each target at its (row, column) and the entropy there
    (no gradient), [N] each, through the chunked head."""
    with asked(model, rows, cols, targets):
        out = model(**inputs).logits
    return out[:, 0], out[:, 1].detach()


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """What the head's matmuls run in: autocast's dtype where it is on, else the weight's (the
    compute dtype FSDP gathered it in)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


class ChunkedLogprobs(torch.autograd.Function):
    """log p(target) and the entropy for hidden states [N, H] under the head `weight` [V, H],
    a chunk of rows at a time; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _compute_dtype(hidden, weight)
        w = weight.to(dtype)
        logp = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for start in range(0, hidden.shape[0], chunk):
            part = slice(start, start + chunk)
            logits = F.linear(hidden[part].to(dtype), w).float()
            lse[part] = torch.logsumexp(logits, dim=-1)
            logp[part] = logits.gather(-1, targets[part, None]).squeeze(-1) - lse[part]
            probs = torch.exp(logits - lse[part, None])
            entropy[part] = lse[part] - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.dtype = chunk, dtype
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _entropy: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, targets, lse = ctx.saved_tensors
        dtype, w = ctx.dtype, weight.to(ctx.dtype)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            h = hidden[part].to(dtype)
            logits = F.linear(h, w).float()
            # d log p(t) / d logits = onehot(t) - softmax, times the incoming gradient
            dlogits = torch.exp(logits - lse[part, None]) * -grad[part, None]
            rows = torch.arange(dlogits.shape[0], device=dlogits.device)
            dlogits[rows, targets[part]] += grad[part]
            dlogits = dlogits.to(dtype)
            grad_hidden[part] = (dlogits @ w).to(hidden.dtype)
            grad_weight += (dlogits.t() @ h).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None
