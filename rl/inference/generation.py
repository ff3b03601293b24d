"""Batched generation over a transformers causal LM, with per-row sampling settings.

The embedded inference engine (rl/inference/server.py) decodes every merged batch with `generate`:
prompts left-padded into one batch, a KV cache, and per-row max_tokens, temperature, top_p,
stop strings and random generator (rows sharing a generator draw from it together, which makes
seeded requests reproducible whatever they are batched with). Kept apart from the server so that
tests and benchmarks can generate without starting one.

Logprobs are always those of the temperature-scaled distribution before top_p cuts it: the
probability the policy assigns, which is what the trainer recomputes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    withdrawn: Callable[[], list[int]] | None = None,
    between: Callable[[], bool] | None = None,
) -> list[Sample]:
    """Decode every prompt in one left-padded batch with a KV cache; per-row limits and RNGs.

    `max_tokens`, `temperature`, `generators` and `limits` are one value for all rows or one per
    row; rows sharing a generator object draw from it together, None uses torch's default
    generator. A row with stop strings ends at the token whose text completes one. `on_step`
    sees every step's tokens as they are drawn. `adapters` names each row's LoRA adapter ("":
    none), and `route(names)` tells the model the names of the rows of each forward pass (rows
    with the same prompt but different adapters do not share a prompt pass). `withdrawn()`,
    asked after every step, names rows whose request was withdrawn (its client went away):
    they end there ("length") and leave the batch before the next forward pass. `between()`,
    asked before every step's forward pass, may run other work on the model meanwhile (the
    batch's state is its own); True when it did, and the rows' adapters are routed again.
    Rows withdrawn meanwhile take that step, and end after it.
    """
    import torch

    rows = Rows.of(model.device, tokenizer, prompts_ids, max_tokens, temperature, generators,
                   limits, adapters)  # fmt: skip
    with torch.inference_mode():
        state = prompt_pass(model, rows, prompts_ids, route)
        while True:
            draw(rows, state)
            record_step(rows, state, on_step)
            ended = withdraw(state, withdrawn)
            if bool(state.done.all()):
                return rows.samples(state)
            leave_finished(rows, state, route, now=ended)
            if between is not None and between() and route is not None:
                route([rows.names[r] for r in state.live.tolist()])  # after the others' passes
            feed_back(model, state)


@dataclass
class Rows:
    """What each row of one `generate` call samples with."""

    caps: torch.Tensor
    """Most tokens per row."""
    temps: torch.Tensor
    top_p: torch.Tensor | None
    """Per-row nucleus, when any row narrows it."""
    wanted_top: list[int]
    """Alternatives asked for per row (`top_logprobs`)."""
    stops: StopStrings
    groups: dict[int, tuple[Any, list[int]]]
    """The rows of each random generator: they draw from it together."""
    names: list[str]
    """Each row's LoRA adapter ("": none)."""
    eos_id: int
    pad_id: int

    @classmethod
    def of(cls, device: Any, tokenizer: Any, prompts_ids: list[list[int]], max_tokens: Any,
           temperature: Any, generators: Any, limits: Any, adapters: Any) -> Rows:  # fmt: skip
        import torch

        count = len(prompts_ids)
        row_limits = [limits] * count if isinstance(limits, Limits) else list(limits)
        top_p = None
        if any(lim.top_p < 1 for lim in row_limits):
            top_p = torch.tensor([lim.top_p for lim in row_limits], device=device)
        groups: dict[int, tuple[Any, list[int]]] = {}
        for row, gen in enumerate(_per_row(generators, count)):
            groups.setdefault(id(gen), (gen, []))[1].append(row)
        eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else -1
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else max(eos_id, 0)
        return cls(
            caps=torch.tensor(_per_row(max_tokens, count), device=device),
            temps=torch.tensor(_per_row(temperature, count), dtype=torch.float32, device=device),
            top_p=top_p,
            wanted_top=[lim.top_logprobs for lim in row_limits],
            stops=StopStrings(tokenizer, [lim.stop for lim in row_limits]),
            groups=groups,
            names=list(adapters) if adapters is not None else [""] * count,
            eos_id=eos_id,
            pad_id=pad_id,
        )

    def samples(self, state: Decoding) -> list[Sample]:
        """Each row's tokens up to where it ended, and how it ended."""
        import torch

        ids = torch.stack(state.steps_ids, 1).tolist()
        logp = torch.stack(state.steps_logp, 1).tolist()
        tops = _alternatives(state.steps_top, self.wanted_top)
        lengths, stopped = state.lengths.tolist(), state.stopped.tolist()
        return [
            Sample(
                ids[r][:n],
                logp[r][:n],
                "stop" if stop else "length",
                tops[r][:n] if tops[r] else None,
            )  # fmt: skip
            for r, (n, stop) in enumerate(zip(lengths, stopped, strict=True))
        ]


@dataclass
class Decoding:
    """A batch as it decodes: the KV cache and the inputs of the next forward pass, each
    row's progress, and every step's tokens so far."""

    cache: Any
    mask: torch.Tensor
    positions: torch.Tensor
    logits: torch.Tensor
    """The last forward pass's next-token logits, one row per row still decoding."""
    live: torch.Tensor
    """The rows still in the batch (finished rows leave it, so a batch whose completions end
    at different lengths stops paying for the done)."""
    lengths: torch.Tensor
    done: torch.Tensor
    stopped: torch.Tensor
    steps_ids: list[torch.Tensor]
    steps_logp: list[torch.Tensor]
    steps_top: list[Any]
    """Per step, the alternatives' logprobs and ids, one row per row of the batch."""
    tokens: torch.Tensor | None = None
    """The newest step's tokens, one per row (pad for finished rows)."""


def prompt_pass(
    model: Any, rows: Rows, prompts_ids: list[list[int]], route: Callable | None
) -> Decoding:
    """The prompts through the model once: rows with the same prompt (a group's n samples) and
    adapter share one prompt pass, whose cache, mask and positions are then gathered per row."""
    import torch
    from transformers import DynamicCache

    count, device = len(prompts_ids), model.device
    distinct: dict[tuple[str, tuple[int, ...]], int] = {}
    pairs = zip(rows.names, prompts_ids, strict=True)
    source = torch.tensor([distinct.setdefault((a, tuple(p)), len(distinct)) for a, p in pairs])
    ids, mask = _left_pad([list(p) for _, p in distinct], rows.pad_id, device)
    if route is not None:
        route([a for a, _ in distinct])
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config)
    logits = _next_logits(model, ids, mask, positions, cache)
    if len(distinct) < count:
        source = source.to(device)
        cache.reorder_cache(source)
        logits, mask, positions = logits[source], mask[source], positions[source]
    if route is not None:
        route(rows.names)
    flags = [torch.zeros(count, dtype=torch.bool, device=device) for _ in range(2)]
    return Decoding(
        cache, mask, positions, logits, torch.arange(count, device=device),
        torch.zeros(count, dtype=torch.long, device=device), *flags, [], [], [],
    )  # fmt: skip


def _next_logits(model: Any, ids: Any, mask: Any, positions: Any, cache: Any) -> torch.Tensor:
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        logits_to_keep=1,  # the prompt pass needs only the last position's logits
    )
    return out.logits[:, -1].float()


def draw(rows: Rows, state: Decoding) -> None:
    """Every live row's next token (and its logprob) from the last forward pass's logits."""
    import torch

    count, device = len(rows.names), state.logits.device
    live, everyone = state.live, len(state.live) == count
    sampled, sampled_logp, dist = _sample(
        state.logits,
        rows.temps[live],
        rows.groups,
        None if rows.top_p is None else rows.top_p[live],
        None if everyone else live,
    )
    tokens = torch.full((count,), rows.pad_id, dtype=torch.long, device=device)
    logp = torch.zeros(count, device=device)
    tokens[live], logp[live] = sampled, sampled_logp
    state.tokens = torch.where(state.done, rows.pad_id, tokens)
    state.steps_ids.append(state.tokens)
    state.steps_logp.append(logp)
    if max(rows.wanted_top):
        top = dist.topk(min(max(rows.wanted_top), dist.shape[1]), dim=-1)
        # One row per row of the batch, as every step's tokens (finished rows' are never read).
        values = torch.zeros((count, top.values.shape[1]), device=device)
        ids = torch.zeros((count, top.values.shape[1]), dtype=torch.long, device=device)
        values[live], ids[live] = top.values, top.indices
        state.steps_top.append((values, ids))


def record_step(rows: Rows, state: Decoding, on_step: StepSink | None) -> None:
    """Count the new tokens, show them to `on_step`, and mark the rows that ended: at EOS, a
    stop string, or their max_tokens."""
    import torch

    tokens, active = state.tokens, ~state.done
    state.lengths += active.long()
    state.stopped |= active & (tokens == rows.eos_id)
    if rows.stops.any or on_step is not None:
        new, alive = tokens.tolist(), active.tolist()
        if on_step is not None:
            on_step(new, state.steps_logp[-1].tolist(), alive)
        if rows.stops.any:
            hit = rows.stops.advance(new, alive)
            state.stopped |= torch.tensor(hit, dtype=torch.bool, device=tokens.device)
    state.done |= state.stopped | (state.lengths >= rows.caps)


def withdraw(state: Decoding, withdrawn: Callable[[], list[int]] | None) -> bool:
    """End the rows `withdrawn()` names now; whether any was still decoding."""
    import torch

    if withdrawn is None or not (ended := withdrawn()):
        return False
    rows = torch.tensor(ended, device=state.done.device)
    decoding = bool((~state.done[rows]).any())
    state.done[rows] = True
    return decoding


def leave_finished(rows: Rows, state: Decoding, route: Callable | None, now: bool) -> None:
    """Drop finished rows from the batch once they are a quarter of it, or `now` (withdrawn
    rows leave at once: nobody waits for them)."""
    finished = state.done[state.live]
    if now or int(finished.sum()) * 4 >= len(state.live):
        keep = (~finished).nonzero().squeeze(1)
        state.cache.reorder_cache(keep)
        state.mask, state.positions = state.mask[keep], state.positions[keep]
        state.live = state.live[keep]
        if route is not None:
            route([rows.names[r] for r in state.live.tolist()])


def feed_back(model: Any, state: Decoding) -> None:
    """The live rows' newest tokens through the model: the next step's logits."""
    import torch

    ids = state.tokens[state.live][:, None]
    state.positions = state.positions[:, -1:] + 1
    state.mask = torch.cat([state.mask, torch.ones_like(ids)], dim=1)
    state.logits = _next_logits(model, ids, state.mask, state.positions, state.cache)


def _alternatives(steps_top: list[Any], wanted: list[int]) -> list[list[Any] | None]:
    """Per row, per step, the row's `wanted` likeliest (id, logprob) pairs (None: not asked)."""
    if not steps_top:
        return [None] * len(wanted)
    import torch

    values = torch.stack([v for v, _ in steps_top], 1).tolist()
    indices = torch.stack([i for _, i in steps_top], 1).tolist()
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
