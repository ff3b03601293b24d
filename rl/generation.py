"""Batched generation over a transformers causal LM, with per-row sampling settings.

The embedded inference engine (rl/inference.py) decodes every merged batch with `generate`:
prompts left-padded into one batch, a KV cache, and per-row max_tokens, temperature and random
generator (rows sharing a generator draw from it together, which makes seeded requests
reproducible whatever they are batched with). Kept apart from the server so that tests and
benchmarks can generate without starting one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch


class Sample(NamedTuple):
    """One decoded sequence: sampled ids (EOS included when it stopped there) and their logprobs."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS) or "length" (max_tokens)


def _per_row(value: Any, rows: int) -> list[Any]:
    return list(value) if isinstance(value, Sequence) else [value] * rows


def _left_pad(prompts_ids: list[list[int]], pad_id: int, device: Any) -> tuple[Any, Any]:
    """Ids and attention mask with prompts right-aligned, so every row's next token is last."""
    import torch

    lengths = torch.tensor([len(p) for p in prompts_ids])
    mask = torch.arange(int(lengths.max())) >= (lengths.max() - lengths)[:, None]
    ids = torch.full(mask.shape, pad_id, dtype=torch.long)
    ids[mask] = torch.tensor([t for p in prompts_ids for t in p], dtype=torch.long)
    return ids.to(device), mask.long().to(device)


def _sample(
    logits: torch.Tensor, temperature: torch.Tensor, groups: dict[int, tuple[Any, list[int]]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens and their logprobs under the temperature-scaled softmax (plain at 0).

    Sampling is Gumbel-max with uniform noise drawn per generator group: each group draws the
    same amount of noise every step, so a seeded request's tokens do not depend on which other
    requests share its batch.
    """
    import torch

    greedy = temperature == 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)
    noise = torch.empty_like(logp)
    for generator, rows in groups.values():
        shape = (len(rows), logp.shape[1])
        noise[rows] = torch.rand(shape, generator=generator, device=logp.device)
    gumbel = -torch.log(-torch.log(noise.clamp_min(torch.finfo(noise.dtype).tiny)))
    tokens = torch.where(greedy, logp.argmax(-1), (logp + gumbel).argmax(-1))
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def generate(
    model: Any,
    tokenizer: Any,
    prompts_ids: list[list[int]],
    max_tokens: int | Sequence[int],
    temperature: float | Sequence[float],
    generators: Sequence[torch.Generator | None] | None = None,
) -> list[Sample]:
    """Decode every prompt in one left-padded batch with a KV cache; per-row limits and RNGs.

    `max_tokens`, `temperature` and `generators` are one value for all rows or one per row; rows
    sharing a generator object draw from it together, None uses torch's default generator.
    """
    import torch
    from transformers import DynamicCache

    rows, device = len(prompts_ids), model.device
    limits = torch.tensor(_per_row(max_tokens, rows), device=device)
    temps = torch.tensor(_per_row(temperature, rows), dtype=torch.float32, device=device)
    groups: dict[int, tuple[Any, list[int]]] = {}
    for row, gen in enumerate(_per_row(generators, rows)):
        groups.setdefault(id(gen), (gen, []))[1].append(row)
    eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else -1
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else max(eos_id, 0)
    # Rows with the same prompt (a group's n samples) share one prompt pass: the cache, mask
    # and positions are then gathered per row.
    distinct: dict[tuple[int, ...], int] = {}
    source = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompts_ids])
    ids, mask = _left_pad([list(p) for p in distinct], pad_id, device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache, steps_ids, steps_logp = DynamicCache(config=model.config), [], []
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    stopped = torch.zeros(rows, dtype=torch.bool, device=device)
    with torch.inference_mode():
        while not bool(done.all()):
            if steps_ids:  # after the prompt pass, feed back only the newest tokens
                ids, positions = steps_ids[-1][:, None], positions[:, -1:] + 1
                mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                logits_to_keep=1,  # the prompt pass needs only the last position's logits
            )
            logits = out.logits[:, -1].float()
            if not steps_ids and len(distinct) < rows:
                source = source.to(device)
                cache.reorder_cache(source)
                logits, mask, positions = logits[source], mask[source], positions[source]
            tokens, logp = _sample(logits, temps, groups)
            tokens = torch.where(done, pad_id, tokens)
            steps_ids.append(tokens)
            steps_logp.append(logp)
            lengths += (~done).long()
            stopped |= ~done & (tokens == eos_id)
            done |= stopped | (lengths >= limits)
    all_ids, all_logp = torch.stack(steps_ids, 1).tolist(), torch.stack(steps_logp, 1).tolist()
    return [
        Sample(all_ids[r][:n], all_logp[r][:n], "stop" if stop else "length")
        for r, (n, stop) in enumerate(zip(lengths.tolist(), stopped.tolist(), strict=True))
    ]
