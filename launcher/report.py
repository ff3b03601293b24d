"""End of a run: the reward/eval plot, the wandb run, and a summary for the terminal.

The local launcher and a Slurm run's control job both finish a run this way; it reads and
writes only the run directory (rl/rundir.py), so it imports no launcher module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rl.config import RunConfig
from rl.records import is_eval, is_train
from rl.rundir import RunDir, read_jsonl


def plot(records: list[dict], target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if is_train(r)]
    evals = [r for r in records if is_eval(r)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["reward/mean"] for r in train], label="train reward")
    ax.plot(
        [r["step"] for r in evals],
        [r["eval/reward/mean"] for r in evals],
        "o-",
        label="eval reward",
    )
    ax.plot(
        [r["step"] for r in evals], [r["eval/exact_match"] for r in evals], "s-", label="eval exact"
    )
    ax.set_xlabel("trainer step (policy version)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(target, dpi=100)
    plt.close(fig)


def log_wandb(cfg: DictConfig | RunConfig, run: RunDir, records: list[dict]) -> str:
    """Log the run's metrics to wandb: online with an API key, offline without one."""
    mode = cfg.wandb.mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    mode = os.environ.get("WANDB_MODE", mode)
    if mode == "disabled":
        return mode
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    # A role supervisor holds the typed RunConfig the run directory's config loads as.
    config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    wandb_run = wandb.init(
        project=cfg.wandb.project,
        group=cfg.wandb.group or sweep_group(),
        name=f"{cfg.name}-{run.root.name}",
        dir=str(run.root),
        mode=mode,
        config=config,  # type: ignore[arg-type]
    )
    # Eval lines can land after later train lines; wandb needs steps in order.
    for record in sorted(records, key=lambda r: r["step"]):
        numbers = {k: v for k, v in record.items() if isinstance(v, int | float)}
        wandb_run.log(numbers, step=record["step"])
    wandb_run.finish()
    return mode


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
    record), as does an eval of the same policy version."""
    latest: dict[tuple[bool, int], dict] = {}
    for record in read_jsonl(metrics):
        latest[(is_eval(record), record["step"])] = record
    return list(latest.values())


def finish_run(
    cfg: DictConfig | RunConfig, run: RunDir, records: list[dict], wall_s: float
) -> None:
    """Plot, log to wandb, write summary.json and print the eval result."""
    if records:
        plot(records, run.reward_plot)
    mode = log_wandb(cfg, run, records)
    evals = [r for r in records if is_eval(r)]
    summary = {"wall_s": round(wall_s, 1), "wandb": mode}
    if evals:
        summary["eval/exact_match/first"] = evals[0]["eval/exact_match"]
        summary["eval/exact_match/last"] = evals[-1]["eval/exact_match"]
    run.summary.write_text(json.dumps(summary, indent=2))
    if evals:
        print(
            f"done in {wall_s:.0f} s: eval exact_match {evals[0]['eval/exact_match']:.3f} "
            f"(version {evals[0]['step']}) -> {evals[-1]['eval/exact_match']:.3f} "
            f"(version {evals[-1]['step']}); plot {run.reward_plot}",
            flush=True,
        )
