"""The orchestrator: samples prompts, gets completions from inference, scores them, computes
group advantages and pushes scored groups to the rollout queue, within the staleness budget.

Batch N may be generated once inference holds policy version >= N - async_level; the
orchestrator loads the newest published weights into every inference server before each batch
(with inference.weight_transport=broadcast the trainer sends them itself: rl/weights/), and
evaluates held-out prompts at version 0 (after warm-up), every `eval_every` versions and at
the final version.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from rl import wire
from rl.advantages import ADVANTAGES
from rl.config import Placement, TimeoutsConfig
from rl.derive import max_model_len
from rl.envs import Environment, Example, make_environment
from rl.model import encode_prompt, ensure_checkpoint, load_tokenizer
from rl.records import EvalRecord, Group, RolloutRecord, Sample, is_eval
from rl.rundir import RunDir, point_name, shared_service
from rl.runtime import (
    Peer,
    auth_headers,
    inference_names,
    load_run_config,
    read_address,
    role_args,
    run_token,
    setup_logging,
    start_heartbeat,
)
from rl.weights.factory import make_waiter

MAX_FILL_ROUNDS = 4  # sampling rounds to replace zero-advantage groups before keeping them
# The first round draws enough prompts for the groups it expects to drop (at most this many
# times a batch), so that few batches need a further round: each is a sequential decode.
MAX_OVERSAMPLE = 2.0
CHUNKS_PER_REPLICA = 4  # concurrent requests per server: the server merges them into one batch


class InferenceClient:
    """OpenAI-compatible completions plus Relay's admin routes, for one or more servers.

    A server that stops answering is looked up again in the run directory; its requests go to
    the other servers meanwhile (or wait for it, when it is the only one), and once it answers
    again it is given the newest published weights before it serves rollouts.

    A point of a sweep that shares inference finds the servers in the sweep's service
    directory (`service`) and is served there as `adapter`: its requests name it, its weights
    are loaded under it, and a server's version is read for it.
    """

    def __init__(
        self,
        run_dir: Path,
        names: list[str],
        token: str,
        model: str,
        timeouts: TimeoutsConfig | None = None,
        adapter: str = "",
        service: Path | None = None,
    ) -> None:
        self.run_dir, self.adapter = run_dir, adapter
        self.model = adapter or model
        self.addresses = service or run_dir
        timeouts = timeouts or TimeoutsConfig()
        self.peer_s = timeouts.peer_s
        self.servers = [Peer(self.addresses, name, self.peer_s) for name in names]
        self.http = httpx.Client(headers=auth_headers(token), timeout=timeouts.request_s)
        self.version = -1  # what every server should hold
        self.stale = [False] * len(names)  # missed a weight load while down
        self.locks = [threading.Lock() for _ in names]
        self.log = logging.getLogger("orchestrator")
        self.asleep = False  # colocated on GPU: put to sleep while the trainer runs

    def sleep(self) -> None:
        """Free the servers' GPU memory for the trainer (weights offloaded, caches dropped);
        the next `load_weights` wakes them first."""
        for i in range(len(self.servers)):
            self.call(i, "/admin/sleep", {})
        self.asleep = True

    def wake(self) -> None:
        for i in range(len(self.servers)):
            self.call(i, "/admin/wake_up", {})
        self.asleep = False

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    def _post(self, i: int, route: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post(f"{self.servers[i].url}{route}", json=body)
        if response.is_error:  # the server's own words say what it refused, and why
            raise httpx.HTTPStatusError(
                f"{self.servers[i].name} answered {response.status_code} to {route}: "
                f"{response.text[:500]}",
                request=response.request,
                response=response,
            )
        return response.json()

    def _revive(self, i: int) -> bool:
        """Whether server i answers with the current weights (after reloading them)."""
        server = self.servers[i]
        with self.locks[i]:
            server.url = read_address(self.addresses, server.name) or server.url
            try:
                held = self.http.get(
                    f"{server.url}/admin/version", params={"model": self.adapter}, timeout=5.0
                )
                held.raise_for_status()
                if held.json()["policy_version"] < self.version or self.stale[i]:
                    newest = RunDir(self.run_dir).newest_version()
                    path = RunDir(self.run_dir).weights_for(newest)
                    self._post(i, "/admin/load_weights", self._load_body(path, newest))
                    self.log.info("%s is back: loaded version %d into it", server.name, newest)
                self.stale[i] = False
                return True
            except httpx.TransportError:
                return False

    def call(self, i: int, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to server i, or to another one while i is down; waits (bounded) when none
        answers."""
        order = [i, *(j for j in range(len(self.servers)) if j != i)]
        deadline = time.monotonic() + self.peer_s
        while True:
            for j in order:
                try:
                    return self._post(j, route, body)
                except httpx.TransportError as err:
                    self.log.warning("%s unreachable (%r)", self.servers[j].name, err)
                    if self._revive(j):
                        try:
                            return self._post(j, route, body)
                        except httpx.TransportError:
                            pass
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"orchestrator: no inference server answered for {self.peer_s:.0f} s "
                    "(timeouts.peer_s)"
                )
            time.sleep(1.0)

    def complete(
        self,
        i: int,
        prompts: list[Any],
        n: int,
        max_tokens: int,
        temperature: float,
        stop: list[str] | None = None,
    ) -> dict[str, Any]:
        body = {
            "model": self.model,
            "prompt": prompts,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "logprobs": 1,
        }
        if stop:
            body["stop"] = stop
        return self.call(i, "/v1/completions", body)

    def complete_all(
        self, prompts: list[Any], n: int, max_tokens: int, temperature: float
    ) -> list[dict[str, Any]]:
        """Choices for every prompt (texts or token-id lists; prompt-major), spread as
        concurrent requests."""
        chunks = max(1, len(self.servers) * CHUNKS_PER_REPLICA)
        size = max(1, -(-len(prompts) // chunks))
        parts = [prompts[i : i + size] for i in range(0, len(prompts), size)]
        with ThreadPoolExecutor(len(parts)) as pool:
            futures = [
                pool.submit(self.complete, i % len(self.servers), part, n, max_tokens, temperature)
                for i, part in enumerate(parts)
            ]
            responses = [f.result() for f in futures]
        choices = []
        for response in responses:
            for choice in response["choices"]:
                # A request in flight during a weight swap spans two versions (vLLM backend).
                choice["policy_version"] = response["policy_version"]
                choice["policy_version_max"] = response.get(
                    "policy_version_max", response["policy_version"]
                )
                choices.append(choice)
        return choices

    def load_weights(self, path: Path, version: int) -> None:
        """Load `path` into every server that answers (waking them, if asleep); one that is
        down gets the newest weights when it is back."""
        if self.asleep:
            self.wake()
        self.version = version
        for i, server in enumerate(self.servers):
            with self.locks[i]:
                try:
                    self._post(i, "/admin/load_weights", self._load_body(path, version))
                except httpx.TransportError as err:
                    self.log.warning("%s missed version %d (%r)", server.name, version, err)
                    self.stale[i] = True
        if all(self.stale) and not any(self._revive(i) for i in range(len(self.servers))):
            # No server took the weights: wait for one, so that batches keep their version.
            self.call(0, "/admin/load_weights", self._load_body(path, version))
            self.stale[0] = False

    def _load_body(self, path: Path, version: int) -> dict[str, Any]:
        body: dict[str, Any] = {"path": str(path), "version": version}
        if self.adapter:
            body["adapter"] = self.adapter
        return body


def score_group(
    env: Environment,
    advantage: Callable[[list[float]], list[float]],
    example: Example,
    choices: list[dict[str, Any]],
    length_penalty: float = 0.0,
    max_tokens: int = 1,
) -> Group:
    """The completions of one prompt as a queue group: rewards, advantages, versions, and the
    environment's per-episode metrics where it keeps some.

    With a length penalty, each reward loses `length_penalty x tokens / max_tokens` before
    advantages are taken (the logged reward stays the environment's)."""
    completions = [completion(c) for c in choices]
    rewards = env_map(env, lambda c: env.score(example, c), completions)
    extra = [env.metrics(example, c) for c in completions]
    shaped = [
        r - length_penalty * len(c["token_ids"]) / max_tokens
        for r, c in zip(rewards, choices, strict=True)
    ]
    advantages = advantage(shaped)
    versions = [c["policy_version"] for c in choices]
    newest = [c["policy_version_max"] for c in choices]
    samples = [
        Sample(
            prompt_ids=c["prompt_token_ids"],
            completion_ids=c["token_ids"],
            logprobs=c["logprobs"]["token_logprobs"],
            reward=r,
            advantage=a,
            min_version=v,
            max_version=w,
            env_spans=c.get("env_spans") or [],
            env_metrics=x,
        )
        for c, r, a, v, w, x in zip(
            choices, rewards, advantages, versions, newest, extra, strict=True
        )
    ]
    samples += [  # an agent's episode that drifted: its earlier samples, with its reward
        replace(sample, prompt_ids=seg["prompt_token_ids"], completion_ids=seg["token_ids"],
                logprobs=seg["logprobs"]["token_logprobs"], env_spans=seg["env_spans"])
        for c, sample in zip(choices, list(samples), strict=True)
        for seg in c.get("segments", [])
    ]  # fmt: skip
    return Group(samples, min_version=min(versions), max_version=max(newest))


def env_map(env: Environment, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """`fn` over `items`, `env.concurrency` at a time (environments whose rewards or replies
    run programs declare it; others run one at a time)."""
    workers = min(env.concurrency, len(items))
    if workers <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


def completion(choice: dict[str, Any]) -> Any:
    """What the environment scores: the text, or a multi-turn episode's list of model turns."""
    return choice["turns"] if "turns" in choice else choice["text"]


class Episode:
    """One multi-turn episode as one sample: the first prompt, then model turns and the
    environment's replies as one completion; `env_spans` marks the replies (no loss there)."""

    def __init__(self, example: Example, prompt_ids: list[int]) -> None:
        self.example = example
        self.prompt_ids = prompt_ids
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.env_spans: list[list[int]] = []
        self.turns: list[str] = []
        self.text = ""
        self.versions: list[int] = []
        self.finish_reason = "stop"
        self.done = False

    def add_model_turn(self, choice: dict[str, Any]) -> None:
        self.ids += choice["token_ids"]
        self.logprobs += choice["logprobs"]["token_logprobs"]
        self.turns.append(choice["text"])
        self.text += choice["text"]
        self.versions += [choice["policy_version"], choice["policy_version_max"]]
        self.finish_reason = choice.get("finish_reason", "stop")

    def add_env_turn(self, text: str, ids: list[int]) -> None:
        self.env_spans.append([len(self.ids), len(self.ids) + len(ids)])
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.text += text

    def as_choice(self) -> dict[str, Any]:
        """The episode in the shape of a completion choice, for `score_group`."""
        return {
            "prompt_token_ids": self.prompt_ids,
            "token_ids": self.ids,
            "logprobs": {"token_logprobs": self.logprobs},
            "text": self.text,
            "turns": self.turns,
            "env_spans": self.env_spans,
            "policy_version": min(self.versions),
            "policy_version_max": max(self.versions),
            "finish_reason": self.finish_reason,
        }


def run_episodes(
    client: InferenceClient,
    env: Environment,
    tokenizer: Any,
    examples: list[Example],
    n: int,
    max_tokens: int,
    temperature: float,
    max_len: int,
) -> list[dict[str, Any]]:
    """`n` multi-turn episodes per example (example-major), as completion choices. Each round
    sends every open episode's token ids in one batch of requests, then gets the environment's
    replies (`env.concurrency` at a time). An episode ends when the environment says so, after
    `env.max_turns` model turns, when the context would overflow, or past the environment's
    `max_episode_tokens`. Chat environments (`env.chat`) reply after an end-of-turn token: a
    turn cut at `max_tokens` gets one, masked like the reply."""
    episodes = [Episode(e, opening(env, tokenizer, e)) for e in examples for _ in range(n)]
    episode_tokens = max_len if env.max_episode_tokens is None else env.max_episode_tokens
    close = [tokenizer.eos_token_id] if env.chat else []
    for turn in range(env.max_turns):
        active = [e for e in episodes if not e.done]
        if not active:
            break
        prompts = [e.prompt_ids + e.ids for e in active]
        choices = client.complete_all(prompts, 1, max_tokens, temperature)
        for episode, choice in zip(active, choices, strict=True):
            episode.add_model_turn(choice)
        replies: list[str | None] = [None] * len(active)
        if turn < env.max_turns - 1:
            replies = env_map(env, partial(_respond, env), active)
        for episode, choice, reply in zip(active, choices, replies, strict=True):
            if reply is None:
                episode.done = True
                continue
            reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
            if close and choice["finish_reason"] != "stop":
                reply_ids = close + reply_ids
            limit = min(max_len, len(episode.prompt_ids) + episode_tokens)
            if len(episode.prompt_ids) + len(episode.ids) + len(reply_ids) + max_tokens > limit:
                episode.done = True
                continue
            episode.add_env_turn(reply, reply_ids)
    return [e.as_choice() for e in episodes]


def opening(env: Environment, tokenizer: Any, example: Example) -> list[int]:
    """An episode's first prompt as token ids: the environment's own, else BOS + the text."""
    ids = env.prompt_ids(example)
    return encode_prompt(tokenizer, example.prompt) if ids is None else ids


def _respond(env: Environment, episode: Episode) -> str | None:
    return env.respond(episode.example, episode.turns)


def rollout_record(
    step: int,
    choices: list[dict[str, Any]],
    started_at: float,
    gen_s: float,
    load_s: float,
    generated: int,
    surplus: int,
) -> RolloutRecord:
    """Batch `step`'s numbers: when and how long it took, how long the model's answers were,
    how many completions were generated for it in all."""
    lengths = [
        len(c["token_ids"]) - sum(end - begin for begin, end in c.get("env_spans") or [])
        for c in choices
    ]
    truncated = sum(c.get("finish_reason") == "length" for c in choices)
    return RolloutRecord(
        step + 1, gen_s, load_s, lengths, truncated, started_at, generated, surplus
    )


def no_signal(group: Group) -> bool:
    """Whether every advantage of the group is zero (all completions scored the same)."""
    return all(abs(s.advantage) < 1e-9 for s in group.samples)


def last_eval(run_dir: RunDir) -> int:
    """The newest policy version the run has evaluated (-1 when none)."""
    return max((r["step"] for r in run_dir.read_metrics() if is_eval(r)), default=-1)


class Orchestrator:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = RunDir(run_dir)
        self.cfg = cfg = load_run_config(run_dir)
        self.log = setup_logging("orchestrator")
        self.env: Environment = make_environment(cfg.environment)
        token = run_token(run_dir)
        self.queue = Peer(run_dir, "queue", cfg.timeouts.peer_s)
        shared = cfg.inference.shared  # served by the sweep's inference, as this point
        self.inference = InferenceClient(
            run_dir,
            inference_names(cfg),
            token,
            cfg.model.name,
            cfg.timeouts,
            adapter=point_name(Path(run_dir)) if shared else "",
            service=shared_service(Path(run_dir)) if shared else None,
        )
        self.http = httpx.Client(headers=auth_headers(token), timeout=cfg.timeouts.request_s)
        self.version = -1
        self.last_eval = last_eval(self.run_dir)
        self.weights = make_waiter(cfg, run_dir, self.inference, self.log)
        self.colocated_gpu = cfg.placement == Placement.colocated and bool(
            cfg.cluster.gpus_per_node
        )
        self.advantage = ADVANTAGES[str(cfg.algorithm.advantage)]
        self.tokenizer = None
        if self.env.max_turns > 1:  # multi-turn rollouts send token ids
            self.tokenizer = load_tokenizer(ensure_checkpoint(cfg.model, cfg.seed))
            self.env.use_tokenizer(self.tokenizer)  # for environments with a chat template
        self.max_len = max_model_len(cfg)
        self.signal_share: float | None = None  # share of first-round groups with signal

    def rollouts(
        self, examples: list[Example], n: int, temperature: float
    ) -> list[dict[str, Any] | None]:
        """`n` completion choices per example (example-major), single- or multi-turn, or
        played by the environment itself (None: an episode without a model turn)."""
        max_tokens = self.cfg.environment.max_tokens
        own = self.env.rollouts(self.inference, examples, n, temperature, self.max_len)
        if own is not None:
            return own
        if self.tokenizer is None:
            return self.inference.complete_all(
                [e.prompt for e in examples], n, max_tokens, temperature
            )
        return run_episodes(
            self.inference, self.env, self.tokenizer, examples, n, max_tokens, temperature,
            self.max_len,
        )  # fmt: skip

    def wait_for_version(self, minimum: int) -> None:
        """Block until inference holds weights >= minimum (rl/weights/: loaded from
        `weights/step_N` by the orchestrator, or broadcast by the trainer), then evaluate when
        an eval is due."""
        self.version = self.weights.wait(minimum, self.version)
        every = self.cfg.environment.eval_every
        if self.last_eval < 0 or (every and self.version // every > self.last_eval // every):
            self.evaluate()

    def evaluate(self) -> None:
        examples = self.env.eval_examples()
        t0 = time.monotonic()
        choices = self.rollouts(examples, 1, 0.0)
        scored = [(e, completion(c)) for e, c in zip(examples, choices, strict=True) if c]
        rewards = [self.env.score(e, c) for e, c in scored]  # no model turn: 0, not solved
        rewards += [0.0] * (len(examples) - len(scored))
        exact = [self.env.exact_match(e, c) for e, c in scored]
        exact += [False] * (len(examples) - len(scored))
        record = EvalRecord(
            step=self.version,
            exact_match=sum(exact) / len(exact),
            reward_mean=sum(rewards) / len(rewards),
            samples=len(examples),
            time_s=time.monotonic() - t0,
        )
        self.run_dir.append_metrics(record.to_json())
        self.log.info(
            "eval at version %d: exact_match %.3f reward %.3f",
            self.version,
            record.exact_match,
            record.reward_mean,
        )
        self.last_eval = self.version

    def generate(self, step: int) -> None:
        """Generate, score and push batch `step`: prompts_per_step groups with signal."""
        env_cfg, algo = self.cfg.environment, self.cfg.algorithm
        want, n = env_cfg.prompts_per_step, env_cfg.group_size
        # Each batch draws from its own seeded stream: a restarted orchestrator draws the same
        # prompts (how many depends on the share of groups with signal it has seen).
        rng = random.Random(self.cfg.seed * 1_000_003 + step)
        kept: list[tuple[Example, list[dict[str, Any]], Group]] = []
        filtered, surplus, generated, versions = 0, 0, 0, set()
        started_at, t0 = time.time(), time.monotonic()
        pool = self.env.train_examples()
        for round_ in range(1, MAX_FILL_ROUNDS + 1):
            draw = want - len(kept)
            share = 1.0 if self.signal_share is None else self.signal_share
            # Enough that the groups with signal reach the batch's but one standard deviation
            # short of their expected number; not where even the most it may draw would fall
            # short (a task whose rewards rarely differ): more rounds come anyway.
            if algo.filter_zero_advantage and round_ == 1 and share * MAX_OVERSAMPLE >= 1:
                margin = math.sqrt(draw * (1 - share))
                draw = min(math.ceil((draw + margin) / share), int(MAX_OVERSAMPLE * draw))
                draw = min(draw, len(pool))
            examples = rng.sample(pool, draw)
            choices = self.rollouts(examples, n, algo.temperature)
            generated += sum(c is not None for c in choices)
            versions |= {c["policy_version"] for c in choices if c}
            with_signal = 0
            for i, example in enumerate(examples):
                mine = [c for c in choices[i * n : (i + 1) * n] if c]
                if not mine:  # no episode reached the model (agents that failed at once)
                    filtered += 1
                    continue
                group = score_group(
                    self.env, self.advantage, example, mine, algo.length_penalty, env_cfg.max_tokens
                )
                # The last round keeps whatever it gets, so a batch always fills.
                if algo.filter_zero_advantage and round_ < MAX_FILL_ROUNDS and no_signal(group):
                    filtered += 1
                    continue
                with_signal += 1
                if len(kept) == want:  # drawn for groups that turned out to have signal
                    surplus += 1
                    continue
                kept.append((example, mine, group))
            if algo.filter_zero_advantage and round_ == 1:  # the first batch sets it
                seen = with_signal / len(examples)
                old = seen if self.signal_share is None else self.signal_share
                self.signal_share = 0.8 * old + 0.2 * seen
            if len(kept) == want:
                break
        gen_s = time.monotonic() - t0
        if not kept:
            raise RuntimeError(
                f"batch {step}: no episode of {MAX_FILL_ROUNDS} rounds reached the model (every "
                "agent failed before its first request; the warnings above say why)"
            )
        groups = [g for _, _, g in kept]
        groups[0].samples[0].filtered_groups = filtered
        choices = [c for _, mine, _ in kept for c in mine]
        # Recorded before the push, so it precedes the train record of the step it feeds.
        record = rollout_record(
            step, choices, started_at, gen_s, self.weights.load_s, generated, surplus
        )
        self.run_dir.append_metrics(record.to_json())
        self.weights.load_s = 0.0
        self.push(groups, step)
        self.save_rollouts(step, *kept[0])
        if self.colocated_gpu:  # the trainer's turn: it gets the GPU to itself
            self.inference.sleep()
        self.log.info(
            "batch %d generated with version %s in %.2f s (%d groups, %d filtered)",
            step,
            sorted(versions),
            gen_s,
            len(groups),
            filtered,
        )

    def push(self, groups: list[Group], step: int) -> None:
        """Push batch `step` in one request; wait and retry while the queue is full. The queue
        ignores a batch it already holds, so a push retried after a lost answer is stored once."""
        while True:
            response = self.queue.request(
                self.http,
                "POST",
                "/push",
                params={"batch": step},
                content=wire.encode([g.to_dict() for g in groups]),
                headers={"Content-Type": wire.CONTENT_TYPE},
            )
            if response.status_code != 429:
                response.raise_for_status()
                return
            time.sleep(float(response.headers.get("Retry-After", "0.2")))

    def save_rollouts(
        self, step: int, example: Example, choices: list[dict[str, Any]], group: Group
    ) -> None:
        for choice, sample in zip(choices, group.samples, strict=True):
            record = {
                "step": step,
                "version": sample.min_version,
                "prompt": example.prompt,
                "answer": example.answer,
                "completion": choice["text"],
                "reward": sample.reward,
                "advantage": sample.advantage,
            }
            self.run_dir.append_rollout(record)

    def next_batch(self) -> int:
        """The first batch the queue does not hold: where a restarted orchestrator resumes."""
        response = self.queue.request(self.http, "GET", "/stats")
        response.raise_for_status()
        return int(response.json()["next_batch"])

    def run(self) -> None:
        cfg = self.cfg
        first = self.next_batch()
        if first:
            self.log.info("resuming: the queue holds batches 0..%d", first - 1)
        self.wait_for_version(0)
        for step in range(first, cfg.max_steps):
            self.wait_for_version(step - cfg.algorithm.async_level)
            self.generate(step)
        self.wait_for_version(cfg.max_steps)
        if self.last_eval != cfg.max_steps:
            self.evaluate()
        self.log.info("done: %d batches generated", cfg.max_steps)


def main() -> None:
    args = role_args("orchestrator")
    start_heartbeat(args.run_dir, load_run_config(args.run_dir).timeouts.hung_s)
    Orchestrator(args.run_dir).run()


if __name__ == "__main__":
    main()
