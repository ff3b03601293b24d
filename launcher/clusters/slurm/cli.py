"""Slurm's command-line clients, and what a run directory records about a run's jobs.

Submission from the login node (launcher/clusters/slurm/submit.py) and each job's supervisor
(launcher/clusters/slurm/supervisor.py) both ask Slurm the same things: what the partitions hold,
each job's state (from the controller, or the accounting database once the controller has forgotten
the job), a node's address. Both also read the run's job ids and write why it ended. These live
here, below both, and call the Slurm clients (`scontrol`, `sinfo`, `squeue`, `sacct`, `sacctmgr`,
`scancel`) as a user would.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass

from launcher.errors import ConfigError
from rl.core.rundir import RunDir, write_atomic

# Job states after which a job will not run again (a requeued job passes through PENDING).
ENDED_BADLY = (
    "BOOT_FAIL",
    "CANCELLED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
)

SLURM_TIMEOUT_S = 60


def slurm(*args: str, check: bool = True) -> str:
    """Run a Slurm client command; its stdout, or ConfigError with what it printed."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    except FileNotFoundError:
        raise ConfigError(
            f"cluster=slurm: `{args[0]}` not found; submit from a Slurm login node "
            f"(nothing was started here)"
        ) from None
    except subprocess.TimeoutExpired:  # a daemon that hangs: as good as one that is down
        raise ConfigError(f"`{' '.join(args)}` did not answer in {SLURM_TIMEOUT_S} s") from None
    if check and done.returncode:
        message = (done.stderr or done.stdout).strip().splitlines()
        raise ConfigError(f"`{' '.join(args)}` failed: {message[-1] if message else done}")
    return done.stdout


# --- what the cluster has --------------------------------------------------------------------


def kill_wait_s() -> int | None:
    """Slurm's KillWait: seconds between a job's SIGTERM and its SIGKILL (None where
    `scontrol show config` does not say)."""
    try:
        config = slurm("scontrol", "show", "config")
    except ConfigError:
        return None
    found = re.search(r"^KillWait\s*=\s*(\d+)", config, re.MULTILINE)
    return int(found[1]) if found else None


@dataclass
class Partition:
    name: str
    default: bool
    nodes: int
    max_nodes: int | None
    max_time_min: float | None
    cpus: int
    mem_mb: int
    gpus: int


def partitions() -> dict[str, Partition]:
    """Every partition with the largest CPU, memory and GPU counts among its nodes."""
    found: dict[str, Partition] = {}
    for line in slurm("scontrol", "show", "partition", "-o").splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if "PartitionName" not in fields:
            continue
        name = fields["PartitionName"]
        max_nodes = fields.get("MaxNodes", "UNLIMITED")
        found[name] = Partition(
            name=name,
            default=fields.get("Default") == "YES",
            nodes=int(fields.get("TotalNodes", 0)),
            max_nodes=None if max_nodes == "UNLIMITED" else int(max_nodes),
            max_time_min=minutes(fields.get("MaxTime", "UNLIMITED")),
            cpus=0,
            mem_mb=0,
            gpus=0,
        )
    for line in slurm("sinfo", "-h", "-N", "-o", "%R|%c|%m|%G").splitlines():
        name, cpus, mem, gres = line.strip().split("|")
        part = found.get(name)
        if part is None:
            continue
        part.cpus = max(part.cpus, int(cpus.rstrip("+")))
        part.mem_mb = max(part.mem_mb, int(mem.rstrip("+")))
        part.gpus = max(part.gpus, _gpus(gres))
    return found


def minutes(limit: str) -> float | None:
    """A Slurm time limit in minutes (None for no limit), in any of Slurm's forms: `60`
    (minutes), `30:00`, `1:30:00`, `2-00:00:00`, `1-12` (days-hours)."""
    if limit in ("UNLIMITED", "INFINITE", "NONE"):
        return None
    days, _, clock = limit.rpartition("-")
    parts = [int(x) for x in clock.split(":")]
    if days:  # days-hours[:minutes[:seconds]]
        parts += [0] * (3 - len(parts))
    elif len(parts) < 3:  # minutes[:seconds]
        parts = [0, *parts, 0][:3] if len(parts) == 1 else [0, *parts]
    hours, mins, secs = parts
    return int(days or 0) * 1440 + hours * 60 + mins + secs / 60


def _gpus(gres: str) -> int:
    """GPUs in a node's Gres string such as `gpu:h100:8(S:0-1),shard:4` or `(null)`."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def sacctmgr_names(*args: str) -> set[str] | None:
    """Names sacctmgr lists, or None when the cluster keeps no accounting to ask."""
    out = subprocess.run(
        ["sacctmgr", "-n", "-P", *args], capture_output=True, text=True, timeout=60
    )
    if out.returncode:
        return None
    return {line.strip() for line in out.stdout.splitlines() if line.strip()}


def node_address(node: str) -> str:
    """The address other nodes reach `node` at (its NodeAddr; the name when unset)."""
    out = slurm("scontrol", "show", "node", "-o", node)
    match = re.search(r"\bNodeAddr=(\S+)", out)
    return match.group(1) if match else node


def hostnames(nodelist: str) -> list[str]:
    return slurm("scontrol", "show", "hostnames", nodelist).split()


# --- the run's jobs --------------------------------------------------------------------------


@dataclass
class JobState:
    state: str
    nodes: str
    elapsed: str
    reason: str


def job_states(ids: list[str]) -> dict[str, JobState]:
    """Each job's current state (a requeued job's newest run); a job neither source lists yet
    is left out.

    The controller (`squeue`) is asked first: it is the truth for every job it still holds,
    while the accounting database lags behind it (a job just submitted is not listed yet, and
    after a slurmdbd outage finished jobs still show as running). `sacct` answers for the jobs
    the controller has forgotten (MinJobAge after they end). ConfigError only when neither
    answers.
    """
    if not ids:
        return {}
    live = _controller_states(ids)
    rest = [job_id for job_id in ids if job_id not in (live or {})]
    if not rest:
        return live or {}
    try:
        past = _accounting_states(rest)
    except ConfigError:
        if live is None:
            raise
        past = {}
    return {**past, **(live or {})}


def _controller_states(ids: list[str]) -> dict[str, JobState] | None:
    """The jobs slurmctld still holds, ended ones included; None when it does not answer."""
    try:
        out = slurm("squeue", "-h", "-t", "all", "-j", ",".join(ids), "-o", "%i|%T|%N|%M|%r")
    except ConfigError as err:
        # squeue refuses a list of only forgotten ids; that is an answer, not an outage.
        return {} if "Invalid job id" in str(err) else None
    return _parse_states(out)


def _accounting_states(ids: list[str]) -> dict[str, JobState]:
    out = slurm(
        "sacct",
        "-n",
        "-P",
        "-X",
        "-j",
        ",".join(ids),
        "-o",
        "JobID,State,NodeList,Elapsed,Reason",
    )
    return _parse_states(out)


def _parse_states(out: str) -> dict[str, JobState]:
    """`id|state|nodes|elapsed|reason` lines, as both squeue and sacct are asked to print."""
    states = {}
    for line in out.splitlines():
        job_id, state, nodes, elapsed, reason = line.split("|", 4)
        states[job_id] = JobState(state, nodes, elapsed, reason)
    return states


def ended_badly(state: str) -> bool:
    return state.split()[0] in ENDED_BADLY


def ended(state: str) -> bool:
    """Whether a job in `state` will not run again, well or badly."""
    return state.split()[0] in (*ENDED_BADLY, "COMPLETED")


def write_jobs(run: RunDir, partition: str, ids: dict[str, str]) -> None:
    """Record the run's job ids by job name (atomically: every job reads them)."""
    write_atomic(run.jobs, json.dumps({"partition": partition, "jobs": ids}, indent=2))


def read_jobs(run: RunDir) -> dict[str, str]:
    """The run's job ids by job name ({} when it has none recorded)."""
    try:
        return json.loads(run.jobs.read_text())["jobs"]
    except FileNotFoundError:
        return {}


def cancel_run(run: RunDir, reason: str, job: str | None = None) -> None:
    """Record the reason and cancel every job of the run that is still queued or running."""
    run.record_failure(reason, job)
    ids = read_jobs(run)
    if ids:
        slurm("scancel", *ids.values(), check=False)
