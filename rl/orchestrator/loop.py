"""The orchestrator: samples prompts, gets completions from inference, scores them, computes
group advantages and pushes scored groups to the rollout queue, within the staleness budget.

Batch N may be generated once inference holds policy version >= N - async_level; the
orchestrator loads the newest published weights into every inference server before each batch
(with inference.weight_transport=broadcast the trainer sends them itself: rl/weights/), and
evaluates held-out prompts at version 0 (after warm-up), every `eval_every` versions and at
the final version.

Groups without signal (every advantage zero) are dropped and replaced by new prompts, for at
most `MAX_FILL_ROUNDS` rounds; the first round draws for the groups it expects to drop. Groups
with signal that a batch drew beyond its own open the next batch (`algorithm.carry_surplus`),
within the staleness bound: what is generated is trained on, but for the dropped groups.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from rl.core import wire
from rl.core.config import Placement, RunConfig
from rl.core.derive import max_model_len
from rl.core.kinds import is_eval, is_rollout
from rl.core.model import ensure_checkpoint, load_tokenizer
from rl.core.records import Episode, EvalRecord, Group, ScoreBounds
from rl.core.rundir import RunDir, drop_records, point_name, shared_service, write_atomic
from rl.core.runtime import (
    Peer,
    inference_names,
    load_run_config,
    run_auth,
    setup_logging,
)
from rl.core.schedule import carries_surplus, exact_schedule, fresh, generating_version
from rl.core.seeds import prompt_seeds
from rl.envs import Environment, Example, make_environment
from rl.envs.mix import eval_environments
from rl.inference.client import InferenceClient
from rl.orchestrator.advantages import ADVANTAGES, advantage_bound
from rl.orchestrator.episodes import run_episodes
from rl.orchestrator.scoring import no_signal, rollout_record, score_group
from rl.weights.factory import make_waiter

MAX_FILL_ROUNDS = 4  # sampling rounds to replace zero-advantage groups before keeping them
# The first round draws enough prompts for the groups it expects to drop (at most this many
# times a batch), so that few batches need a further round: each is a sequential decode.
MAX_OVERSAMPLE = 2.0
SIGNAL_SHARE_DECAY = 0.8  # weight of the past in the running share of groups with signal


def score_bounds(cfg: RunConfig, reward_range: tuple[float, float], max_len: int) -> ScoreBounds:
    """What this run's samples can hold: the environment's rewards, and the advantages its
    estimator gives them once the length penalty (at most `length_penalty x max_len /
    max_tokens` off a reward) has spread them further."""
    low, high = reward_range
    algo = cfg.algorithm
    shaping = abs(algo.length_penalty) * max_len / cfg.environment.max_tokens
    spread = high - low + shaping
    bound = advantage_bound(str(algo.advantage), spread, cfg.environment.group_size)
    return ScoreBounds((float(low), float(high)), bound)


EVAL_SAMPLES_KEPT = 16
"""Completions of each held-out eval kept for inspection (rollouts/eval_N.jsonl)."""


@dataclass
class Fill:
    """A batch as its rounds fill it: the groups an earlier batch carried into it, the groups
    its own rounds kept (with their prompts and episodes), and what else was generated."""

    carried: list[Group] = field(default_factory=list)
    """Groups with signal an earlier batch drew beyond its own: the batch's first groups."""
    kept: list[tuple[Example, list[Episode], Group]] = field(default_factory=list)
    filtered: int = 0
    """Groups dropped for having no signal (or no episode that reached the model)."""
    surplus: list[Group] = field(default_factory=list)
    """Groups with signal drawn beyond the batch (carried into the next one, with
    `algorithm.carry_surplus`)."""
    generated: int = 0
    """Episodes generated in all rounds."""
    versions: set[int] = field(default_factory=set)
    first_round_signal: float | None = None
    """Share of the first round's groups with signal (with the zero-advantage filter)."""
    generated_none: int = 0
    """Episodes that reached no model turn (an agent that failed or timed out)."""

    @property
    def size(self) -> int:
        return len(self.carried) + len(self.kept)

    @property
    def groups(self) -> list[Group]:
        return self.carried + [group for _, _, group in self.kept]


def last_eval(run_dir: RunDir) -> int:
    """The newest policy version the run has evaluated (-1 when none)."""
    return max((r["step"] for r in run_dir.read_metrics() if is_eval(r)), default=-1)


class Orchestrator:
    """The orchestrator role of one run (module docstring)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = RunDir(run_dir)
        self.cfg = cfg = load_run_config(run_dir)
        self.log = setup_logging("orchestrator")
        self.env: Environment = make_environment(cfg.environment)
        self.eval_envs = eval_environments(list(cfg.eval.environments), cfg.environment)
        auth = run_auth(run_dir)
        self.queue = Peer(run_dir, "queue", cfg.timeouts.peer_s)
        shared = cfg.inference.shared  # served by the sweep's inference, as this point
        self.inference = InferenceClient(
            run_dir,
            inference_names(cfg),
            auth,
            cfg.model.name,
            cfg.timeouts,
            adapter=point_name(Path(run_dir)) if shared else "",
            service=shared_service(Path(run_dir)) if shared else None,
            exact=exact_schedule(cfg),
        )
        self.http = httpx.Client(auth=auth, timeout=cfg.timeouts.request_s)
        self.version = -1
        self.last_eval = last_eval(self.run_dir)
        self.weights = make_waiter(cfg, run_dir, self.inference, self.log)
        self.colocated_gpu = cfg.placement == Placement.colocated and bool(
            cfg.cluster.gpus_per_node
        )
        self.advantage = ADVANTAGES[str(cfg.algorithm.advantage)]
        self.tokenizer = None
        if self.env.max_turns > 1:  # multi-turn rollouts send token ids
            self.tokenizer = load_tokenizer(ensure_checkpoint(cfg.model))
            self.env.use_tokenizer(self.tokenizer)  # for environments with a chat template
        self.max_len = max_model_len(cfg)
        self.run_dir.write_scores(score_bounds(cfg, self.env.reward_range, self.max_len).to_dict())
        self.signal_share: float | None = None  # share of first-round groups with signal
        self.carry: list[Group] = []  # the last batch's surplus groups with signal

    def rollouts(
        self,
        examples: list[Example],
        n: int,
        temperature: float,
        *where: int | str,
        env: Environment | None = None,
    ) -> list[Episode | None]:
        """`n` episodes per example (example-major), single- or multi-turn, or played by the
        environment itself (None: an episode without a model turn). Each example's samples
        are seeded from the run's seed, `where` (e.g. "train", step, round) and its place.
        `env`: the run's own environment, or a single-turn one of `eval.environments`."""
        env = env or self.env
        max_tokens = self.cfg.environment.max_tokens
        own = env.rollouts(self.inference, examples, n, temperature, self.max_len)
        if own is not None:
            return own
        seeds = prompt_seeds(self.cfg.seed, len(examples), *where)
        if env.max_turns == 1:
            prompts = [e.prompt for e in examples]
            done = self.inference.complete_all(prompts, n, max_tokens, temperature, seeds)
            return [Episode.of(c) for c in done]
        return run_episodes(
            self.inference, env, self.tokenizer, examples, n, max_tokens, temperature,
            self.max_len, seeds,
        )  # fmt: skip

    def wait_for_version(self, minimum: int) -> None:
        """Block until inference holds version `minimum` (the fixed schedule; with
        `schedule: newest` the newest, at least `minimum`; rl/weights/: loaded from
        `weights/step_N` by the orchestrator, or broadcast by the trainer), then evaluate when
        an eval is due."""
        self.version = self.weights.wait(minimum, self.version)
        every = self.cfg.environment.eval_every
        if self.last_eval < 0 or (every and self.version // every > self.last_eval // every):
            self.evaluate()

    def evaluate(self) -> None:
        """The held-out prompts, `eval.samples` completions each at `eval.temperature`: exact
        match and reward over every completion, and with several, pass@k over the prompts;
        then each of `eval.environments`' held-out sets, the same way, under its option."""
        t0 = time.monotonic()
        played, rewards, exact, own = self.score_eval(self.env, "eval", self.version)
        self.save_eval_samples(played[:EVAL_SAMPLES_KEPT], rewards, exact)
        others = {option: self.score_eval(env, "eval", option, self.version)[3]
                  for option, env in self.eval_envs}  # fmt: skip
        record = EvalRecord(
            step=self.version,
            exact_match=own["exact_match"],
            reward_mean=own["reward/mean"],
            samples=own["samples"],
            time_s=time.monotonic() - t0,
            k=self.cfg.eval.samples,
            pass_at_k=own.get("pass_at_k"),
            others=others,
        )
        self.run_dir.append_metrics(record.to_json())
        self.log.info(
            "eval at version %d: exact_match %.3f reward %.3f%s",
            self.version,
            record.exact_match,
            record.reward_mean,
            "".join(f", {o} {m['exact_match']:.3f}" for o, m in others.items()),
        )
        self.last_eval = self.version

    def score_eval(
        self, env: Environment, *where: int | str
    ) -> tuple[list[tuple[Example, Episode | None]], list[float], list[bool], dict[str, float]]:
        """`env`'s held-out prompts played `eval.samples` times each: the (prompt, episode)
        pairs, each completion's reward and exact match, and the summary (exact match and mean
        reward over the completions, prompts scored, and with several samples pass@k)."""
        examples = env.eval_examples()
        k, temperature = self.cfg.eval.samples, self.cfg.eval.temperature
        episodes = self.rollouts(examples, k, temperature, *where, env=env)
        plays = [e for e in examples for _ in range(k)]
        # An episode without a model turn scores 0 and solves nothing.
        played = list(zip(plays, episodes, strict=True))
        rewards = [env.score(e, p.completion) if p else 0.0 for e, p in played]
        exact = [bool(p) and env.exact_match(e, p.completion) for e, p in played]
        solved = [any(exact[i * k : (i + 1) * k]) for i in range(len(examples))]
        summary = {
            "exact_match": sum(exact) / len(exact),
            "reward/mean": sum(rewards) / len(rewards),
            "samples": len(examples),
        }
        if k > 1:
            summary["pass_at_k"] = sum(solved) / len(solved)
        return played, rewards, exact, summary

    def save_eval_samples(
        self, played: list[tuple[Example, Episode | None]], rewards: list[float], exact: list[bool]
    ) -> None:
        """The eval's first completions with their scores (`rollouts/eval_N.jsonl`)."""
        rows = [
            {"version": self.version, "prompt": e.prompt, "answer": e.answer,
             "completion": p.text if p else "", "reward": r, "exact": x}
            for (e, p), r, x in zip(played, rewards, exact, strict=False)
        ]  # fmt: skip
        path = self.run_dir.eval_samples(self.version)
        path.parent.mkdir(exist_ok=True)
        write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))

    def generate(self, step: int) -> None:
        """Generate, score and push batch `step`: prompts_per_step groups with signal."""
        started_at, t0 = time.time(), time.monotonic()
        fill = self.fill(step)
        gen_s = time.monotonic() - t0
        groups = fill.groups
        if not groups:
            raise RuntimeError(
                f"batch {step}: no episode of {MAX_FILL_ROUNDS} rounds reached the model (every "
                "agent failed before its first request; the warnings above say why)"
            )
        groups[0].samples[0].filtered_groups = fill.filtered
        episodes = [e for _, mine, _ in fill.kept for e in mine]
        # Recorded before the push, so it precedes the train record of the step it feeds.
        record = rollout_record(
            step, episodes, started_at, gen_s, self.weights.load_s, fill.generated,
            len(fill.surplus),
        )  # fmt: skip
        record.first_round_signal = fill.first_round_signal
        record.carried_groups = len(fill.carried)
        self.run_dir.append_metrics(record.to_json())
        self.weights.load_s = 0.0
        self.keep_surplus(step, fill.surplus)  # before the push: a resume at step + 1 reads it
        self.push(groups, step)
        if fill.kept:
            self.save_rollouts(step, *fill.kept[0])
        if self.colocated_gpu:  # the trainer's turn: it gets the GPU to itself
            self.inference.sleep()
        self.log.info(
            "batch %d generated with version %s in %.2f s (%d groups, %d carried in, %d "
            "filtered, %d carried on)", step, sorted(fill.versions), gen_s, len(groups),
            len(fill.carried), fill.filtered, len(fill.surplus),
        )  # fmt: skip

    def fill(self, step: int) -> Fill:
        """Batch `step`'s groups: those the last batch carried into it, then round by round
        until it holds prompts_per_step groups with signal (the last round keeps whatever it
        gets, so a batch always fills)."""
        want = self.cfg.environment.prompts_per_step
        # Each batch draws from its own seeded stream: a restarted orchestrator draws the same
        # prompts (how many depends on the share of groups with signal it has seen, and on
        # the groups carried in, which it reads back).
        rng = random.Random(self.cfg.seed * 1_000_003 + step)
        pool = self.env.train_examples()
        fill = Fill(carried=self.carried_into(step)[:want])
        for round_ in range(1, MAX_FILL_ROUNDS + 1):
            missing = want - fill.size
            if not missing:
                break
            examples = rng.sample(pool, self.draw(missing, round_, len(pool)))
            last = round_ == MAX_FILL_ROUNDS
            self.say_progress(step, round_, fill, want, len(examples))
            with_signal = self.fill_round(fill, examples, want, last, "train", step, round_)
            if self.cfg.algorithm.filter_zero_advantage and round_ == 1:  # the first sets it
                fill.first_round_signal = with_signal / len(examples)
                self.learn_signal_share(fill.first_round_signal)
        return fill

    def say_progress(self, step: int, round_: int, fill: Fill, want: int, prompts: int) -> None:
        """Where batch `step` stands as a fill round starts (rundir `generating`): what the
        console says when no step has ended for a while."""
        progress = {
            "batch": step, "round": round_, "with_signal": fill.size, "want": want,
            "tied": fill.filtered, "episodes": prompts * self.cfg.environment.group_size,
            "failed": fill.generated_none, "since": time.time(),
        }  # fmt: skip
        self.run_dir.generating.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.run_dir.generating, json.dumps(progress))

    def carried_into(self, step: int) -> list[Group]:
        """The last batch's surplus groups that batch `step` may still train on: the queue
        would drop a group more than max_off_policy_steps behind it."""
        kept = [g for g in self.carry if fresh(self.cfg, step, g.min_version)]
        if len(kept) < len(self.carry):
            self.log.info("batch %d: %d carried groups too stale, dropped",
                          step, len(self.carry) - len(kept))  # fmt: skip
        self.carry = []
        return kept

    def keep_surplus(self, step: int, surplus: list[Group]) -> None:
        """Carry batch `step`'s surplus groups into the next batch (`algorithm.carry_surplus`),
        on disk too: a restarted orchestrator resuming at step + 1 reads them back."""
        if not carries_surplus(self.cfg):
            return
        self.carry = surplus
        path = self.run_dir.carried(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps([g.to_dict() for g in surplus]))
        self.run_dir.carried(step - 2).unlink(missing_ok=True)  # step - 1's: a resume at step

    def read_carried(self, step: int) -> list[Group]:
        """What batch `step` carried into the next (none where it kept no file)."""
        try:
            raw = json.loads(self.run_dir.carried(step).read_text())
        except FileNotFoundError:
            return []
        return [Group.parse(g, f"carried after batch {step}") for g in raw]

    def draw(self, missing: int, round_: int, available: int) -> int:
        """Prompts to draw for `missing` groups. The first round draws enough that the groups
        with signal reach the batch's but one standard deviation short of their expected
        number; not where even the most it may draw would fall short (a task whose rewards
        rarely differ): more rounds come anyway."""
        share = 1.0 if self.signal_share is None else self.signal_share
        if not (self.cfg.algorithm.filter_zero_advantage and round_ == 1):
            return missing
        if share * MAX_OVERSAMPLE < 1:
            return missing
        margin = math.sqrt(missing * (1 - share))
        draw = min(math.ceil((missing + margin) / share), int(MAX_OVERSAMPLE * missing))
        return min(draw, available)

    def learn_signal_share(self, seen: float) -> None:
        """Fold a batch's first-round share of groups with signal into the running share."""
        old = seen if self.signal_share is None else self.signal_share
        self.signal_share = SIGNAL_SHARE_DECAY * old + (1 - SIGNAL_SHARE_DECAY) * seen

    def fill_round(
        self, fill: Fill, examples: list[Example], want: int, last: bool, *where: int | str
    ) -> int:
        """One round's rollouts scored into `fill`; returns how many groups had signal."""
        env_cfg, algo = self.cfg.environment, self.cfg.algorithm
        n = env_cfg.group_size
        episodes = self.rollouts(examples, n, algo.temperature, *where)
        fill.generated += sum(e is not None for e in episodes)
        fill.generated_none += sum(e is None for e in episodes)
        fill.versions |= {e.min_version for e in episodes if e}
        with_signal = 0
        for i, example in enumerate(examples):
            mine = [e for e in episodes[i * n : (i + 1) * n] if e]
            if not mine:  # no episode reached the model (agents that failed at once)
                fill.filtered += 1
                continue
            group = score_group(
                self.env, self.advantage, example, mine, algo.length_penalty, env_cfg.max_tokens
            )
            if algo.filter_zero_advantage and not last and no_signal(group):
                fill.filtered += 1
                continue
            with_signal += 1
            if fill.size == want:  # drawn for groups that turned out to have signal
                fill.surplus.append(group)
                continue
            fill.kept.append((example, mine, group))
        return with_signal

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
            time.sleep(float(response.headers.get("Retry-After", wire.RETRY_AFTER_S)))

    def save_rollouts(
        self, step: int, example: Example, episodes: list[Episode], group: Group
    ) -> None:
        """The batch's first group, for inspection (`rollouts/samples.jsonl`)."""
        for episode, sample in zip(episodes, group.samples, strict=False):
            record = {
                "step": step,
                "version": sample.min_version,
                "prompt": example.prompt,
                "answer": example.answer,
                "completion": episode.text,
                "reward": sample.reward,
                "advantage": sample.advantage,
            }
            self.run_dir.append_rollout(record)

    def next_batch(self) -> int:
        """The first batch the queue does not hold: where a restarted orchestrator resumes."""
        response = self.queue.request(self.http, "GET", "/stats")
        response.raise_for_status()
        return int(response.json()["next_batch"])

    def resume(self) -> int:
        """The first batch the queue does not hold, with what generating the batches before it
        taught (the running share of groups with signal, from their rollout records); records
        of batches it holds no longer (generated, not pushed) are dropped."""
        first = self.next_batch()
        if not first:
            return 0
        self.log.info("resuming: the queue holds batches 0..%d", first - 1)
        dropped = drop_records(self.run_dir.metrics, lambda r: is_rollout(r) and r["step"] > first)
        if dropped:
            self.log.info("dropped the rollout records of %d batches not pushed", dropped)
        records = sorted((r for r in self.run_dir.read_metrics() if is_rollout(r)),
                         key=lambda r: r["step"])  # fmt: skip
        for record in records:
            if "filter/first_round_signal" in record:
                self.learn_signal_share(record["filter/first_round_signal"])
        if carries_surplus(self.cfg):
            self.carry = self.read_carried(first - 1)
        return first

    def run(self) -> None:
        cfg = self.cfg
        first = self.resume()
        for step in range(first, cfg.max_steps):
            self.wait_for_version(generating_version(cfg, step))
            if not fresh(cfg, step, self.version):  # later versions refused
                raise RuntimeError(
                    f"batch {step}: inference still serves version {self.version}, having refused "
                    "every later one (the warnings above say why); the queue drops a batch more "
                    f"than algorithm.max_off_policy_steps={cfg.algorithm.max_off_policy_steps} "
                    "behind, so nothing generated now could be trained"
                )
            self.generate(step)
        self.wait_for_version(cfg.max_steps)
        if self.last_eval != cfg.max_steps:
            self.evaluate()
        self.log.info("done: %d batches generated", cfg.max_steps)
