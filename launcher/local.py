"""The local launcher: every role a child process in its own process group on this machine.

It writes the run directory, starts the roles from the plan, waits for each server to be
ready, shows progress from metrics.jsonl, and tears everything down together: on success, on
Ctrl-C, and as soon as any role dies (naming it and showing its last log lines). Only our own
process groups are signalled, by id.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from launcher.plan import RunPlan
from rl.runtime import die_with_parent

READY_TIMEOUT_S = 600.0
STOP_GRACE_S = 5.0
FINISHING_ROLES = ("trainer", "orchestrator")


class RunFailed(RuntimeError):
    """A role died or never became ready; the message names it."""


@dataclass
class Child:
    name: str
    role: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0

    def restart(self) -> None:
        """Start the role again with the same command (appending to its log)."""
        self.log_file.close()
        again = spawn(self.name, self.role, self.argv, self.env, self.log_path)
        self.proc, self.log_file = again.proc, again.log_file
        self.restarts += 1


def restart_or_fail(child: Child, code: int, max_restarts: int) -> None:
    """Restart a role that died, or raise RunFailed once it has used its restarts."""
    if child.restarts >= max_restarts:
        after = f" after {child.restarts} restart(s)" if child.restarts else ""
        raise RunFailed(
            f"role {child.name} exited with code {code}{after}; last lines of "
            f"{child.log_path}:\n{tail(child.log_path)}"
        )
    print(
        f"role {child.name} exited with code {code}: restarting it "
        f"({child.restarts + 1} of {max_restarts})",
        file=sys.stderr,
        flush=True,
    )
    with open(child.log_path, "ab") as log:
        log.write(f"--- exited with code {code}; restarting ---\n".encode())
    child.restart()


def prepare_run_dir(cfg: DictConfig, run_plan: RunPlan) -> tuple[Path, str]:
    run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    (run_dir / "plan.json").write_text(run_plan.to_json())
    token = secrets.token_hex(16)
    fd = os.open(run_dir / "token", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return run_dir, token


def expand(argv: list[str], values: dict[str, str]) -> list[str]:
    """The plan's argv with `${NAME}` placeholders filled in and `python` this interpreter."""
    out = []
    for arg in argv:
        for key, value in values.items():
            arg = arg.replace(f"${{{key}}}", value)
        out.append(sys.executable if arg == "python" else arg)
    return out


def spawn(name: str, role: str, argv: list[str], env: dict[str, str], log_path: Path) -> Child:
    """Start one role in its own process group (so teardown reaches its children), logging to
    `log_path`. SIGUSR2 is ignored: Slurm sends it to every process of a job before its time
    limit, and only the job's supervisor acts on it."""
    log_file = open(log_path, "ab")  # noqa: SIM115 - closed in stop_children
    proc = subprocess.Popen(
        argv,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**env, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
        preexec_fn=_child_setup,
    )
    return Child(name, role, proc, log_path, log_file, argv, env)


def _child_setup() -> None:
    """In the child before exec: ignore SIGUSR2, and get SIGTERM if the launcher dies (killed
    outright it cannot stop its roles, which would otherwise run on as orphans)."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    die_with_parent(signal.SIGTERM)


def start_children(run_plan: RunPlan, run_dir: Path, token: str) -> list[Child]:
    children = []
    for spec in run_plan.processes:
        env = {**os.environ, **spec.env, "RELAY_TOKEN": token, "RELAY_RUN_DIR": str(run_dir)}
        log_path = run_dir / "logs" / f"{spec.name}.log"
        children.append(
            spawn(
                spec.name,
                spec.role,
                expand(spec.argv, {"RELAY_RUN_DIR": str(run_dir)}),
                env,
                log_path,
            )
        )
    write_pids(run_dir, children)
    return children


def read_pids(run_dir: Path) -> dict[str, int]:
    try:
        return json.loads((run_dir / "pids.json").read_text())
    except FileNotFoundError:
        return {}


def group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is in process group `pgid`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def write_pids(run_dir: Path, children: list[Child]) -> None:
    """Each child leads its own process group (pgid == pid): recorded for audits, tests, and
    to refuse resuming a run that is still running."""
    pids = {c.name: c.proc.pid for c in children}
    tmp = run_dir / ".pids.json.tmp"
    tmp.write_text(json.dumps(pids))
    tmp.rename(run_dir / "pids.json")


def stop_children(children: list[Child]) -> None:
    """SIGTERM each child's process group, then SIGKILL what is left after a grace period."""
    for child in children:
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _signal_group(child, signal.SIGKILL)
        child.proc.wait()
        child.log_file.close()


def _signal_group(child: Child, sig: signal.Signals) -> None:
    try:
        os.killpg(child.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(f"    {line}" for line in text[-lines:])


def check_children(children: list[Child], done: set[str], max_restarts: int = 0) -> bool:
    """Restart roles that died (a server exiting at all counts), within `max_restarts` each;
    returns whether any was restarted. Raises RunFailed for a role out of restarts.

    Every role found dead is named: a killed server can take its clients down with it, and the
    launcher may see both at once. Roles ended by a signal are listed first (the likely cause),
    with the last lines of the first one's log.
    """
    failed = []
    for child in children:
        code = child.proc.poll()
        if code is None or child.name in done:
            continue
        if code == 0 and child.role in FINISHING_ROLES:
            done.add(child.name)
            continue
        failed.append((child, code))
    if not failed:
        return False
    failed.sort(key=lambda item: item[1] >= 0)  # signal deaths (negative codes) first
    spent = [(c, code) for c, code in failed if c.restarts >= max_restarts]
    if spent:
        first = spent[0][0]
        names = "; ".join(
            f"role {c.name} exited with code {code}"
            + (f" after {c.restarts} restart(s)" if c.restarts else "")
            for c, code in failed
        )
        raise RunFailed(f"{names}; last lines of {first.log_path}:\n{tail(first.log_path)}")
    for child, code in failed:
        restart_or_fail(child, code, max_restarts)
    return True


class Progress:
    """Prints one line per trainer step and per eval from metrics.jsonl as they appear."""

    def __init__(self, metrics: Path, max_steps: int) -> None:
        self.metrics, self.max_steps = metrics, max_steps
        self.offset = 0
        self.last_eval: float | None = None
        self.records: list[dict] = []

    def skip_existing(self) -> None:
        """Show only what is recorded from now on (a resumed run's history is on disk)."""
        if self.metrics.exists():
            self.offset = self.metrics.stat().st_size

    def poll(self) -> None:
        if not self.metrics.exists():
            return
        if self.metrics.stat().st_size < self.offset:  # a resumed trainer dropped records
            self.offset = self.metrics.stat().st_size
        with open(self.metrics) as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self.offset += len(complete)
        for line in complete.splitlines():
            record = json.loads(line)
            self.records.append(record)
            print(self.format(record), flush=True)

    def format(self, r: dict) -> str:
        if "eval/exact_match" in r:
            self.last_eval = r["eval/exact_match"]
            return (
                f"eval  @ version {r['step']:>3}: exact_match {r['eval/exact_match']:.3f}  "
                f"reward {r['eval/reward/mean']:.3f}"
            )
        return (
            f"step {r['step']:>3}/{self.max_steps}  reward {r['reward/mean']:.3f}  "
            f"loss {r['loss']:+.4f}  samples/s {r['throughput/samples_per_s']:.0f}  "
            f"staleness {r['off_policy/staleness_max']}  step {r['time/step']:.2f}s"
        )


def wait_ready(run_plan: RunPlan, run_dir: Path, children: list[Child]) -> None:
    servers = ["queue"] + [p.name for p in run_plan.role("inference")]
    deadline = time.monotonic() + READY_TIMEOUT_S
    for name in servers:
        while not (run_dir / "addresses" / f"{name}.json").exists():
            check_children(children, set())
            if time.monotonic() > deadline:
                raise RunFailed(f"role {name} did not become ready in {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.1)
        print(f"ready: {name}", flush=True)


def run_local(cfg: DictConfig, run_plan: RunPlan, resume: Path | None = None) -> None:
    """Start every role of the plan here and supervise it to the end; with `resume`, continue
    the run in that directory (each role picks up from its own state there)."""
    if resume is None:
        run_dir, token = prepare_run_dir(cfg, run_plan)
    else:
        run_dir, token = resume, (resume / "token").read_text().strip()
    print(f"run directory: {run_dir}", flush=True)
    t0 = time.monotonic()
    progress = Progress(run_dir / "metrics.jsonl", cfg.max_steps)
    if resume is not None:
        progress.skip_existing()
    children = start_children(run_plan, run_dir, token)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        wait_ready(run_plan, run_dir, children)
        done: set[str] = set()
        finishing = {c.name for c in children if c.role in FINISHING_ROLES}
        while done != finishing:
            if check_children(children, done, cfg.max_restarts):
                write_pids(run_dir, children)
            progress.poll()
            time.sleep(0.2)
        progress.poll()
    except KeyboardInterrupt:
        print("interrupted: stopping every role", file=sys.stderr, flush=True)
        stop_children(children)
        raise SystemExit(130) from None
    except RunFailed as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        stop_children(children)
        raise SystemExit(1) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    stop_children(children)
    wall = time.monotonic() - t0
    from launcher.report import finish_run, read_records

    finish_run(cfg, run_dir, read_records(run_dir / "metrics.jsonl"), wall)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
