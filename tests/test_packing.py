"""Sequence packing: rows hold several samples without attention between them, so the packed
forward gives each sample's per-token log-probabilities and entropies as unpacked rows do."""

from __future__ import annotations

import pytest
import torch

from rl.core.binpack import first_fit_decreasing
from rl.core.model import ensure_checkpoint, load_model
from rl.trainer.batches import pad_batch, token_logprobs
from rl.trainer.packing import packed_logprobs, padding_waste
from tests.support.runs import compose_run


def test_rows_are_filled_longest_first_within_capacity() -> None:
    lengths = [5, 2, 7, 3, 4, 1]
    rows = first_fit_decreasing(lengths, 7)
    assert rows == [[2], [0, 1], [3, 4], [5]]
    assert all(sum(lengths[i] for i in row) <= 7 for row in rows)
    assert sorted(i for row in rows for i in row) == list(range(6))
    assert padding_waste(lengths, rows, 7) == pytest.approx(1 - 22 / 28)
    assert padding_waste(lengths, [[i] for i in range(6)], 7) == pytest.approx(1 - 22 / 42)


@pytest.mark.parametrize("model_option", ["tiny", "smollm2_135m"])
def test_packed_forward_matches_unpacked_rows(model_option: str) -> None:
    # float32 as the presets train it (and one conversion shared with them); the masked and
    # the causal attention kernels sum in another order, hence a float32-rounding tolerance.
    cfg = compose_run(f"model={model_option}", "model.dtype=float32")
    model = load_model(ensure_checkpoint(cfg.model)).eval()
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(4, 40, (n,), generator=gen).tolist() for n in (9, 3, 12, 5, 4, 1)]
    ids, attention, _ = pad_batch(sequences, [1] * len(sequences), pad_id=0)
    with torch.no_grad():
        want_logp, want_entropy = token_logprobs(model, ids, attention)
        got_logp, got_entropy = packed_logprobs(model, sequences)
    real = attention.bool()
    torch.testing.assert_close(got_logp[real], want_logp[real], rtol=0, atol=1e-4)
    torch.testing.assert_close(got_entropy[real], want_entropy[real], rtol=0, atol=1e-4)
    assert (got_logp[~real] == 0).all()


def test_gradients_flow_through_packed_rows() -> None:
    model = load_model(ensure_checkpoint(compose_run().model))
    logp, _ = packed_logprobs(model, [[1, 5, 6, 7], [1, 8, 9]])
    logp.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_shared_prompts_give_each_sample_what_it_gets_alone() -> None:
    # Groups as GRPO makes them: one prompt, several completions of their own lengths (one
    # empty). Each sample's log-probabilities, entropies and gradients must equal its own
    # unpacked row's, while the prompt is computed once per group.
    cfg = compose_run("model.dtype=float32")
    gen = torch.Generator().manual_seed(1)
    draw = lambda n: torch.randint(4, 40, (n,), generator=gen).tolist()  # noqa: E731
    sequences, prompt_lens = [], []
    for prompt_len, tails in ((7, (3, 5, 1, 0)), (4, (6, 2)), (9, (4,))):
        prompt = [1, *draw(prompt_len - 1)]
        for n in tails:
            sequences.append(prompt + draw(n))
            prompt_lens.append(prompt_len)
    ids, attention, completion = pad_batch(sequences, prompt_lens, pad_id=0)
    weights = torch.randn(ids.shape, generator=gen)

    def run(shared: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], int]:
        model = load_model(ensure_checkpoint(cfg.model))
        computed = []
        embed = model.get_input_embeddings()
        embed.register_forward_hook(lambda m, i, o: computed.append(i[0].numel()))
        if shared:
            logp, entropy = packed_logprobs(model, sequences, prompt_lens=prompt_lens)
        else:
            logp, entropy = token_logprobs(model, ids, attention)
        (logp * weights * attention).sum().backward()
        return logp, entropy, [p.grad for p in model.parameters()], computed[0]

    logp, entropy, grads, positions = run(shared=True)
    want_logp, want_entropy, want_grads, padded_positions = run(shared=False)
    real = attention.bool()
    torch.testing.assert_close(logp[real], want_logp[real], rtol=0, atol=1e-4)
    torch.testing.assert_close(entropy[real], want_entropy[real], rtol=0, atol=1e-4)
    assert (logp[~real] == 0).all()
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # rows of 16 (the longest group), one group each: 48 positions for 66 tokens
    assert positions < sum(len(s) for s in sequences) < padded_positions
