"""Sequence packing: several samples per row of a micro-batch, without attention across them.

Samples of a micro-batch are placed into rows as long as the longest sample (first fit, longest
first), each with its own positions from 0 and a block-diagonal causal attention mask, so a row
computes what separate forwards would. The per-token results come back in the padded layout
(one row per sample) that the losses read, so packing changes the cost, not the loss.

The dense mask keeps attention cost per row at (row length)^2, the same bound as padding;
what packing saves is the padded rows' work (the padding-waste benchmark measures it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sample indices per row: first fit, longest first, rows of at most `capacity` tokens."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def padding_waste(lengths: list[int], rows: list[list[int]], width: int) -> float:
    """Share of the computed positions that hold no token."""
    return 1.0 - sum(lengths) / (len(rows) * width)


def packed_logprobs(
    model: Any, sequences: list[list[int]], cp: Any = None, pack: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities and entropies as `rl.trainer.token_logprobs` gives them for
    right-padded rows ([samples, longest], position 0 and padding 0), computed on packed rows
    (or one sample per row with `pack=False`), split over a CP group when `cp` is given."""
    lengths = [len(s) for s in sequences]
    width = max(lengths)
    rows = pack_rows(lengths, width) if pack else [[i] for i in range(len(sequences))]
    device = model.get_input_embeddings().weight.device
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    segment = torch.full((len(rows), width), -1, dtype=torch.long)
    where: list[tuple[int, int]] = [(0, 0)] * len(sequences)  # sample -> (row, offset)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            n = lengths[i]
            ids[r, at : at + n] = torch.tensor(sequences[i])
            positions[r, at : at + n] = torch.arange(n)
            segment[r, at : at + n] = i
            where[i] = (r, at)
            at += n
    ids, positions, segment = ids.to(device), positions.to(device), segment.to(device)
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
    same = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0)
    # Padding rows attend to themselves only, so no softmax row is empty.
    mask = (same & causal) | torch.eye(width, dtype=torch.bool, device=device)
    if cp is None:
        logits = model(input_ids=ids, position_ids=positions, attention_mask=mask[:, None]).logits
        picked, predicting_entropy = next_token_logprobs(logits, next_tokens(ids))
    else:
        picked, predicting_entropy = cp.next_token_logprobs(model, ids, positions, mask)
    logp = torch.zeros((len(sequences), width), device=device)
    entropy = torch.zeros((len(sequences), width), device=device)
    for i, (r, at) in enumerate(where):
        n = lengths[i]
        logp[i, 1:n] = picked[r, at : at + n - 1]
        entropy[i, 1:n] = predicting_entropy[r, at : at + n - 1].detach()
    return logp, entropy


def next_tokens(ids: torch.Tensor) -> torch.Tensor:
    """The token each column predicts: the next column's (0 for the last column)."""
    return F.pad(ids[:, 1:], (0, 1))


def next_token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """For logits [R, W, V]: the log-probability of each column's target [R, W], and the
    entropy of the distribution that predicts it."""
    logp_all = F.log_softmax(logits.float(), dim=-1)
    picked = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return picked, entropy
