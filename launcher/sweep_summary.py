"""A sweep's comparison: `sweep_summary.md` (one row per point: what it changed, how it
ended, its last rewards and pace) and `sweep.png` (every point's reward curves on one plot),
written into the sweep directory when a multirun ends (`SweepEnd` in launcher/shared_sweep.py, a
Hydra callback) and again by `rl action=status run_dir=<sweep dir>` (a Slurm sweep's points end
after the command that submitted them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher.errors import ConfigError
from launcher.report import read_records, read_summary
from launcher.run_dir import running_roles
from launcher.slurm_cli import job_states, read_jobs
from rl.core.records import is_eval, is_train
from rl.core.rundir import SERVICE, RunDir, point_dirs

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
    lines += ["", "![rewards](sweep.png)", ""]
    target = sweep_dir / "sweep_summary.md"
    target.write_text("\n".join(lines))
    plot_sweep([read_records(run.metrics) for run in points], labels, sweep_dir / "sweep.png")
    return target


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
