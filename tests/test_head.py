"""The LM head in chunks (rl/trainer/head.py) against the whole logits: the same
log-probabilities, entropies and gradients, in float32 and under bfloat16 autocast, for chunks
that do not divide the positions; and the model-level path through a real transformers model,
its tied embedding included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rl.core.model import ensure_checkpoint, load_model
from rl.trainer import head
from tests.support import parallel
from tests.support.runs import compose_run

cache = parallel.cache  # the module's model cache (a fixture)


def whole(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> tuple:
    logp_all = F.log_softmax(F.linear(hidden, weight).float(), dim=-1)
    picked = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    return picked, -(logp_all.exp() * logp_all).sum(-1)


def inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 16, generator=gen, dtype=dtype).requires_grad_()
    weight = (torch.randn(50, 16, generator=gen, dtype=dtype) * 0.3).requires_grad_()
    return hidden, weight, torch.randint(50, (23,), generator=gen)


@pytest.mark.parametrize("chunk", [1, 5, 23, 64])
def test_chunks_give_the_whole_logits_results_in_float32(chunk: int) -> None:
    hidden, weight, targets = inputs()
    want_logp, want_entropy = whole(hidden, weight, targets)
    grads = torch.autograd.grad((want_logp * torch.arange(23.0)).sum(), (hidden, weight))
    logp, entropy = head.ChunkedLogprobs.apply(hidden, weight, targets, chunk)
    got = torch.autograd.grad((logp * torch.arange(23.0)).sum(), (hidden, weight))
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-5)
    for g, w in zip(got, grads, strict=True):  # summed in another order: float32 rounding
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6 * w.abs().max().item())


def test_under_bfloat16_autocast_the_matmuls_run_in_bfloat16() -> None:
    """Float32 weights and inputs under autocast: the chunks' logits come from bfloat16
    matmuls, as the whole head's do, and the gradients reach the float32 tensors."""
    hidden, weight, targets = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_logp, _ = whole(hidden, weight, targets)
        logp, _ = head.ChunkedLogprobs.apply(hidden, weight, targets, 4)
    want = torch.autograd.grad(want_logp.sum(), (hidden, weight))
    got = torch.autograd.grad(logp.sum(), (hidden, weight))
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-6)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        # The whole head's gradient is a bfloat16 matmul's; the chunks sum theirs in float32.
        torch.testing.assert_close(g, w, rtol=0, atol=0.02 * w.abs().max().item())


def test_a_models_head_in_chunks_gives_its_logprobs(cache: object) -> None:
    """Through a real (tied-embedding) model's forward: the pairs asked for, as the whole
    logits give them, and a gradient on the embedding the head shares."""
    cfg = compose_run("model=tiny")
    model = load_model(ensure_checkpoint(cfg.model))
    ids = torch.tensor([[1, 5, 6, 7, 8], [1, 9, 10, 11, 12]])
    rows, cols = torch.tensor([0, 0, 1, 1]), torch.tensor([1, 3, 0, 2])
    targets = ids[rows, cols + 1]
    logits = model(input_ids=ids).logits.float()
    want = F.log_softmax(logits, -1)[rows, cols, targets]
    head.enable(model, 3)
    got, entropy = head.pair_logprobs(model, rows, cols, targets, input_ids=ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not entropy.requires_grad and (entropy > 0).all()
    got.sum().backward()
    assert model.get_input_embeddings().weight.grad.abs().sum() > 0
    plain = model(input_ids=ids).logits  # nothing asked: the head computes logits as before
    torch.testing.assert_close(plain.float(), logits, rtol=0, atol=0)
