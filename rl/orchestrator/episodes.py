"""Multi-turn rollouts: the model and the environment take turns, each episode one sample.

Each round sends every open episode's token ids (the prompt, the model's turns and the
environment's replies so far, exactly as sampled and tokenized) in one batch of requests, then
gets the environment's replies (`env.concurrency` at a time). Only the model's tokens carry
loss; the replies are masked (`Episode.add_other`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from rl.core.model import encode_prompt
from rl.core.records import Episode
from rl.core.seeds import derived
from rl.envs import Environment, Example
from rl.orchestrator.scoring import env_map


def run_episodes(
    client: Any,
    env: Environment,
    tokenizer: Any,
    examples: list[Example],
    n: int,
    max_tokens: int,
    temperature: float,
    max_len: int,
    seeds: list[int] | None = None,
) -> list[Episode]:
    """`n` multi-turn episodes per example (example-major) through `client` (an
    rl/inference/client.py InferenceClient). An episode ends when the environment says so,
    after `env.max_turns` model turns, when the context would overflow, or past the
    environment's `max_episode_tokens`. Chat environments (`env.chat`) reply after an
    end-of-turn token: a turn cut at `max_tokens` gets one, masked like the reply. `seeds`,
    one per example, seed each episode's turns (`derived(seed, sample, turn)`)."""
    episodes = [
        Episode(opening(env, tokenizer, e), multi_turn=True) for e in examples for _ in range(n)
    ]
    plays = [e for e in examples for _ in range(n)]
    episode_tokens = max_len if env.max_episode_tokens is None else env.max_episode_tokens
    close = [tokenizer.eos_token_id] if env.chat else []
    open_ = list(range(len(episodes)))
    for turn in range(env.max_turns):
        if not open_:
            break
        prompts = [episodes[k].prompt_ids + episodes[k].completion_ids for k in open_]
        turn_seeds = None
        if seeds is not None:  # episode k is sample k % n of example k // n
            turn_seeds = [derived(seeds[k // n], k % n, turn) for k in open_]
        answers = client.complete_all(prompts, 1, max_tokens, temperature, turn_seeds)
        for k, completion in zip(open_, answers, strict=True):
            episodes[k].add_model_turn(completion)
        replies: list[str | None] = [None] * len(open_)
        if turn < env.max_turns - 1:
            replies = env_map(env, partial(_respond, env), [(plays[k], episodes[k]) for k in open_])
        still = []
        for k, reply in zip(open_, replies, strict=True):
            episode = episodes[k]
            if reply is None:
                continue
            reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
            if close and episode.finish_reason != "stop":
                reply_ids = close + reply_ids
            limit = min(max_len, len(episode.prompt_ids) + episode_tokens)
            used = len(episode.prompt_ids) + len(episode.completion_ids)
            if used + len(reply_ids) + max_tokens > limit:
                continue
            episode.add_other(reply_ids, reply)
            still.append(k)
        open_ = still
    return episodes


def opening(env: Environment, tokenizer: Any, example: Example) -> list[int]:
    """An episode's first prompt as token ids: the environment's own, else BOS + the text."""
    ids = env.prompt_ids(example)
    return encode_prompt(tokenizer, example.prompt) if ids is None else ids


def _respond(env: Environment, play: tuple[Example, Episode]) -> str | None:
    example, episode = play
    return env.respond(example, episode.turns)
