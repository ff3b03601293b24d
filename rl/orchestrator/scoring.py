"""Episodes into queue groups: the environment's rewards, length shaping, group advantages,
and the batch's numbers for metrics.jsonl.

Plain Python over `Episode`s (rl/core/records.py), whichever rollout filled them: single-turn
completions, multi-turn episodes, an agent's conversation through its proxy.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rl.core.records import Episode, Group, RolloutRecord, Sample
from rl.envs import Environment, Example

NO_SIGNAL = 1e-9
"""Advantages smaller than this in magnitude count as zero: the group teaches nothing."""


def score_group(
    env: Environment,
    advantage: Callable[[list[float]], list[float]],
    example: Example,
    episodes: list[Episode],
    length_penalty: float = 0.0,
    max_tokens: int = 1,
) -> Group:
    """The episodes of one prompt as a queue group: rewards, advantages, versions, and the
    environment's per-episode metrics where it keeps some.

    With a length penalty, each reward loses `length_penalty x tokens / max_tokens` before
    advantages are taken (the logged reward stays the environment's). An agent's episode that
    drifted trains its earlier samples with its reward and advantage too."""
    rewards = env_map(env, lambda e: env.score(example, e.completion), episodes)
    extra = [env.metrics(example, e.completion) for e in episodes]
    shaped = [
        r - length_penalty * len(e.completion_ids) / max_tokens
        for r, e in zip(rewards, episodes, strict=True)
    ]
    advantages = advantage(shaped)
    scored = list(zip(episodes, rewards, advantages, extra, strict=True))
    samples = [sample(e, r, a, x) for e, r, a, x in scored]  # one per episode, in order
    samples += [sample(part, r, a, x) for e, r, a, x in scored for part in e.earlier]
    low = min(s.min_version for s in samples)
    return Group(samples, min_version=low, max_version=max(s.max_version for s in samples))


def sample(episode: Episode, reward: float, advantage: float, metrics: dict) -> Sample:
    """One episode's tokens as a training sample."""
    return Sample(
        prompt_ids=episode.prompt_ids,
        completion_ids=episode.completion_ids,
        logprobs=episode.logprobs,
        reward=reward,
        advantage=advantage,
        min_version=episode.min_version,
        max_version=episode.max_version,
        env_spans=episode.env_spans,
        env_metrics=metrics,
    )


def env_map(env: Environment, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """`fn` over `items`, `env.concurrency` at a time (environments whose rewards or replies
    run programs declare it; others run one at a time)."""
    workers = min(env.concurrency, len(items))
    if workers <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


def no_signal(group: Group) -> bool:
    """Whether every advantage of the group is zero (all completions scored the same)."""
    return all(abs(s.advantage) < NO_SIGNAL for s in group.samples)


def rollout_record(
    step: int,
    episodes: list[Episode],
    started_at: float,
    gen_s: float,
    load_s: float,
    generated: int,
    surplus: int,
) -> RolloutRecord:
    """Batch `step`'s numbers: when and how long it took, how long the model's answers were,
    how many completions were generated for it in all."""
    lengths = [e.model_tokens for e in episodes]
    truncated = sum(e.finish_reason == "length" for e in episodes)
    return RolloutRecord(
        step + 1, gen_s, load_s, lengths, truncated, started_at, generated, surplus
    )
