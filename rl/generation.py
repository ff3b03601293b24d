"""Batched generation over a transformers causal LM, with per-row sampling settings.

The embedded inference engine (rl/inference.py) decodes every merged batch with `generate`:
prompts left-padded into one batch, a KV cache, and per-row max_tokens, temperature, top_p,
stop strings and random generator (rows sharing a generator draw from it together, which makes
seeded requests reproducible whatever they are batched with). Kept apart from the server so that
tests and benchmarks can generate without starting one.

Logprobs are always those of the temperature-scaled distribution before top_p cuts it: the
probability the policy assigns, which is what the trainer recomputes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch


class Sample(NamedTuple):
    """One decoded sequence: sampled ids (EOS, or the token completing a stop string, included
    when it stopped there) and their logprobs."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens)
    top: list[list[tuple[int, float]]] | None = None
    """Per position, the `top_logprobs` most likely ids and their logprobs (when asked)."""


class Limits(NamedTuple):
    """Per-row sampling settings beyond temperature: nucleus, stop strings, alternatives."""

    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0


NO_LIMITS = Limits()

StepSink = Callable[[list[int], list[float], list[bool]], None]
"""Called after every decoding step with each row's new token, its logprob, and whether the row
was still decoding (streaming reads it)."""


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


def _nucleus(logp: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`logp` with every token outside each row's nucleus (the fewest most likely tokens whose
    probability reaches top_p) set to -inf."""
    import torch

    sorted_logp, order = logp.sort(dim=-1, descending=True)
    before = sorted_logp.exp().cumsum(-1) - sorted_logp.exp()  # mass of the likelier tokens
    cut = before >= top_p[:, None]
    cut[:, 0] = False  # the likeliest token is always kept
    return logp.scatter(1, order, sorted_logp.masked_fill(cut, -torch.inf))


def _sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    groups: dict[int, tuple[Any, list[int]]],
    top_p: torch.Tensor | None = None,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next tokens and their logprobs under the temperature-scaled softmax (plain at 0), and
    that distribution itself.

    Sampling is Gumbel-max with uniform noise drawn per generator group: each group draws the
    same amount of noise every step, so a seeded request's tokens do not depend on which other
    requests share its batch. Rows with top_p < 1 draw only from their nucleus. `live` maps the
    rows of `logits` to the rows the groups name, when finished rows have left the batch (the
    noise is still drawn for every row).
    """
    import torch

    greedy = temperature == 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)
    total = sum(len(rows) for _, rows in groups.values())
    noise = torch.empty((total, logp.shape[1]), device=logp.device)
    for generator, rows in groups.values():
        shape = (len(rows), logp.shape[1])
        noise[rows] = torch.rand(shape, generator=generator, device=logp.device)
    if live is not None:
        noise = noise[live]
    gumbel = -torch.log(-torch.log(noise.clamp_min(torch.finfo(noise.dtype).tiny)))
    drawn_from = logp if top_p is None else _nucleus(logp, top_p)
    tokens = torch.where(greedy, logp.argmax(-1), (drawn_from + gumbel).argmax(-1))
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1), logp


def generate(
    model: Any,
    tokenizer: Any,
    prompts_ids: list[list[int]],
    max_tokens: int | Sequence[int],
    temperature: float | Sequence[float],
    generators: Sequence[torch.Generator | None] | None = None,
    limits: Limits | Sequence[Limits] = NO_LIMITS,
    on_step: StepSink | None = None,
    adapters: Sequence[str] | None = None,
    route: Callable[[list[str]], None] | None = None,
) -> list[Sample]:
    """Decode every prompt in one left-padded batch with a KV cache; per-row limits and RNGs.

    `max_tokens`, `temperature`, `generators` and `limits` are one value for all rows or one per
    row; rows sharing a generator object draw from it together, None uses torch's default
    generator. A row with stop strings ends at the token whose text completes one. `on_step`
    sees every step's tokens as they are drawn. `adapters` names each row's LoRA adapter ("":
    none), and `route(names)` tells the model the names of the rows of each forward pass (rows
    with the same prompt but different adapters do not share a prompt pass).
    """
    import torch
    from transformers import DynamicCache

    rows, device = len(prompts_ids), model.device
    caps = torch.tensor(_per_row(max_tokens, rows), device=device)
    temps = torch.tensor(_per_row(temperature, rows), dtype=torch.float32, device=device)
    row_limits = [limits] * rows if isinstance(limits, Limits) else list(limits)
    top_p = None
    if any(lim.top_p < 1 for lim in row_limits):
        top_p = torch.tensor([lim.top_p for lim in row_limits], device=device)
    top_k = max(lim.top_logprobs for lim in row_limits)
    stops = StopStrings(tokenizer, [lim.stop for lim in row_limits])
    groups: dict[int, tuple[Any, list[int]]] = {}
    for row, gen in enumerate(_per_row(generators, rows)):
        groups.setdefault(id(gen), (gen, []))[1].append(row)
    eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else -1
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else max(eos_id, 0)
    # Rows with the same prompt (a group's n samples) share one prompt pass: the cache, mask
    # and positions are then gathered per row.
    names = list(adapters) if adapters is not None else [""] * rows
    distinct: dict[tuple[str, tuple[int, ...]], int] = {}
    pairs = zip(names, prompts_ids, strict=True)
    source = torch.tensor([distinct.setdefault((a, tuple(p)), len(distinct)) for a, p in pairs])
    ids, mask = _left_pad([list(p) for _, p in distinct], pad_id, device)
    if route is not None:
        route([a for a, _ in distinct])
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache, steps_ids, steps_logp, steps_top = DynamicCache(config=model.config), [], [], []
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    stopped = torch.zeros(rows, dtype=torch.bool, device=device)
    # The rows still decoding (all of them after the prompt pass): finished rows leave the
    # batch, so a batch whose completions end at different lengths stops paying for the done.
    live = torch.arange(rows, device=device)
    with torch.inference_mode():
        while not bool(done.all()):
            if steps_ids:  # after the prompt pass, feed back only the newest tokens
                ids, positions = steps_ids[-1][live][:, None], positions[:, -1:] + 1
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
            if not steps_ids and route is not None:
                route(names)
            everyone = len(live) == rows
            sampled, sampled_logp, dist = _sample(
                logits,
                temps[live],
                groups,
                None if top_p is None else top_p[live],
                None if everyone else live,
            )
            tokens = torch.full((rows,), pad_id, dtype=torch.long, device=device)
            logp = torch.zeros(rows, device=device)
            tokens[live], logp[live] = sampled, sampled_logp
            tokens = torch.where(done, pad_id, tokens)
            steps_ids.append(tokens)
            steps_logp.append(logp)
            if top_k:
                steps_top.append(dist.topk(min(top_k, dist.shape[1]), dim=-1))
            active = ~done
            lengths += active.long()
            stopped |= active & (tokens == eos_id)
            if stops.any or on_step is not None:
                new, alive = tokens.tolist(), active.tolist()
                if on_step is not None:
                    on_step(new, logp.tolist(), alive)
                if stops.any:
                    hit = stops.advance(new, alive)
                    stopped |= torch.tensor(hit, dtype=torch.bool, device=device)
            done |= stopped | (lengths >= caps)
            finished = done[live]
            # Alternatives are gathered per step for every row, so those batches keep them all.
            if not top_k and int(finished.sum()) * 4 >= len(live) and not bool(finished.all()):
                keep = (~finished).nonzero().squeeze(1)
                cache.reorder_cache(keep)
                mask, positions, live = mask[keep], positions[keep], live[keep]
                if route is not None:
                    route([names[r] for r in live.tolist()])
    all_ids, all_logp = torch.stack(steps_ids, 1).tolist(), torch.stack(steps_logp, 1).tolist()
    tops = _alternatives(steps_top, [lim.top_logprobs for lim in row_limits])
    return [
        Sample(
            all_ids[r][:n],
            all_logp[r][:n],
            "stop" if stop else "length",
            tops[r][:n] if tops[r] else None,
        )
        for r, (n, stop) in enumerate(zip(lengths.tolist(), stopped.tolist(), strict=True))
    ]


def _alternatives(steps_top: list[Any], wanted: list[int]) -> list[list[Any] | None]:
    """Per row, per step, the row's `wanted` likeliest (id, logprob) pairs (None: not asked)."""
    if not steps_top:
        return [None] * len(wanted)
    import torch

    values = torch.stack([t.values for t in steps_top], 1).tolist()
    indices = torch.stack([t.indices for t in steps_top], 1).tolist()
    return [
        [
            list(zip(ids[:k], lps[:k], strict=True))
            for ids, lps in zip(indices[r], values[r], strict=True)
        ]
        if k
        else None
        for r, k in enumerate(wanted)
    ]


class StopStrings:
    """Which rows' generated text has come to contain one of their stop strings. The text is
    decoded from the row's tokens as they arrive; only rows with stop strings are decoded."""

    def __init__(self, tokenizer: Any, per_row: list[tuple[str, ...]]) -> None:
        self.tokenizer, self.per_row = tokenizer, per_row
        self.any = any(per_row)
        self.ids: list[list[int]] = [[] for _ in per_row]

    def advance(self, tokens: list[int], alive: list[bool]) -> list[bool]:
        hits = []
        for row, (token, live, stop) in enumerate(zip(tokens, alive, self.per_row, strict=True)):
            if not (live and stop):
                hits.append(False)
                continue
            self.ids[row].append(token)
            text = self.tokenizer.decode(self.ids[row], skip_special_tokens=True)
            hits.append(any(s in text for s in stop))
        return hits
