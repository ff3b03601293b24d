"""Sequence packing: several samples per row of a micro-batch, without attention across them.

Samples of a micro-batch are placed into rows as long as the longest sample (first fit, longest
first: rl/core/binpack.py), each with its own positions from 0 and a block-diagonal causal attention
mask, so a row computes what separate forwards would. The per-token results come back in the padded
layout (one row per sample) that the losses read, so packing changes the cost, not the loss.

The dense mask keeps attention cost per row at (row length)^2, the same bound as padding;
what packing saves is the padded rows' work (the padding-waste benchmark measures it). A
micro-batch whose rows each hold one sample (a sample longer than the budget is alone in its
micro-batch) needs no mask: plain causal attention, whose kernels keep memory linear in the
row's length, so that a long sample costs no (length)^2 mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rl.core.binpack import first_fit_decreasing
from rl.trainer import head


def padding_waste(lengths: list[int], rows: list[list[int]], width: int) -> float:
    """Share of the computed positions that hold no token."""
    return 1.0 - sum(lengths) / (len(rows) * width)


@dataclass
class Unit:
    """What a packed row holds for one or more samples: a prefix computed once, then each
    member's tail, each tail attending to the prefix and to itself only."""

    prefix: list[int]
    members: list[tuple[int, list[int]]]  # (sample index, its tokens after the prefix)

    def __len__(self) -> int:
        return len(self.prefix) + sum(len(tail) for _, tail in self.members)


def units(sequences: list[list[int]], prompt_lens: list[int] | None) -> list[Unit]:
    """One unit per sample, or with `prompt_lens` one per distinct prompt: the samples that share
    it (a GRPO group) get one copy of it."""
    if prompt_lens is None:
        return [Unit(list(s), [(i, [])]) for i, s in enumerate(sequences)]
    by_prompt: dict[tuple[int, ...], Unit] = {}
    for i, (s, n) in enumerate(zip(sequences, prompt_lens, strict=True)):
        n = min(n, len(s))
        unit = by_prompt.setdefault(tuple(s[:n]), Unit(list(s[:n]), []))
        unit.members.append((i, list(s[n:])))
    return list(by_prompt.values())


def packed_logprobs(
    model: Any,
    sequences: list[list[int]],
    cp: Any = None,
    pack: bool = True,
    prompt_lens: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities and entropies as `rl.trainer.batches.token_logprobs` gives
    them for right-padded rows ([samples, longest], position 0 and padding 0), computed on packed
    rows (or one sample per row with `pack=False`), split over a CP group when `cp` is given.

    With `prompt_lens` (and packing, without CP), samples with the same prompt share one copy of
    it: the prompt is computed once per group instead of once per sample, and each completion
    attends to it and to itself, with the positions it would have alone."""
    share = prompt_lens is not None and pack and cp is None
    groups = units(sequences, prompt_lens if share else None)
    sizes = [len(u) for u in groups]
    width = max(sizes)
    rows = first_fit_decreasing(sizes, width) if pack else [[u] for u in range(len(groups))]
    device = model.get_input_embeddings().weight.device
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    segment = torch.full((len(rows), width), -1, dtype=torch.long)
    branch = torch.full((len(rows), width), -1, dtype=torch.long)  # -1: a shared prefix
    # For every predicted token, flat over samples: the row and column predicting it, the
    # token, and where it goes in the padded [samples, longest] result.
    at_row: list[int] = []
    at_col: list[int] = []
    target: list[int] = []
    dest: list[int] = []
    longest = max(len(s) for s in sequences)
    for r, members in enumerate(rows):
        col = 0
        for u in members:
            unit = groups[u]
            p = len(unit.prefix)
            ids[r, col : col + p] = torch.tensor(unit.prefix)
            positions[r, col : col + p] = torch.arange(p)
            segment[r, col : col + len(unit)] = u
            tail_col = col + p
            for i, tail in unit.members:
                n = len(tail)
                ids[r, tail_col : tail_col + n] = torch.tensor(tail, dtype=torch.long)
                positions[r, tail_col : tail_col + n] = torch.arange(p, p + n)
                branch[r, tail_col : tail_col + n] = i
                # token t (1 <= t < p + n) is predicted where token t - 1 sits
                predictors = [*range(col, col + p), *range(tail_col, tail_col + n)][: p + n - 1]
                at_row.extend([r] * len(predictors))
                at_col.extend(predictors)
                target.extend([*unit.prefix[1:], *tail])
                dest.extend(range(i * longest + 1, i * longest + p + n))
                tail_col += n
            col += len(unit)
    ids, positions, segment, branch = (t.to(device) for t in (ids, positions, segment, branch))
    index = [torch.tensor(x, dtype=torch.long, device=device) for x in (at_row, at_col, target)]
    mask = None
    if not causal_rows(model, rows, groups):
        causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
        same = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0)
        visible = (branch[:, None, :] == -1) | (branch[:, :, None] == branch[:, None, :])
        # Padding columns attend to themselves only, so no softmax row is empty.
        mask = (same & visible & causal) | torch.eye(width, dtype=torch.bool, device=device)
    if cp is not None:  # unshared rows: each column's target is the next column's token
        whole, whole_entropy = cp.next_token_logprobs(model, ids, positions, mask)
        picked = whole[index[0], index[1]]
        entropy = whole_entropy[index[0], index[1]].detach()
    elif mask is None:  # one sample a row: plain causal attention, no mask of width^2
        picked, entropy = forward_logprobs(model, index, input_ids=ids)
    else:
        inputs = {"input_ids": ids, "position_ids": positions, "attention_mask": mask[:, None]}
        picked, entropy = forward_logprobs(model, index, **inputs)
    flat = torch.tensor(dest, dtype=torch.long, device=device)
    size = len(sequences) * longest
    logp = torch.zeros(size, device=device).index_put((flat,), picked)
    entropies = torch.zeros(size, device=device).index_put((flat,), entropy)
    return logp.view(len(sequences), longest), entropies.view(len(sequences), longest)


def causal_rows(model: Any, rows: list[list[int]], groups: list[Unit]) -> bool:
    """Whether every row holds one sample alone, so that attention within it is plain causal
    attention (a long sample, alone in its micro-batch) and needs no mask: kernels then keep
    attention's memory linear in the row's length. Not for DeepSeek sparse attention, whose
    indexer reads the mask (transformers' implementation)."""
    if getattr(model.config, "index_topk", None):
        return False
    return all(len(members) == 1 and len(groups[members[0]].members) == 1 for members in rows)


def forward_logprobs(
    model: Any, index: list[torch.Tensor], **inputs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probability of each target `index[2]` at (row, column) `index[0:2]` of the
    model's forward over `inputs`, and the entropy there (no gradient): through the chunked
    LM head where it is on, else from the whole logits."""
    if head.enabled(model):
        picked, entropy = head.pair_logprobs(model, *index, **inputs)
        return picked, entropy.detach()
    logits = model(**inputs).logits
    logp_all = F.log_softmax(logits.float(), dim=-1)
    picked = logp_all[index[0], index[1], index[2]]
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)[index[0], index[1]]
    return picked, entropy


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
