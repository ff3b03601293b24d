"""Sequence packing: rows hold several samples without attention between them, so the packed
forward gives each sample's per-token log-probabilities and entropies as unpacked rows do."""

from __future__ import annotations

import pytest
import torch

from rl.model import ensure_checkpoint, load_model
from rl.packing import pack_rows, packed_logprobs, padding_waste
from rl.testing import compose_run
from rl.trainer import pad_batch, token_logprobs


def test_rows_are_filled_longest_first_within_capacity() -> None:
    lengths = [5, 2, 7, 3, 4, 1]
    rows = pack_rows(lengths, 7)
    assert rows == [[2], [0, 1], [4, 3], [5]]
    assert all(sum(lengths[i] for i in row) <= 7 for row in rows)
    assert sorted(i for row in rows for i in row) == list(range(6))
    assert padding_waste(lengths, rows, 7) == pytest.approx(1 - 22 / 28)
    assert padding_waste(lengths, [[i] for i in range(6)], 7) == pytest.approx(1 - 22 / 42)


@pytest.mark.parametrize("model_option", ["tiny", "smollm2_135m"])
def test_packed_forward_matches_unpacked_rows(model_option: str) -> None:
    # float32 as the presets train it (and one conversion shared with them); the masked and
    # the causal attention kernels sum in another order, hence a float32-rounding tolerance.
    cfg = compose_run(f"model={model_option}", "model.dtype=float32")
    model = load_model(ensure_checkpoint(cfg.model, seed=0)).eval()
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
    model = load_model(ensure_checkpoint(compose_run().model, seed=0))
    logp, _ = packed_logprobs(model, [[1, 5, 6, 7], [1, 8, 9]])
    logp.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
