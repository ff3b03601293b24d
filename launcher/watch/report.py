"""End of a run: the reward/eval plot, summary.json, and the result for the terminal (the
wandb run is logged while the run goes on: launcher/watch/tracking.py).

The local launcher and a Slurm run's control job both finish a run this way; it reads and
writes only the run directory (rl/core/rundir.py), so it imports no launcher module.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl.core.disk import DiskFull, writing
from rl.core.kinds import eval_options, is_eval, is_train, kind_of
from rl.core.rundir import RunDir, read_jsonl, write_atomic

if TYPE_CHECKING:  # `rl action=status` reads summaries without the schema's imports
    from omegaconf import DictConfig

    from rl.core.config import RunConfig

WEIGHT_BYTES = ("weights/update_bytes", "weights/full_bytes")
LAST_STEPS = 10
"""A run's final train reward is the mean over this many last steps (one step is noisy)."""


def exact_match_se(record: dict[str, Any]) -> float:
    """The standard error of an eval's exact match over its held-out prompts (each one a hit
    or a miss)."""
    exact, n = record["eval/exact_match"], max(record.get("eval/samples", 1), 1)
    return math.sqrt(exact * (1 - exact) / n)


def plot_title(name: str, run: RunDir) -> str:
    """The plot's title: the run's name and its directory's own name (when it started, or a
    sweep point's number and overrides), not the whole path."""
    return f"{name}  {run.root.name}"


def figure(records: list[dict], title: str) -> Any:
    """The reward plot: train reward per step, eval reward and eval exact match per version,
    the exact match with its standard error as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = sorted((r for r in records if is_train(r)), key=lambda r: r["step"])
    evals = sorted((r for r in records if is_eval(r)), key=lambda r: r["step"])
    versions = [r["step"] for r in evals]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["reward/mean"] for r in train], label="train reward")
    ax.plot(versions, [r["eval/reward/mean"] for r in evals], "o-", label="eval reward")
    ax.errorbar(
        versions,
        [r["eval/exact_match"] for r in evals],
        yerr=[exact_match_se(r) for r in evals],
        fmt="s-",
        capsize=3,
        label="eval exact match (± SE)",
    )
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("trainer step (policy version)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot(records: list[dict], target: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    fig = figure(records, title)
    fig.savefig(target, dpi=100)
    plt.close(fig)


def sweep_group() -> str | None:
    """Every point of a multirun sweep shares a wandb group named after the sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():  # a role supervisor inside a Slurm job
        return None
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    return f"{hydra_cfg.job.config_name}-{Path(hydra_cfg.sweep.dir).name}"


def read_records(metrics: Path) -> list[dict]:
    """The run's metrics records; a step a resumed trainer ran again counts once (its last
    record), as does an eval of the same policy version, and each kind of record apart."""
    latest: dict[tuple[str, int], dict] = {}
    for record in read_jsonl(metrics):
        latest[(kind_of(record), record["step"])] = record
    return list(latest.values())


def read_summary(run: RunDir) -> dict[str, Any]:
    """The run's summary.json ({} before the run has ended)."""
    try:
        return json.loads(run.summary.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def summarize(
    cfg: Any,
    run: RunDir,
    records: list[dict],
    wall_s: float,
    status: str,
    wandb: str,
    reason: str | None = None,
) -> dict[str, Any]:
    """What summary.json says of a run: how it ended (and, given a `reason`, why), what it was
    started with (its overrides and seeds, and whether the config alone decides it), how far it
    got, its last rewards and its mean pace (a sweep's table compares these)."""
    from rl.core.derive import inexact
    from rl.inference.engines import engine_of

    train = sorted((r for r in records if is_train(r)), key=lambda r: r["step"])
    evals = sorted((r for r in records if is_eval(r)), key=lambda r: r["step"])
    reasons = inexact(cfg) + engine_of(cfg).inexact()
    summary: dict[str, Any] = {
        "status": status,
        "overrides": run.overrides(),
        "seed": cfg.seed,
        "base_seeds": {"model": cfg.model.seed, "warmup": cfg.warmup.seed},
        "reproducible": not reasons,
        "inexact": reasons,
        "steps": train[-1]["step"] if train else 0,
        "wall_s": round(wall_s, 1),
        "wandb": wandb,
    }
    if reason is not None:
        summary["reason"] = reason
    if train:
        last = train[-LAST_STEPS:]
        summary["reward/last"] = sum(r["reward/mean"] for r in last) / len(last)
        summary["reward/last_steps"] = len(last)  # `reward/last` is the mean over these steps
        for key in ("throughput/tokens_per_s", "throughput/samples_per_s"):
            summary[f"{key}/mean"] = sum(r[key] for r in train) / len(train)
        for key in ("weights/update_bytes", "weights/full_bytes"):
            if key in train[-1]:
                summary[key] = train[-1][key]
    if evals:
        summary["eval/exact_match/first"] = evals[0]["eval/exact_match"]
        summary["eval/exact_match/last"] = evals[-1]["eval/exact_match"]
        summary["eval/reward/last"] = evals[-1]["eval/reward/mean"]
        best = max(evals, key=lambda r: r["eval/exact_match"])  # the earliest of equals
        summary["eval/exact_match/best"] = best["eval/exact_match"]
        summary["eval/best_version"] = best["step"]  # its weights: model.path=<run>/step_N
        if "eval/pass_at_k" in evals[-1]:
            summary["eval/pass_at_k/last"] = evals[-1]["eval/pass_at_k"]
        for option in eval_options(evals[-1]):  # eval.environments'
            summary[f"eval/{option}/exact_match/last"] = evals[-1][f"eval/{option}/exact_match"]
    return summary


PLAIN = re.compile(r"^[\w/.@:+~-]*$")
SHELL_SAFE_IN_DOUBLE_QUOTES = re.compile(r'^[^"$`\\\'!]*$')


def override(key: str, value: Any) -> str:
    """`key=value` as typed into a shell for `rl`: where the value holds characters Hydra's
    override grammar would parse (the `=` and `,` of a sweep point's directory), it is quoted
    for Hydra, and that for the shell."""
    text = str(value)
    if PLAIN.match(text):
        return f"{key}={text}"
    if SHELL_SAFE_IN_DOUBLE_QUOTES.match(text):
        return f"\"{key}='{text}'\""
    return shlex.quote(f"{key}='{text}'")


def finish_run(
    cfg: DictConfig | RunConfig,
    run: RunDir,
    wall_s: float,
    wandb: str,
    status: str = "finished",
    reason: str | None = None,
) -> None:
    """Write summary.json, plot and, for a run that finished, print the eval result. A full
    disk raises rl/core/disk.py's DiskFull for the summary; the plot, written after it, is
    left out with a warning."""
    records = read_records(run.metrics)
    summary = summarize(cfg, run, records, wall_s, status, wandb, reason)
    write_atomic(run.summary, json.dumps(summary, indent=2))
    if records:
        try:
            with writing(run.reward_plot, partial=run.reward_plot):
                plot(records, run.reward_plot, plot_title(cfg.name, run))
        except DiskFull as full:
            print(f"warning: no reward plot: {full}", file=sys.stderr, flush=True)
    evals = sorted((r for r in records if is_eval(r)), key=lambda r: r["step"])
    if evals and status == "finished" and not cfg.max_steps:  # an eval alone (action=eval)
        last = evals[-1]
        print(
            f"done in {wall_s:.0f} s: eval of {cfg.model.path or cfg.model.name}: exact_match "
            f"{last['eval/exact_match']:.3f}, reward {last['eval/reward/mean']:.3f}"
            + "".join(f", {o} {last[f'eval/{o}/exact_match']:.3f}" for o in eval_options(last)),
            flush=True,
        )
    elif evals and status == "finished":
        print(
            f"done in {wall_s:.0f} s: eval exact_match {evals[0]['eval/exact_match']:.3f} "
            f"(version {evals[0]['step']}) -> {evals[-1]['eval/exact_match']:.3f} "
            f"(version {evals[-1]['step']}); plot {run.reward_plot}",
            flush=True,
        )
    train = [r for r in records if is_train(r)]
    update, full = (train[-1].get(k) if train else None for k in WEIGHT_BYTES)
    if update and full and update < full:
        print(
            f"weight updates moved {update / 1e6:.3f} MB each (the adapter), against "
            f"{full / 1e6:.3f} MB of full weights: {full / update:.1f}x fewer",
            flush=True,
        )
