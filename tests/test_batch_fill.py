"""How the orchestrator fills a batch with groups that carry signal: the first round draws for
the groups it expects to drop, so most batches fill without a further (sequential) round, and
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
from rl.envs import Example, make_environment
from rl.orchestrator.advantages import ADVANTAGES
from rl.orchestrator.loop import MAX_FILL_ROUNDS, Orchestrator
from tests.support.runs import compose_run

PROMPTS, GROUP = 8, 4


def flat(example: Example, every: int) -> bool:
    """One prompt in `every` (by a stable hash; 1: all) gets the same completion each time:
    its group has no signal."""
    return zlib.crc32(example.prompt.encode()) % every == 0


def choice(text: str) -> Episode:
    """A single-turn rollout answering `text` (two stand-in tokens)."""
    return Episode.of(Completion([1, 7, 8], [5, 6], [-0.5, -0.5], text, "stop", 0, 0))


def orchestrator(tmp_path: Path, rounds: list[list[int]], every: int) -> Orchestrator:
    """An orchestrator whose inference is a stand-in answering by `flat`, with what `generate`
    needs and nothing else; each batch's draws per round land in `rounds`."""
    orch = Orchestrator.__new__(Orchestrator)
    orch.cfg = compose_run(
        f"environment.prompts_per_step={PROMPTS}", f"environment.group_size={GROUP}"
    )
    orch.env = make_environment(orch.cfg.environment)
    orch.advantage = ADVANTAGES["group_mean"]
    orch.run_dir = RunDir(tmp_path)
    orch.weights = SimpleNamespace(load_s=0.0)
    orch.colocated_gpu = False
    orch.log = logging.getLogger("test_batch_fill")
    orch.signal_share = None
    orch.pushed = []  # type: ignore[attr-defined]
    orch.push = lambda groups, step: orch.pushed.append(groups)  # type: ignore[attr-defined]
    orch.save_rollouts = lambda *args: None  # type: ignore[method-assign]

    def rollouts(examples: list[Example], n: int, temperature: float, *where: Any) -> list[Episode]:
        rounds[-1].append(len(examples))
        return [
            choice(e.answer if flat(e, every) or k == 0 else "zz")
            for e in examples
            for k in range(n)
        ]

    orch.rollouts = rollouts  # type: ignore[method-assign]
    return orch


def run_batches(orch: Orchestrator, rounds: list[list[int]], batches: int) -> None:
    for step in range(batches):
        rounds.append([])
        orch.generate(step)


def test_batches_fill_in_one_round_mostly_and_count_what_they_drop(tmp_path: Path) -> None:
    rounds: list[list[int]] = []
    orch = orchestrator(tmp_path, rounds, every=4)  # a quarter of the groups without signal
    run_batches(orch, rounds, 40)
    for groups, drawn in zip(orch.pushed, rounds, strict=True):  # type: ignore[attr-defined]
        assert len(groups) == PROMPTS
        # (the last round keeps what it gets, so that the batch fills)
        signal = all(any(abs(s.advantage) > 0 for s in g.samples) for g in groups)
        assert signal or len(drawn) == MAX_FILL_ROUNDS, drawn
    settled = rounds[10:]  # once the share of groups with signal is learnt (about 3/4)
    assert all(PROMPTS < r[0] <= 2 * PROMPTS for r in settled)
    refilled = sum(len(r) > 1 for r in settled)
    assert refilled < len(settled) // 3
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 40
    for record, drawn in zip(records, rounds, strict=True):
        assert record["samples/generated"] == GROUP * sum(drawn)
        dropped = sum(drawn) - PROMPTS
        assert record["filter/surplus_groups"] <= dropped


def test_a_task_without_signal_draws_no_more_than_the_batch(tmp_path: Path) -> None:
    # Every group scores alike (rewards that never differ): drawing more would only cost.
    rounds: list[list[int]] = []
    orch = orchestrator(tmp_path, rounds, every=1)
    run_batches(orch, rounds, 8)
    assert rounds == [[PROMPTS] * MAX_FILL_ROUNDS] * 8  # from the first batch's share on
    assert all(len(groups) == PROMPTS for groups in orch.pushed)  # type: ignore[attr-defined]
