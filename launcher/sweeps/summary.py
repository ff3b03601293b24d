"""A sweep's comparison: `sweep_summary.md` (one row per point: what it changed, how it
ended, its last rewards and pace; and where points differ only in their seed, one row per
group of them, with mean +- sd over the seeds and whether the best group's lead exceeds that
spread) and `sweep.png` (every point's reward curves, or each group's mean with a band),
written into the sweep directory when a multirun ends (`SweepEnd` in launcher/sweeps/shared.py, a
Hydra callback) and again by `rl action=status run_dir=<sweep dir>` (a Slurm sweep's points end
after the command that submitted them).
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from launcher.clusters.run_dir import running_roles
from launcher.clusters.slurm.cli import job_states, read_jobs
from launcher.errors import ConfigError
from launcher.watch.report import read_records, read_summary
from rl.core.kinds import is_eval, is_train
from rl.core.rundir import SERVICE, RunDir, point_dirs

FIRST, LAST = "eval/exact_match/first", "eval/exact_match/last"
DEFAULT_METRIC = LAST
COLUMNS = (
    ("status", "status", "{}"),
    ("steps", "steps", "{}"),
    ("reward (last 10)", "reward/last", "{:.3f}"),
    ("eval exact (last)", "eval/exact_match/last", "{:.3f}"),
    ("tokens/s", "throughput/tokens_per_s/mean", "{:,.0f}"),
    ("wall", "wall_s", "{:.0f} s"),
)


def sweep_points(sweep_dir: Path) -> list[RunDir]:
    """The sweep's run directories, in the order Hydra numbered them."""
    runs = [RunDir(p) for p in point_dirs(sweep_dir)]
    return sorted(runs, key=lambda run: _number(run.root.name))


def _number(name: str) -> tuple[int, str]:
    head = name.split("-", 1)[0]
    return (int(head), name) if head.isdigit() else (1 << 30, name)


def varied(points: list[RunDir]) -> list[list[str]]:
    """Each point's overrides that not every point shares: what tells them apart."""
    given = [run.overrides() for run in points]
    shared = set.intersection(*map(set, given)) if given else set()
    return [[o for o in overrides if o not in shared] for overrides in given]


def _cell(summary: dict[str, Any], key: str, form: str, run: RunDir) -> str:
    if key == "status" and key not in summary:
        return "running" if run.metrics.exists() else "not started"
    return form.format(summary[key]) if key in summary else "-"


def _shared_service(sweep_dir: Path) -> list[str]:
    """A line on the sweep's shared inference service, where it has one."""
    service = RunDir(sweep_dir / SERVICE)
    if not service.config.exists():
        return []
    state = "running" if running_roles(service) else "stopped"
    if jobs := read_jobs(service):  # on Slurm: its job's state
        try:
            states = job_states(list(jobs.values()))
            state = ", ".join(f"job {i} {states[i].state}" for i in jobs.values() if i in states)
        except ConfigError:
            state = "Slurm did not answer"
    config = service.load_config()
    return [
        f"One inference service for every point ({service.root}, {state}): base "
        f"{config.model.path}, up to {config.inference.max_loras} adapters of rank up to "
        f"{config.inference.max_lora_rank}, each point's under its name (point-N).",
        "",
    ]


def write_sweep_summary(sweep_dir: Path) -> Path | None:
    """Write the table and the combined plot; None when the directory holds no point."""
    points = sweep_points(sweep_dir)
    if not points:
        return None
    labels = [" ".join(v) or run.root.name for run, v in zip(points, varied(points), strict=True)]
    lines = [f"# sweep {sweep_dir}", "", *_shared_service(sweep_dir)]
    lines += [
        "| point | overrides | " + " | ".join(title for title, _, _ in COLUMNS) + " |",
        "|---|---|" + "---|" * len(COLUMNS),
    ]
    for run, label in zip(points, labels, strict=True):
        summary = read_summary(run)
        cells = [_cell(summary, key, form, run) for _, key, form in COLUMNS]
        lines.append(f"| {run.root.name} | `{label}` | " + " | ".join(cells) + " |")
    groups = seed_groups(points, labels)
    if any(len(members) > 1 for members in groups.values()):
        metric = OmegaConf.select(points[0].load_config(), "sweep.metric") or DEFAULT_METRIC
        lines += ["", *group_table(groups, metric)]
    lines += ["", "![rewards](sweep.png)", ""]
    target = sweep_dir / "sweep_summary.md"
    target.write_text("\n".join(lines))
    if any(len(members) > 1 for members in groups.values()):
        plot_groups(groups, sweep_dir / "sweep.png")
    else:
        plot_sweep([read_records(run.metrics) for run in points], labels, sweep_dir / "sweep.png")
    return target


SEED = re.compile(r"(^|\s)seed=\S+")


def seed_groups(points: list[RunDir], labels: list[str]) -> dict[str, list[RunDir]]:
    """The points by everything but their seed: a group's points differ only in `seed=`."""
    groups: dict[str, list[RunDir]] = {}
    for run, label in zip(points, labels, strict=True):
        key = " ".join(SEED.sub(" ", label).split()) or "defaults"
        groups.setdefault(key, []).append(run)
    return groups


GROUP_COLUMNS = (
    ("eval exact (version 0)", "eval/exact_match/first"),
    ("eval exact (last)", "eval/exact_match/last"),
    ("reward (last 10)", "reward/last"),
)
FEW_SEEDS = 3
"""Groups with fewer seeds than this are warned of: two seeds give one spread, no test."""


def group_table(groups: dict[str, list[RunDir]], metric: str = DEFAULT_METRIC) -> list[str]:
    """A row per group (mean +- sd over its seeds, n, the baseline its runs started from and
    their gain over it), the best group by `metric` and whether Welch's t-test tells its lead
    over the next from the spread across seeds."""
    lines = [
        "Over seeds (points that differ only in their seed):",
        "",
        "| group | n | " + " | ".join(t for t, _ in GROUP_COLUMNS) + " | gain over version 0 |",
        "|---|---|" + "---|" * (len(GROUP_COLUMNS) + 1),
    ]
    by_metric = {}
    for name, members in groups.items():
        summaries = [read_summary(run) for run in members]
        cells = []
        for _, key in GROUP_COLUMNS:
            values = [s[key] for s in summaries if key in s]
            cells.append(mean_sd(values) if values else "-")
        gains = [s[LAST] - s[FIRST] for s in summaries if LAST in s and FIRST in s]
        cells.append(mean_sd(gains, signed=True) if gains else "-")
        by_metric[name] = [s[metric] for s in summaries if metric in s]
        lines.append(f"| `{name}` | {len(by_metric[name])} | " + " | ".join(cells) + " |")
    few = [f"`{name}` ({len(v)})" for name, v in by_metric.items() if len(v) < FEW_SEEDS]
    if few:
        lines += ["", f"warning: fewer than {FEW_SEEDS} seeds in {', '.join(few)}: the spread "
                  "across seeds is a guess, and a lead cannot be told from noise; add seeds "
                  "(seed=0,1,2,...)"]  # fmt: skip
    lines += ["", verdict(by_metric, metric)]
    return lines


def mean_sd(values: list[float], signed: bool = False) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):{'+' if signed else ''}.3f} +- {sd:.3f}"


def verdict(evals: dict[str, list[float]], metric: str = DEFAULT_METRIC) -> str:
    """The best group by its mean `metric`, and whether its lead over the runner-up is told
    from the spread across seeds: Welch's t-test, two-sided, at p < 0.05."""
    scored = {name: values for name, values in evals.items() if values}
    if len(scored) < 2:
        return f"One group has {metric} so far: nothing to rank."
    ranked = sorted(scored, key=lambda name: -statistics.mean(scored[name]))
    best, second = scored[ranked[0]], scored[ranked[1]]
    lead = statistics.mean(best) - statistics.mean(second)
    head = (
        f"Best by {metric}: `{ranked[0]}` ({statistics.mean(best):.3f}); its lead over "
        f"`{ranked[1]}` is {lead:.3f}"
    )
    if min(len(best), len(second)) < 2:
        return f"{head}: one seed a side gives no spread to judge it by."
    p = welch_p(best, second)
    test = f"Welch's t-test over the seeds (n={len(best)} vs {len(second)}): p={p:.3f}"
    judged = "a real lead" if p < 0.05 else "not told apart from noise"
    return f"{head}; {test}, {judged} at p < 0.05."


def welch_p(a: list[float], b: list[float]) -> float:
    """Two-sided p-value of Welch's t-test that `a` and `b` have the same mean."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff = statistics.mean(a) - statistics.mean(b)
    if va + vb == 0:
        return 1.0 if diff == 0 else 0.0
    t = diff / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return incomplete_beta(df / (df + t * t), df / 2, 0.5)


def incomplete_beta(x: float, a: float, b: float) -> float:
    """The regularised incomplete beta function I_x(a, b), by its continued fraction."""
    if x <= 0 or x >= 1:
        return max(0.0, min(1.0, x))
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast on this side only
        return 1.0 - incomplete_beta(1 - x, b, a)
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 300):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-12:
            break
    return front * fraction / a


def plot_groups(groups: dict[str, list[RunDir]], target: Path) -> None:
    """Each group's mean train reward and eval exact match over its seeds, with a band from
    its lowest to its highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    for name, members in groups.items():
        runs = [read_records(run.metrics) for run in members]
        color = None
        for ax, pick, key in ((axes[0], is_train, "reward/mean"),
                              (axes[1], is_eval, "eval/exact_match")):  # fmt: skip
            steps, means, lows, highs = _band(runs, pick, key)
            (line,) = ax.plot(steps, means, "-" if pick is is_train else "o-", color=color)
            color = line.get_color()
            ax.fill_between(steps, lows, highs, color=color, alpha=0.2)
            if pick is is_train:
                line.set_label(f"{name} (n={len(members)})")
    axes[0].set_title("train reward (mean over seeds, band: min..max)", fontsize=9)
    axes[1].set_title("eval exact match (mean over seeds, band: min..max)", fontsize=9)
    for ax in axes:
        ax.set_xlabel("trainer step (policy version)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(str(target.parent), fontsize=9)
    fig.tight_layout()
    fig.savefig(target, dpi=100)
    plt.close(fig)


def _band(runs: list[list[dict]], pick: Any, key: str) -> tuple[list[int], ...]:
    """Steps every run recorded, and the mean, lowest and highest value at each."""
    by_run = [{r["step"]: r[key] for r in records if pick(r)} for records in runs]
    steps = sorted(set.intersection(*(set(values) for values in by_run))) if by_run else []
    columns = [[values[step] for values in by_run] for step in steps]
    return (
        steps,
        [statistics.mean(c) for c in columns],
        [min(c) for c in columns],
        [max(c) for c in columns],
    )


def plot_sweep(runs: list[list[dict]], labels: list[str], target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    for records, label in zip(runs, labels, strict=True):
        train = sorted((r for r in records if is_train(r)), key=lambda r: r["step"])
        evals = sorted((r for r in records if is_eval(r)), key=lambda r: r["step"])
        (line,) = train_ax.plot([r["step"] for r in train], [r["reward/mean"] for r in train])
        line.set_label(label)
        eval_ax.plot(
            [r["step"] for r in evals],
            [r["eval/exact_match"] for r in evals],
            "o-",
            color=line.get_color(),
        )
    train_ax.set_title("train reward", fontsize=9)
    eval_ax.set_title("eval exact match", fontsize=9)
    for ax in (train_ax, eval_ax):
        ax.set_xlabel("trainer step (policy version)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    train_ax.legend(fontsize=8)
    fig.suptitle(str(target.parent), fontsize=9)
    fig.tight_layout()
    fig.savefig(target, dpi=100)
    plt.close(fig)
