"""What crosses a process boundary, as typed records.

- `Sample` and `Group` (an RL group: the completions of one prompt) go from the orchestrator to
  the rollout queue, stored, and on to the trainer; `BatchShard` is one trainer rank's share of
  a step's batch. On the wire they travel in rl/core/wire.py's binary format or as JSON; `parse`
  turns what arrived into these types or raises `RecordError` naming the first bad field.
  Both formats get the same checks (numpy arrays from the binary format, vectorised): token
  ids in 0..2**31-1 (int32, not negative; the vocabulary size is the model's business),
  finite logprobs, a non-empty prompt and completion, and versions in 0..2**63-1 (they are
  stored as SQLite integers) with min <= max and every sample's inside its group's.
- `Completion` is one choice an inference server sampled (rl/inference/client.py reads it off
  the OpenAI API); `Episode` is a rollout's tokens as one sample: the prompt, the model's turns
  and what came between them. The orchestrator's rollouts and the agents' proxy fill episodes,
  and scoring turns them into a `Group`.
- `TrainRecord`, `EvalRecord`, `RolloutRecord` and `WarmupRecord` are the lines of
  metrics.jsonl. Every line carries `kind` (`train`, `eval`, `rollout` or `warmup`), which is
  how readers tell them apart (rl/core/kinds.py); a reader skips kinds it does not show.

Torch-free, and numpy only for the arrays a decoded message holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rl.core.kinds import RecordKind

INT32_MAX = 2**31 - 1
"""Largest token id: ids travel as int32 (rl/core/wire.py)."""
INT64_MAX = 2**63 - 1
"""Largest version or batch number: the queue stores them as SQLite (signed 64-bit) integers."""
ARRAY_KEYS = ("prompt_ids", "completion_ids", "logprobs")


class RecordError(ValueError):
    """A record that does not validate; the text names the field."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _valid_spans(spans: Any, length: int) -> bool:
    """Whether `spans` are ordered, disjoint [begin, end) pairs within 0..length."""
    if not isinstance(spans, list):
        return False
    at = 0
    for span in spans:
        if not (isinstance(span, list) and len(span) == 2 and all(map(_is_int, span))):
            return False
        if not at <= span[0] < span[1] <= length:
            return False
        at = span[1]
    return True


def _valid_ids(ids: Any) -> bool:
    """Whether every token id is an integer in 0..INT32_MAX."""
    if isinstance(ids, np.ndarray):
        in_range = (ids >= 0) & (ids <= INT32_MAX)
        return ids.ndim == 1 and ids.dtype.kind in "iu" and bool(in_range.all())
    return all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids)


def _all_finite(values: Any) -> bool:
    if isinstance(values, np.ndarray):
        return values.ndim == 1 and values.dtype.kind in "iuf" and bool(np.isfinite(values).all())
    return all(_is_number(x) for x in values)


def _versions(raw: dict[str, Any], where: str) -> tuple[int, int]:
    """(min_version, max_version) of a sample or group, each in 0..INT64_MAX, min <= max."""
    for key in ("min_version", "max_version"):
        value = raw.get(key)
        if not _is_int(value) or not 0 <= value <= INT64_MAX:
            raise RecordError(f"{where}.{key} must be an integer in 0..2**63-1")
    if raw["min_version"] > raw["max_version"]:
        raise RecordError(
            f"{where}.min_version ({raw['min_version']}) is above max_version "
            f"({raw['max_version']})"
        )
    return raw["min_version"], raw["max_version"]


def _check_arrays(prompt: Any, completion: Any, logprobs: Any, where: str) -> None:
    if len(prompt) == 0:
        raise RecordError(f"{where}.prompt_ids is empty")
    if not (_valid_ids(prompt) and _valid_ids(completion)):
        raise RecordError(f"{where}: token ids must be integers in 0..2**31-1")
    if not _all_finite(logprobs):
        raise RecordError(f"{where}: logprobs must be finite numbers")


Array = list[int] | list[float] | np.ndarray


def _top(ids: Any) -> int:
    if isinstance(ids, np.ndarray):
        return int(ids.max()) if ids.size else -1
    return max(ids, default=-1)


@dataclass(frozen=True)
class ScoreBounds:
    """The rewards and advantages this run's samples can hold: the environment's reward range
    (`reward`, each end possibly infinite), and the largest advantage magnitude the run's
    estimator gives rewards in that range, length penalty included (rl/orchestrator/
    advantages.py's `advantage_bound`). The orchestrator declares them when it starts
    (`RunDir.write_scores`); a sample outside them was not scored by this run."""

    reward: tuple[float, float]
    advantage: float

    TOLERANCE = 1e-6
    """Relative slack over the bounds, for the rounding of the estimators' sums."""

    def check(self, sample: Sample, where: str) -> None:
        low, high = self.reward
        slack = self.TOLERANCE * max(1.0, abs(low) if math.isfinite(low) else 0.0,
                                     abs(high) if math.isfinite(high) else 0.0)  # fmt: skip
        if not low - slack <= sample.reward <= high + slack:
            raise RecordError(
                f"{where}.reward {sample.reward:g} is outside the environment's reward range "
                f"[{low:g}, {high:g}]"
            )
        if abs(sample.advantage) > self.advantage * (1 + self.TOLERANCE) + self.TOLERANCE:
            raise RecordError(
                f"{where}.advantage {sample.advantage:g} is beyond the bound {self.advantage:g} "
                "that the run's advantage estimator gives its reward range"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"reward": list(self.reward), "advantage": self.advantage}

    @staticmethod
    def parse(raw: Any) -> ScoreBounds:
        """From `to_dict`'s form (JSON, where infinities are Infinity); RecordError if not."""
        try:
            low, high = (float(x) for x in raw["reward"])
            advantage = float(raw["advantage"])
        except (TypeError, KeyError, ValueError) as exc:
            raise RecordError(f"score bounds unreadable: {exc!r}") from None
        if math.isnan(low) or math.isnan(high) or not low <= high or not advantage >= 0:
            raise RecordError(f"score bounds unreadable: {raw!r}")
        return ScoreBounds((low, high), advantage)


@dataclass(frozen=True)
class RunLimits:
    """What a sample must fit in this run: token ids inside the model's vocabulary, no more
    tokens than the served length, and (once the orchestrator declared them) a reward and an
    advantage within the run's `ScoreBounds`. The queue checks every pushed sample against them
    and the trainer every sample of its batch: a sample that does not fit would fail the
    trainer's embedding lookup (or its memory) at every try, or weigh its loss beyond anything
    the run's rewards can."""

    vocab_size: int
    max_len: int
    scores: ScoreBounds | None = None

    def check(self, sample: Sample, where: str) -> None:
        """RecordError naming `where` if `sample` does not fit."""
        if self.scores is not None:
            self.scores.check(sample, where)
        if sample.tokens > self.max_len:
            raise RecordError(
                f"{where}: {sample.tokens} tokens, above the run's served length {self.max_len}"
            )
        top = max(_top(sample.prompt_ids), _top(sample.completion_ids))
        if top >= self.vocab_size:
            raise RecordError(
                f"{where}: token id {top} is outside the model's vocabulary [0, {self.vocab_size})"
            )


@dataclass
class Sample:
    """One completion (or multi-turn episode) with what the trainer needs to learn from it."""

    prompt_ids: Array
    """Prompt token ids."""
    completion_ids: Array
    """Sampled token ids (for an episode: model turns and the environment's replies)."""
    logprobs: Array
    """The inference policy's log-probability of each completion token (0 on replies)."""
    reward: float
    """The environment's reward."""
    advantage: float
    """The advantage the loss weights this sample's tokens by."""
    min_version: int
    """Oldest policy version that generated a token of it."""
    max_version: int
    """Newest policy version that generated a token of it (a weight swap mid-rollout)."""
    env_spans: list[list[int]] = field(default_factory=list)
    """[begin, end) spans of the completion written by the environment: no loss there."""
    env_metrics: dict[str, float] = field(default_factory=dict)
    """Per-episode numbers the environment keeps, logged as batch means `env/<name>`."""
    filtered_groups: int = 0
    """Groups the orchestrator dropped for having no signal while filling this batch (set on
    the batch's first sample only)."""

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def trained_tokens(self) -> int:
        """Completion tokens that carry loss: all but the environment's turns."""
        return len(self.completion_ids) - sum(end - begin for begin, end in self.env_spans)

    def to_dict(self) -> dict[str, Any]:
        """The sample as the wire format and JSON carry it (optional fields only when set)."""
        out: dict[str, Any] = {
            "prompt_ids": self.prompt_ids,
            "completion_ids": self.completion_ids,
            "logprobs": self.logprobs,
            "reward": self.reward,
            "advantage": self.advantage,
            "min_version": self.min_version,
            "max_version": self.max_version,
        }
        if self.env_spans:
            out["env_spans"] = self.env_spans
        if self.env_metrics:
            out["env_metrics"] = self.env_metrics
        if self.filtered_groups:
            out["filtered_groups"] = self.filtered_groups
        return out

    @classmethod
    def parse(cls, raw: Any, where: str = "sample", check_arrays: bool = True) -> Sample:
        """A Sample from a decoded dict; RecordError naming the first bad field.
        `check_arrays=False` skips the array checks, for data the queue already checked."""
        if not isinstance(raw, dict):
            raise RecordError(f"{where} must be an object")
        min_version, max_version = _versions(raw, where)
        for key in ("reward", "advantage"):
            if not _is_number(raw.get(key)):
                raise RecordError(f"{where}.{key} must be a finite number")
        arrays = [raw.get(k) for k in ARRAY_KEYS]
        if not all(isinstance(a, list | np.ndarray) for a in arrays):
            raise RecordError(f"{where}: prompt_ids, completion_ids, logprobs must be lists")
        prompt, completion, logprobs = arrays
        if len(logprobs) != len(completion) or len(completion) == 0:
            raise RecordError(f"{where}: completion_ids empty or unlike logprobs in length")
        metrics = raw.get("env_metrics", {})
        if not isinstance(metrics, dict) or not all(
            isinstance(k, str) and _is_number(v) for k, v in metrics.items()
        ):
            raise RecordError(f"{where}.env_metrics must map names to finite numbers")
        spans = raw.get("env_spans", [])
        if not _valid_spans(spans, len(completion)):
            raise RecordError(
                f"{where}.env_spans must be ordered [begin, end) pairs inside the completion"
            )
        filtered = raw.get("filtered_groups", 0)
        if not _is_int(filtered) or filtered < 0:
            raise RecordError(f"{where}.filtered_groups must be a non-negative integer")
        if check_arrays:
            _check_arrays(prompt, completion, logprobs, where)
        return cls(
            prompt_ids=prompt,
            completion_ids=completion,
            logprobs=logprobs,
            reward=float(raw["reward"]),
            advantage=float(raw["advantage"]),
            min_version=min_version,
            max_version=max_version,
            env_spans=spans,
            env_metrics=dict(metrics),
            filtered_groups=filtered,
        )


@dataclass
class Group:
    """An RL group: the scored completions of one prompt, and the versions that made them."""

    samples: list[Sample]
    """The completions (group_size of them; advantages are taken within the group)."""
    min_version: int
    """Oldest policy version behind any of its tokens (staleness is counted from it)."""
    max_version: int
    """Newest policy version behind any of its tokens."""

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.samples)

    def to_dict(self) -> dict[str, Any]:
        return {
            "samples": [s.to_dict() for s in self.samples],
            "min_version": self.min_version,
            "max_version": self.max_version,
        }

    @classmethod
    def parse(cls, raw: Any, where: str = "group", check_arrays: bool = True) -> Group:
        """A Group from a decoded dict; RecordError naming the first bad field."""
        if not isinstance(raw, dict) or not isinstance(raw.get("samples"), list):
            raise RecordError(f"{where} must be an object with a 'samples' list")
        if not raw["samples"]:
            raise RecordError(f"{where}.samples is empty")
        low, high = _versions(raw, where)
        samples = [
            Sample.parse(s, f"{where}.samples[{i}]", check_arrays)
            for i, s in enumerate(raw["samples"])
        ]
        for i, s in enumerate(samples):
            if not low <= s.min_version <= s.max_version <= high:
                raise RecordError(
                    f"{where}.samples[{i}]: versions {s.min_version}..{s.max_version} are "
                    f"outside the group's {low}..{high}"
                )
        return cls(samples, low, high)


@dataclass(frozen=True)
class Completion:
    """One choice an inference server sampled: its exact tokens and their logprobs (what the
    trainer learns from), its text, and the policy versions behind it."""

    prompt_ids: list[int]
    """The prompt as the server tokenized it."""
    token_ids: list[int]
    """The sampled token ids."""
    logprobs: list[float]
    """The sampling policy's log-probability of each sampled token."""
    text: str
    """The sampled text (a closing end-of-sequence token and any stop string cut off)."""
    finish_reason: str
    """`stop` (end of sequence or a stop string) or `length` (max_tokens)."""
    min_version: int
    """The policy version that served the request."""
    max_version: int
    """The newest version behind a token of it (vLLM: a weight swap mid-request)."""


@dataclass
class Episode:
    """A rollout as one training sample: the prompt, then the model's turns and what came
    between them (an environment's replies, an agent's messages), which carry no loss.

    A single-turn rollout is one model turn (`of`); multi-turn rollouts and the agents' proxy
    add turns as they come. An agent's episode whose conversation was re-rendered (template
    drift) keeps the samples it closed in `earlier`, trained with its reward."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """0 on the tokens between model turns."""
    env_spans: list[list[int]] = field(default_factory=list)
    """[begin, end) spans of `completion_ids` that are not the model's (no loss there)."""
    turns: list[str] = field(default_factory=list)
    """The model's turns as text."""
    text: str = ""
    """Everything after the prompt as text, for inspection."""
    versions: list[int] = field(default_factory=list)
    """The policy versions behind the model's turns."""
    finish_reason: str = "stop"
    """How the last model turn ended."""
    multi_turn: bool = False
    """Scored on its list of turns (multi-turn environments, agents) rather than its text."""
    earlier: list[Episode] = field(default_factory=list)

    @classmethod
    def of(cls, completion: Completion) -> Episode:
        """A single-turn rollout: the completion as the episode's one model turn."""
        episode = cls(list(completion.prompt_ids))
        episode.add_model_turn(completion)
        return episode

    def add_model_turn(self, completion: Completion) -> None:
        self.completion_ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.turns.append(completion.text)
        self.text += completion.text
        self.versions += [completion.min_version, completion.max_version]
        self.finish_reason = completion.finish_reason

    def add_other(self, ids: list[int], text: str = "") -> None:
        """Tokens that are not the model's (a reply, a tool result, an agent's message)."""
        self.env_spans.append([len(self.completion_ids), len(self.completion_ids) + len(ids)])
        self.completion_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.text += text

    @property
    def completion(self) -> Any:
        """What the environment scores: the text, or a multi-turn episode's list of turns."""
        return self.turns if self.multi_turn else self.text

    @property
    def model_tokens(self) -> int:
        """Tokens the model sampled (those that carry loss)."""
        return len(self.completion_ids) - sum(end - begin for begin, end in self.env_spans)

    @property
    def min_version(self) -> int:
        return min(self.versions)

    @property
    def max_version(self) -> int:
        return max(self.versions)


@dataclass
class BatchShard:
    """One trainer rank's share of step `step`'s batch, packed into micro-batches."""

    step: int
    """The trainer step (the batch number) it belongs to."""
    samples: list[Sample]
    """This rank's samples (token-balanced across ranks)."""
    micro_batches: list[list[int]]
    """Indices into `samples`: one forward/backward pass each, under the token budget."""
    groups: int
    """Groups in the whole batch."""
    dropped: int
    """Groups dropped as too stale when the batch was assembled."""
    depth: int
    """Groups waiting in the queue when this shard was served."""

    def meta(self) -> dict[str, Any]:
        """Everything but the samples (the wire format's header)."""
        return {
            "step": self.step,
            "groups": self.groups,
            "dropped": self.dropped,
            "depth": self.depth,
            "micro_batches": self.micro_batches,
        }

    @classmethod
    def from_wire(cls, meta: dict[str, Any], samples: list[dict[str, Any]]) -> BatchShard:
        return cls(
            step=meta["step"],
            samples=[Sample.parse(s, check_arrays=False) for s in samples],
            micro_batches=meta["micro_batches"],
            groups=meta["groups"],
            dropped=meta["dropped"],
            depth=meta["depth"],
        )


@dataclass
class EvalRecord:
    """A held-out evaluation of one policy version (a line of metrics.jsonl)."""

    step: int
    """The policy version evaluated."""
    exact_match: float
    """Share of held-out prompts answered exactly."""
    reward_mean: float
    """Mean held-out reward."""
    samples: int
    """Held-out prompts scored."""
    time_s: float
    """Seconds the evaluation took."""
    k: int = 1
    """Completions per prompt (`eval.samples`); above 1, `exact_match` is mean@k."""
    pass_at_k: float | None = None
    """With k above 1: share of prompts with at least one exact answer among the k."""
    others: dict[str, dict[str, float]] = field(default_factory=dict)
    """`eval.environments`' results by option: exact_match, reward/mean, samples (and
    pass_at_k), logged as `eval/<option>/<name>`."""

    def to_json(self) -> dict[str, Any]:
        record = {
            "kind": RecordKind.eval.value,
            "step": self.step,
            "eval/exact_match": self.exact_match,
            "eval/reward/mean": self.reward_mean,
            "eval/samples": self.samples,
            "time/eval": self.time_s,
        }
        if self.k > 1:
            record |= {"eval/k": self.k, "eval/pass_at_k": self.pass_at_k}
        for option, results in self.others.items():
            record |= {f"eval/{option}/{name}": value for name, value in results.items()}
        return record


@dataclass
class TrainRecord:
    """One trainer step (a line of metrics.jsonl); `metrics` holds the step's numbers under
    their logged names (`reward/mean`, `loss`, `throughput/samples_per_s`, `env/...`)."""

    step: int
    """The policy version this step produced (steps count from 1)."""
    metrics: dict[str, Any]
    """The step's numbers by logged name."""

    def to_json(self) -> dict[str, Any]:
        return {"kind": RecordKind.train.value, "step": self.step, **self.metrics}


@dataclass
class RolloutRecord:
    """The orchestrator's side of one batch (a line of metrics.jsonl), under the number of the
    trainer step that trains on it: batch N is step N + 1's."""

    step: int
    """The trainer step this batch feeds."""
    generate_s: float
    """Seconds to generate and score the batch (refill rounds included)."""
    weight_load_s: float
    """Seconds spent loading new weights into inference since the previous batch (0 when the
    trainer broadcasts them: its `time/weight_sync` covers that)."""
    lengths: list[int]
    """Tokens the model generated in each completion (its own turns only)."""
    truncated: int
    """Completions cut at `max_tokens` rather than ended by the model."""
    started_at: float
    """Wall clock (time.time()) when generating the batch began, after the weights it waited
    for were loaded."""
    generated: int = 0
    """Completions generated for the batch in all its rounds: those trained on (but for the
    carried groups, generated for the batch before), those of groups dropped for having no
    signal, and those of surplus groups."""
    surplus_groups: int = 0
    """Groups with signal drawn beyond the batch (the first round draws for the groups it
    expects to drop): carried into the next batch with `algorithm.carry_surplus`, else not
    trained on."""
    carried_groups: int = 0
    """Groups of the batch that the batch before drew beyond its own (generated for it)."""
    first_round_signal: float | None = None
    """Share of the first round's groups that had signal (with the zero-advantage filter): how
    much the next batches draw; a restarted orchestrator reads it back."""

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": RecordKind.rollout.value,
            "step": self.step,
            "at/generate_start": self.started_at,
            "at/generate_end": self.started_at + self.generate_s,
            "time/generate": self.generate_s,
            "time/weight_load": self.weight_load_s,
            "response/length_mean": sum(self.lengths) / max(len(self.lengths), 1),
            "response/length_max": max(self.lengths, default=0),
            "response/truncated": self.truncated / max(len(self.lengths), 1),
            "samples/generated": self.generated,
            "filter/surplus_groups": self.surplus_groups,
            "filter/carried_groups": self.carried_groups,
            **(
                {"filter/first_round_signal": self.first_round_signal}
                if self.first_round_signal is not None
                else {}
            ),
        }


@dataclass
class WarmupRecord:
    """Progress of the trainer's supervised warm-up (a line of metrics.jsonl)."""

    step: int
    """Warm-up steps done."""
    steps: int
    """Warm-up steps in all."""
    loss: float
    """The latest warm-up step's cross-entropy."""
    elapsed_s: float
    """Seconds since the warm-up began."""

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": RecordKind.warmup.value,
            "step": self.step,
            "warmup/steps": self.steps,
            "warmup/loss": self.loss,
            "warmup/elapsed_s": self.elapsed_s,
        }
