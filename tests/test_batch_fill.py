"""How the orchestrator fills a batch with groups that carry signal: the first round draws for
the groups it expects to drop, so most batches fill without a further (sequential) round; the
groups with signal it drew beyond the batch open the next one (also after a restart); and
every completion generated is accounted for."""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rl.core.records import Completion, Episode
from rl.core.rundir import RunDir
from rl.core.schedule import generating_version
from rl.envs import Example, make_environment
from rl.orchestrator.advantages import ADVANTAGES
from rl.orchestrator.loop import MAX_FILL_ROUNDS, Orchestrator
from tests.support.runs import compose_run

PROMPTS, GROUP = 8, 4


def flat(example: Example, every: int) -> bool:
    """One prompt in `every` (by a stable hash; 1: all) gets the same completion each time:
    its group has no signal."""
    return zlib.crc32(example.prompt.encode()) % every == 0


def choice(text: str, version: int) -> Episode:
    """A single-turn rollout answering `text` (two stand-in tokens) by policy `version`."""
    return Episode.of(Completion([1, 7, 8], [5, 6], [-0.5, -0.5], text, "stop", version, version))


def orchestrator(
    tmp_path: Path, rounds: list[list[int]], every: int, *overrides: str
) -> Orchestrator:
    """An orchestrator whose inference is a stand-in answering by `flat`, with what `generate`
    needs and nothing else; each batch's draws per round land in `rounds`."""
    tmp_path.mkdir(exist_ok=True)
    orch = Orchestrator.__new__(Orchestrator)
    orch.cfg = compose_run(
        f"environment.prompts_per_step={PROMPTS}",
        f"environment.group_size={GROUP}",
        "algorithm.carry_surplus=true",
        *overrides,
    )
    orch.env = make_environment(orch.cfg.environment)
    orch.advantage = ADVANTAGES["group_mean"]
    orch.run_dir = RunDir(tmp_path)
    orch.weights = SimpleNamespace(load_s=0.0)
    orch.colocated_gpu = False
    orch.log = logging.getLogger("test_batch_fill")
    orch.signal_share = None
    orch.carry = []
    orch.pushed = []  # type: ignore[attr-defined]
    orch.push = lambda groups, step: orch.pushed.append(groups)  # type: ignore[attr-defined]
    orch.save_rollouts = lambda *args: None  # type: ignore[method-assign]

    def rollouts(examples: list[Example], n: int, temperature: float, *where: Any) -> list[Episode]:
        rounds[-1].append(len(examples))
        version = generating_version(orch.cfg, where[1])  # where: "train", step, round
        return [
            choice(e.answer if flat(e, every) or k == 0 else "zz", version)
            for e in examples
            for k in range(n)
        ]

    orch.rollouts = rollouts  # type: ignore[method-assign]
    return orch


def run_batches(orch: Orchestrator, rounds: list[list[int]], batches: int, first: int = 0) -> None:
    for step in range(first, batches):
        rounds.append([])
        orch.generate(step)


def metrics(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_batches_fill_in_one_round_mostly_and_count_what_they_drop(tmp_path: Path) -> None:
    rounds: list[list[int]] = []
    orch = orchestrator(tmp_path, rounds, every=4)  # a quarter of the groups without signal
    run_batches(orch, rounds, 40)
    for groups, drawn in zip(orch.pushed, rounds, strict=True):  # type: ignore[attr-defined]
        assert len(groups) == PROMPTS
        # (the last round keeps what it gets, so that the batch fills)
        signal = all(any(abs(s.advantage) > 0 for s in g.samples) for g in groups)
        assert signal or len(drawn) == MAX_FILL_ROUNDS, drawn
    records = metrics(tmp_path)
    assert len(records) == 40
    # once the share of groups with signal is learnt (about 3/4), the first round draws for
    # the groups it expects to drop, beside those the batch before carried in
    missing = [PROMPTS - r["filter/carried_groups"] for r in records[10:]]
    settled = rounds[10:]
    assert all(m < r[0] <= 2 * m for m, r in zip(missing, settled, strict=True))
    refilled = sum(len(r) > 1 for r in settled)
    assert refilled < len(settled) // 3
    for record, drawn in zip(records, rounds, strict=True):
        assert record["samples/generated"] == GROUP * sum(drawn)
        own = PROMPTS - record["filter/carried_groups"]
        assert record["filter/surplus_groups"] <= sum(drawn) - own


def test_surplus_groups_open_the_next_batch_so_only_dropped_groups_go_untrained(
    tmp_path: Path,
) -> None:
    rounds: list[list[int]] = []
    orch = orchestrator(tmp_path, rounds, every=4)
    run_batches(orch, rounds, 40)
    records = metrics(tmp_path)
    pushed = orch.pushed  # type: ignore[attr-defined]
    assert sum(r["filter/surplus_groups"] for r in records[:-1]) > 10  # the case in hand
    for before, record, batch in zip(records, records[1:], pushed[1:], strict=False):
        carried = before["filter/surplus_groups"]
        assert record["filter/carried_groups"] == carried
        # the carried groups open the batch, each with signal
        assert all(any(abs(s.advantage) > 0 for s in g.samples) for g in batch[:carried])
    # Every completion generated is trained on, but those of the groups without signal and
    # the last batch's surplus (the run ends with it).
    generated = sum(r["samples/generated"] for r in records)
    assert generated == GROUP * sum(sum(drawn) for drawn in rounds)
    trained = sum(len(groups) for groups in pushed)
    filtered = sum(groups[0].samples[0].filtered_groups for groups in pushed)
    assert filtered > 10
    last = records[-1]["filter/surplus_groups"]
    assert generated == GROUP * (trained + filtered + last)


def test_a_resumed_orchestrator_draws_and_carries_as_the_uninterrupted_one(
    tmp_path: Path,
) -> None:
    rounds: list[list[int]] = []
    whole = orchestrator(tmp_path / "whole", rounds, every=4)
    run_batches(whole, rounds, 12)
    before: list[list[int]] = []
    first = orchestrator(tmp_path / "resumed", before, every=4)
    run_batches(first, before, 7)  # the queue got batches 0..6; then it stopped
    again = orchestrator(tmp_path / "resumed", rounds, every=4)
    again.next_batch = lambda: 7  # type: ignore[method-assign]
    assert again.resume() == 7
    assert again.carry  # what batch 6 drew beyond its own
    run_batches(again, rounds, 12, first=7)
    wanted = [[g.to_dict() for g in batch] for batch in whole.pushed[7:]]  # type: ignore[attr-defined]
    got = [[g.to_dict() for g in batch] for batch in again.pushed]  # type: ignore[attr-defined]
    assert got == wanted


def test_carried_groups_past_the_staleness_bound_are_dropped_and_carrying_can_be_off(
    tmp_path: Path,
) -> None:
    # Batch N's completions are version N - 1: batch N + 1 is two versions past them.
    rounds: list[list[int]] = []
    stale = orchestrator(tmp_path / "stale", rounds, 4, "algorithm.max_off_policy_steps=1")
    run_batches(stale, rounds, 12)
    records = metrics(tmp_path / "stale")
    assert sum(r["filter/surplus_groups"] for r in records) > 0
    assert all(r["filter/carried_groups"] == 0 for r in records)
    # Off, or on-policy (async_level 0), where a carried group would be a version behind.
    for name in ("algorithm.carry_surplus=false", "algorithm.async_level=0"):
        rounds = []
        off = orchestrator(tmp_path / name, rounds, 4, name)
        run_batches(off, rounds, 12)
        records = metrics(tmp_path / name)
        assert sum(r["filter/surplus_groups"] for r in records) > 0
        assert all(r["filter/carried_groups"] == 0 for r in records)
        assert not (tmp_path / name / ".relay" / "carried").exists()


def test_a_task_without_signal_draws_no_more_than_the_batch(tmp_path: Path) -> None:
    # Every group scores alike (rewards that never differ): drawing more would only cost.
    rounds: list[list[int]] = []
    orch = orchestrator(tmp_path, rounds, every=1)
    run_batches(orch, rounds, 8)
    assert rounds == [[PROMPTS] * MAX_FILL_ROUNDS] * 8  # from the first batch's share on
    assert all(len(groups) == PROMPTS for groups in orch.pushed)  # type: ignore[attr-defined]
