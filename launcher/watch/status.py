"""`rl action=status`: how a run stands (its state, jobs, latest step with an ETA, last eval and
wall time) and where its logs, plot and summary are.

It reads the run directory alone, without Hydra, the schema, numpy or torch, so that `cli.py`
answers `rl action=status [run_dir=<dir>]` before composing anything (`fast_status`): in a
fraction of a second, where composing the config alone takes seconds. Any other command line
with `action=status` is composed by Hydra and ends in the same `status`.
"""

from __future__ import annotations

import json
import pwd
import re
import sys
from pathlib import Path
from typing import Any

from launcher.clusters.run_dir import running_roles
from launcher.clusters.slurm.cli import JobState, job_states, read_jobs
from launcher.errors import ConfigError
from launcher.watch.report import LAST_STEPS, override, read_records, read_summary
from launcher.watch.tracking import ETA_WINDOW, duration
from rl.core.kinds import is_eval, is_train
from rl.core.paths import CONF
from rl.core.rundir import CONFIG, RunDir

STATUS = "action=status"
PLAIN_VALUE = re.compile(r"^[\w/.@:+~-]+$|^'[^'\\]*'$|^\"[^\"\\]*\"$")
"""A `run_dir=` value Hydra's override grammar reads as itself (quotes stripped)."""


def fast_status(argv: list[str]) -> bool:
    """Answer `rl action=status [run_dir=<dir>]` without Hydra and return True; False for
    any other command line (Hydra composes it). A run that cannot be found ends in one line."""
    given = [arg for arg in argv if arg != STATUS]
    if STATUS not in argv or len(given) > 1:
        return False
    run_dir = None
    if given:
        key, _, value = given[0].partition("=")
        if key != "run_dir" or not PLAIN_VALUE.match(value) or value == "null":
            return False
        run_dir = value.strip("'\"")
    if run_dir and RunDir(Path(run_dir)).kubernetes.exists():
        return False  # its state is the cluster's: asked through the API (launcher/run.py)
    try:
        status(run_dir, outputs_folder())
    except ConfigError as err:
        sys.stderr.write(f"error: {err}\n")
        sys.exit(2)
    return True


def outputs_folder() -> Path:
    """The folder runs are written under: the run directory conf/config.yaml names
    (`outputs/${name}/${now:...}`), two levels up, from here."""
    import yaml

    template = yaml.safe_load((CONF / "config.yaml").read_text())["hydra"]["run"]["dir"]
    return Path.cwd() / Path(template).parent.parent


def find_run(run_dir: str | None, outputs: Path) -> RunDir:
    """The run `run_dir` names, or the newest run of any name under `outputs`."""
    if run_dir:
        run = RunDir(Path(run_dir))
        if not run.config.exists():
            raise ConfigError(f"run_dir={run_dir}: not a run directory (no {CONFIG})")
        return run
    runs = [RunDir(p.parent) for p in outputs.glob(f"**/{CONFIG}")]
    if not runs:
        raise ConfigError(f"no run found under {outputs}; pass run_dir=")
    return max(runs, key=lambda run: run.config.stat().st_mtime)


def status(run_dir: str | None, outputs: Path) -> None:
    """The run's status; for a sweep directory, its comparison table (written anew)."""
    if run_dir and not RunDir(Path(run_dir)).config.exists():
        from launcher.sweeps.summary import write_sweep_summary

        table = write_sweep_summary(Path(run_dir))
        if table is not None:
            print(table.read_text())
            return
    print(format_status(find_run(run_dir, outputs)))


def _newest(records: list[dict]) -> dict | None:
    return max(records, key=lambda r: r["step"]) if records else None


def run_state(run: RunDir) -> str:
    """running, finished, failed, interrupted (nothing of it alive and no end recorded); for a
    Slurm run also cancelled, and queued while its jobs have not started."""
    if run.complete.exists():
        return "finished"
    ids = read_jobs(run)
    if ids:
        reason = run.failure_reason()
        if reason is not None:
            return "cancelled" if reason.startswith("cancelled") else "failed"
        try:
            states = [s.state.split()[0] for s in job_states(list(ids.values())).values()]
        except ConfigError:
            return "submitted"
        return "running" if "RUNNING" in states else "queued" if states else "submitted"
    if running_roles(run):
        return "running"
    return read_summary(run).get("status", "interrupted")


def eta(train: list[dict], max_steps: int) -> str:
    """Time left at the pace of the last steps recorded (their timestamps)."""
    last = sorted(train, key=lambda r: r["step"])[-ETA_WINDOW:]
    if len(last) < 2 or last[-1]["step"] <= last[0]["step"]:
        return ""
    pace = (last[-1]["timestamp"] - last[0]["timestamp"]) / (last[-1]["step"] - last[0]["step"])
    return f", ETA {duration(pace * (max_steps - last[-1]['step']))}"


def max_steps(run: RunDir) -> int:
    """The steps the run is to train (its resolved config, read as plain YAML)."""
    import yaml

    return int(yaml.safe_load(run.config.read_text())["max_steps"])


def format_status(run: RunDir) -> str:
    """The run's state, jobs, latest step and eval, wall time, how it ended, and where its
    logs, plot and summary are, for `action=status`."""
    state = run_state(run)
    jobs = read_jobs(run)
    lines = [f"run {run.root}: {state}", *_job_lines(jobs), *_attempt_lines(run)]
    records = read_records(run.metrics)
    train = [r for r in records if is_train(r)]
    lines += _progress_lines(run, train, _newest([r for r in records if is_eval(r)]), state)
    if run.complete.exists():
        lines.append("  complete")
    reason = run.failure_reason()
    if reason is not None:
        lines.append(f"  ended: {reason}")
    if state in ("interrupted", "failed", "stopped") and not jobs:
        lines.append(f"  resume at {run.resume_point()}: uv run rl {override('resume', run.root)}")
    lines.append(f"  logs: {run.logs}/")
    if jobs:
        lines.append(f"  job logs: {run.slurm}/<job>/<id>_0_log.out")
    for name, path in (("plot", run.reward_plot), ("summary", run.summary)):
        if path.exists():
            lines.append(f"  {name}: {path}")
    return "\n".join(lines)


def _progress_lines(
    run: RunDir, train: list[dict], evaluation: dict | None, state: str
) -> list[str]:
    """The latest step (with an ETA while running), the latest eval and the wall time."""
    lines = []
    newest = _newest(train)
    if newest:
        steps = max_steps(run)
        pace = eta(train, steps) if state == "running" else ""
        # The step's own reward, and the mean summary.json's `reward/last` holds.
        last = sorted(train, key=lambda r: r["step"])[-LAST_STEPS:]
        mean = sum(r["reward/mean"] for r in last) / len(last)
        lines.append(
            f"  latest step {newest['step']}/{steps}: reward {newest['reward/mean']:.3f} (mean "
            f"of the last {len(last)} steps {mean:.3f}){pace}"
        )
    else:
        lines.append("  no trainer step yet")
    if evaluation:
        lines.append(
            f"  latest eval at version {evaluation['step']}: exact_match "
            f"{evaluation['eval/exact_match']:.3f}"
        )
    wall = wall_time(run)
    if wall is not None:
        lines.append(f"  wall time {duration(wall)}{' so far' if state == 'running' else ''}")
    return lines


def wall_time(run: RunDir) -> float | None:
    """Seconds the run has run over all its launches: the summary's once it has ended, else
    what the launcher last saved (None: neither yet)."""
    summary: dict[str, Any] = read_summary(run)
    if "wall_s" in summary:
        return float(summary["wall_s"])
    try:
        return float(run.wall_time.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _job_lines(ids: dict[str, str]) -> list[str]:
    """A table of the jobs' states (none for no jobs); when Slurm cannot say, that, and the
    rest of the status still shows."""
    if not ids:
        return []
    try:
        states = job_states(list(ids.values()))
    except ConfigError as err:
        return [f"  job states unavailable: {err}"]
    lines = [f"  {'job':<10} {'id':>7}  {'state':<30} {'elapsed':>9}  nodes"]
    for name, job_id in ids.items():
        s = states.get(job_id, JobState("UNKNOWN", "", "", ""))
        lines.append(f"  {name:<10} {job_id:>7}  {shown_state(s):<30} {s.elapsed:>9}  {s.nodes}")
    return lines


def shown_state(s: JobState) -> str:
    """The state as a person reads it: who cancelled by name, not uid, and the reason only
    while it still holds (Slurm keeps the last pending reason, JobHeldUser from the held
    submission, on jobs long since run)."""
    words = s.state.split()
    if len(words) == 3 and words[1] == "by" and words[2].isdigit():
        try:
            words[2] = pwd.getpwuid(int(words[2])).pw_name
        except KeyError:
            pass
    state = " ".join(words)
    pending = words[0] in ("PENDING", "REQUEUED", "SUSPENDED", "CONFIGURING")
    return f"{state} ({s.reason})" if pending and s.reason not in ("None", "") else state


def _attempt_lines(run: RunDir) -> list[str]:
    """The jobs of the run's earlier submissions (a resumed run's), each with its end."""
    lines = []
    for path in sorted(run.ended.glob("jobs-*.json")):
        attempt = path.stem.removeprefix("jobs-")
        ids = json.loads(path.read_text())["jobs"]
        failure = run.ended / f"failure-{attempt}.json"
        why = json.loads(failure.read_text())["reason"] if failure.exists() else "resubmitted"
        lines.append(f"  earlier submission {attempt}: {why}")
        lines += ["  " + line for line in _job_lines(ids)]
    return lines
