"""The TRL comparison's arithmetic: time to a target, score at a time, and the summary that
leaves out seeds run beside other work."""

from __future__ import annotations

import pytest

from benchmarks.trl_comparison import Run, report


def run(label: str, seed: int, points: list[tuple[float, float]], other: float = 0.0) -> Run:
    """A run scored every 100 samples: (RL seconds, exact match) per point."""
    curve = [(100 * i, t, score) for i, (t, score) in enumerate(points)]
    return Run(label, seed, curve, other_cores=other)


def test_time_to_a_target_is_the_first_point_at_or_above_it() -> None:
    r = run("relay", 0, [(0, 0.1), (5, 0.3), (9, 0.5), (12, 0.45), (15, 0.7)])
    assert r.time_to(0.3) == 5 and r.time_to(0.45) == 9 and r.time_to(0.71) is None
    assert r.score_at_time(10) == 0.5 and r.score_at_time(4.9) == 0.1
    assert r.final == 0.7 and r.rl_s == 15


def test_summary_leaves_out_noisy_seeds_and_gives_the_goal_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    runs = [
        run("trl", 0, [(0, 0.1), (10, 0.4), (20, 0.6)]),
        run("relay", 0, [(0, 0.1), (4, 0.4), (8, 0.7)]),
        run("trl", 1, [(0, 0.1), (10, 0.3), (20, 0.6)], other=0.9),  # beside other work
        run("relay", 1, [(0, 0.1), (50, 0.2), (90, 0.3)]),
    ]
    report(runs, ["trl", "relay"], [0.4, 0.6], max_other=0.3)
    out = capsys.readouterr().out
    assert "left out (other work above 0.3 cores during a run): seeds [1]" in out
    # seed 0 only: relay reached 0.4 at 4 s against trl's 10 s, and trl's final 0.6 at 8 s
    # against the 20 s trl took for all its steps
    assert "ratio relay/trl: time to >= 0.400 0.40, time to >= 0.600 0.40" in out
    assert "relay reached trl's mean final score 0.600 in 8.0 s" in out and "ratio 0.40" in out


def test_the_users_clock_adds_each_runs_start_up_and_names_seeds_short_of_the_score(
    capsys: pytest.CaptureFixture[str],
) -> None:
    runs = [
        run("trl", 0, [(0, 0.1), (10, 0.4), (20, 0.6)]),
        run("relay", 0, [(0, 0.1), (4, 0.4), (8, 0.7)]),
        run("trl", 1, [(0, 0.1), (10, 0.3), (20, 0.6)]),
        run("relay", 1, [(0, 0.1), (5, 0.3), (9, 0.5)]),  # short of trl's final 0.6
    ]
    for r, startup in zip(runs, (5.0, 2.0, 7.0, 3.0), strict=True):
        r.startup_s = startup
    assert runs[1].user_time_to(0.4) == 6.0 and runs[1].user_s == 10.0
    assert runs[3].user_time_to(0.6) is None
    report(runs, ["trl", "relay"], [0.6], max_other=0.3)
    out = capsys.readouterr().out
    assert "relay: 1 of 2 seeds never reached trl's mean final score 0.600" in out
    # relay seed 0: 2 s of start-up and 8 s of RL; trl: (5 + 20 + 7 + 20) / 2 = 26 s
    assert "relay reached trl's mean final score 0.600 in 8.0 s, trl took 20.0 s" in out
    assert "start-up included): relay 10.0 s, trl 26.0 s for all its steps: ratio 0.38" in out
