"""What a run shows while it goes on: metrics.jsonl followed as the roles append to it, each
record logged to wandb as it appears, and a console line per warm-up stretch, step and eval.

One process tracks a run: the local launcher, or a Slurm run's control job. There is one wandb
run per Relay run; its id is kept in the run directory, so a resumed run (local or requeued)
logs on into the same wandb run. Every record goes to wandb against the `step` axis (the
policy version); warm-up records against `warmup/step`. Offline without `WANDB_API_KEY`,
online with one, off with `WANDB_MODE=disabled`; a crash leaves everything logged so far.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections.abc import Sequence
from typing import Any

from launcher.watch.report import exact_match_se
from rl.core.kinds import STEP_FIELDS, RecordKind, eval_options, kind_of
from rl.core.rundir import RunDir, read_jsonl, write_atomic

ETA_WINDOW = 20
QUIET_S = 60.0
"""After this long with nothing new to show, the console says what the run waits for."""
# A run that cannot learn says so: a warning once a condition has held this many steps in a row.
NO_SIGNAL_STEPS = 3  # no group of the batch's first round had signal (every group tied)
FLAT_REWARD_STEPS = 10  # the same mean reward, to the printed digits
CUT_BOUND = 0.3  # share of trained tokens whose gradient the loss clipped or masked
CUT_STEPS = 3
KL_BOUND = 1.0  # mismatch KL per token between the generating and the trained policy
KL_STEPS = 3
"""Steps the ETA's pace is taken over."""


class MetricsTail:
    """The complete lines appended to metrics.jsonl since the last `read`. How far it has
    read is kept in the run directory, so that whoever follows the run next (a resumed or
    requeued launch) starts where this one stopped."""

    def __init__(self, run: RunDir) -> None:
        self.metrics, self.mark = run.metrics, run.metrics_followed
        try:
            self.offset = int(self.mark.read_text())
        except (FileNotFoundError, ValueError):
            self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        if not self.metrics.exists():
            return []
        if self.metrics.stat().st_size < self.offset:  # a resumed trainer dropped records
            self.offset = self.metrics.stat().st_size
        with open(self.metrics, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        if complete:
            self.offset += len(complete)
            write_atomic(self.mark, str(self.offset))
        return [json.loads(line) for line in complete.splitlines()]


def wandb_mode(cfg: Any) -> str:
    mode = cfg.wandb.mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    return os.environ.get("WANDB_MODE", mode)


class Tracker:
    """The run's wandb run, logged to record by record."""

    def __init__(self, cfg: Any, run: RunDir, group: str | None = None) -> None:
        self.mode = wandb_mode(cfg)
        self.wandb_run: Any = None
        self.run = run
        if self.mode == "disabled":
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb
        from omegaconf import OmegaConf

        id_file = run.wandb_id
        if not id_file.exists():
            write_atomic(id_file, secrets.token_hex(6))
        # A Slurm job's supervisor holds the typed RunConfig the run directory loads as.
        config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
        self.wandb_run = wandb.init(
            project=cfg.wandb.project,
            group=cfg.wandb.group or group,
            name=f"{cfg.name}-{run.root.name}",
            id=id_file.read_text().strip(),
            resume="allow",
            dir=str(run.root),
            mode=self.mode,
            config=config,  # type: ignore[arg-type]
            settings=wandb.Settings(x_transaction_log_flush_interval=cfg.wandb.flush_s),
        )
        # Eval and rollout records arrive out of step order: each names its step instead.
        self.wandb_run.define_metric("step")
        self.wandb_run.define_metric("*", step_metric="step")
        self.wandb_run.define_metric("warmup/step")
        self.wandb_run.define_metric("warmup/*", step_metric="warmup/step")

    def log(self, record: dict[str, Any]) -> None:
        """Log one record; a wandb that fails (its service killed with a Slurm job, a full
        disk) stops tracking with a warning, never the run (metrics.jsonl has everything)."""
        if self.wandb_run is None:
            return
        numbers = {
            k: v
            for k, v in record.items()
            if isinstance(v, int | float)
            and not isinstance(v, bool)
            and k != "timestamp"
            and not k.startswith("at/")  # wall-clock times, for lining up roles
        }
        if kind_of(record) == RecordKind.warmup:
            numbers["warmup/step"] = numbers.pop("step")
        try:
            if kind_of(record) == RecordKind.eval:
                numbers |= self.completions(record["step"])
            self.wandb_run.log(numbers)
        except Exception as err:  # noqa: BLE001 - see above
            self.give_up(err)

    def completions(self, version: int) -> dict[str, Any]:
        """The eval's first completions (rollouts/eval_N.jsonl) as a wandb table, under
        `eval/completions`; none where the orchestrator kept none."""
        import wandb

        rows = read_jsonl(self.run.eval_samples(version))
        if not rows:
            return {}
        columns = ["version", "prompt", "answer", "completion", "reward", "exact"]
        table = wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
        return {"eval/completions": table}

    def finish(self, exit_code: int = 0) -> None:
        """End the wandb run and its service process now, not at exit (where a service that
        Slurm's SIGTERM already ended would leave a traceback in the job's log)."""
        if self.wandb_run is None:
            return
        try:
            self.wandb_run.finish(exit_code=exit_code)
        except Exception as err:  # noqa: BLE001 - as in `log`
            self.give_up(err)
        self.wandb_run = None
        teardown(exit_code)

    def give_up(self, err: Exception) -> None:
        """Stop tracking, and close the connection to wandb's service now: left to wandb's
        exit hook, a service that is gone prints a traceback as the process ends."""
        print(f"warning: wandb stopped logging ({err!r}); metrics.jsonl has every record")
        self.wandb_run, self.mode = None, f"{self.mode} (stopped: {type(err).__name__})"
        teardown(1)


def teardown(exit_code: int) -> None:
    """Close wandb's service connection (which also drops its exit hook), whatever state the
    service is in."""
    import wandb

    with contextlib.suppress(Exception):
        wandb.teardown(exit_code)


def duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Console:
    """One plain line per warm-up stretch, trainer step and eval (fit for a log file as much
    as a terminal): each step with its pace (tokens/s, ETA) and where its time went
    (generation, training, weight sync); each eval with its change and its noise."""

    def __init__(self, max_steps: int, fields: Sequence[str] = STEP_FIELDS) -> None:
        self.max_steps, self.fields = max_steps, tuple(fields)
        self.rollouts: dict[int, dict[str, Any]] = {}
        self.step_times: list[tuple[int, float]] = []  # (step, seen at) for the ETA
        self.last_eval: dict[str, Any] | None = None
        self.rewards: list[float] = []  # the last FLAT_REWARD_STEPS steps' mean rewards
        self.streaks: dict[str, int] = {}  # steps in a row each warning's condition held

    def line(self, record: dict[str, Any]) -> str | None:
        kind = kind_of(record)
        if kind == RecordKind.rollout:
            self.rollouts[record["step"]] = record
            return None
        if kind == RecordKind.warmup:
            return (
                f"warm-up {record['step']:>3}/{record['warmup/steps']}  "
                f"loss {record['warmup/loss']:.3f}  {duration(record['warmup/elapsed_s'])}"
            )
        if kind == RecordKind.eval:
            return self.eval_line(record)
        if kind == RecordKind.train:
            return self.step_line(record)
        return None

    def eta(self, step: int) -> str:
        self.step_times.append((step, time.monotonic()))
        window = self.step_times[-ETA_WINDOW:]
        if len(window) < 2 or window[-1][0] <= window[0][0]:
            return "ETA ?"
        per_step = (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])
        return f"ETA {duration(per_step * (self.max_steps - step))}"

    def step_line(self, r: dict[str, Any]) -> str:
        """The step's line: reward, loss, the share of the first round's groups with signal,
        the share of tokens the loss cut, pace and times; then any warning that the run is
        not learning."""
        rollout = self.rollouts.pop(r["step"], {})
        sync = r.get("time/weight_sync", 0.0) + rollout.get("time/weight_load", 0.0)
        times = [f"train {r.get('time/train', r['time/step']):.2f}s", f"sync {sync:.2f}s"]
        if rollout:
            times.insert(0, f"gen {rollout['time/generate']:.2f}s")
        signal = rollout.get("filter/first_round_signal")
        # A token the loss both clips and masks (GRPO's, GSPO's clip) counts once.
        cut = max(r.get("clipped_fraction", 0.0), r.get("masked_fraction", 0.0))
        parts = {
            "reward": f"reward {r['reward/mean']:.3f}",
            "loss": f"loss {r['loss']:+.4f}",
            "signal": "" if signal is None else f"signal {signal:.0%}",
            "clipped": f"clipped {cut:.0%}",
            "throughput": f"{r['throughput/tokens_per_s']:,.0f} tok/s",
            "times": "  ".join(times),
            "staleness": f"staleness {r['off_policy/staleness_max']}",
            "eta": self.eta(r["step"]),
        }
        shown = [parts[f] for f in self.fields if parts[f]]
        line = "  ".join([f"step {r['step']:>3}/{self.max_steps}", *shown])
        return "\n".join([line, *self.warnings(r, signal, cut)])

    def warnings(self, r: dict[str, Any], signal: float | None, cut: float) -> list[str]:
        """A line for each condition that has just held for its number of steps in a row."""
        rewards = self.rewards = [
            *self.rewards[-(FLAT_REWARD_STEPS - 1) :],
            round(r["reward/mean"], 3),
        ]
        held = {
            "signal": (signal == 0, NO_SIGNAL_STEPS,
                       "no group had signal: every group's samples scored alike, so every "
                       "advantage is zero and nothing is learned (sampling temperature, a "
                       "served length too short for the task, or a reward that never varies?)"),
            "reward": (len(rewards) == FLAT_REWARD_STEPS and len(set(rewards)) == 1, 1,
                       f"the mean reward has been {rewards[-1]:.3f} for {FLAT_REWARD_STEPS} steps"),
            "cut": (cut > CUT_BOUND, CUT_STEPS,
                    f"the loss clipped or masked {cut:.0%} of the tokens (over {CUT_BOUND:.0%}): "
                    "the policy moves further per step than its bounds allow (a lower "
                    "algorithm.lr?), or the bounds are narrower than the gap between the "
                    "inference engine's and the trainer's log-probabilities (GSPO's clip "
                    "range: docs/algorithms.md)"),
            "kl": (r.get("mismatch_kl", 0.0) > KL_BOUND, KL_STEPS,
                   f"the trained policy is {r.get('mismatch_kl', 0.0):.2f} nats per token (KL) "
                   f"from the one that generated its batch (over {KL_BOUND:g})"),
        }  # fmt: skip
        said = []
        for name, (now, steps, text) in held.items():
            self.streaks[name] = self.streaks.get(name, 0) + 1 if now else 0
            if self.streaks[name] == steps:
                run = f" for {steps} steps in a row" if steps > 1 else ""
                said.append(f"warning: {text}{run}")
        return said

    def eval_line(self, r: dict[str, Any]) -> str:
        """The exact match with its standard error over the held-out prompts, and the change
        since the previous eval, so that a drop within the noise reads as such."""
        exact, n = r["eval/exact_match"], max(r.get("eval/samples", 1), 1)
        noise = exact_match_se(r)
        change = ""
        if self.last_eval is not None:
            delta = exact - self.last_eval["eval/exact_match"]
            change = f" ({delta:+.3f} since version {self.last_eval['step']})"
        self.last_eval = r
        sampled = f"  pass@{r['eval/k']} {r['eval/pass_at_k']:.3f}" if "eval/k" in r else ""
        others = "".join(f"  {option} {r[f'eval/{option}/exact_match']:.3f}"
                         for option in eval_options(r))  # fmt: skip
        return (
            f"eval  @ version {r['step']:>3}: exact_match {exact:.3f} ±{noise:.3f} of {n}"
            f"{change}  reward {r['eval/reward/mean']:.3f}{sampled}{others}"
        )


def waiting_line(run: RunDir, quiet_s: float) -> str:
    """One line on what a run that has said nothing for `quiet_s` seconds waits for: the
    batch the orchestrator is filling (rundir `generating`), its fill round, its groups with
    signal so far and what it dropped, and whether the trainer waits for a batch."""
    try:
        at = json.loads(run.generating.read_text())
    except (OSError, ValueError):
        return f"nothing new for {quiet_s:.0f} s: no batch is being generated yet"
    try:
        trainer = f"; the trainer waits for batch {int(run.trainer_waiting.read_text())}"
    except (OSError, ValueError):
        trainer = ""
    return (
        f"nothing new for {quiet_s:.0f} s: batch {at['batch']} is in fill round {at['round']} "
        f"(for {time.time() - at['since']:.0f} s, {at['episodes']} episodes): "
        f"{at['with_signal']} of {at['want']} groups with signal so far, {at['tied']} dropped "
        f"without signal (every sample scored alike) and {at['failed']} episodes that failed "
        f"or timed out (the orchestrator's log names them){trainer}"
    )


class Follow:
    """Follows a run's metrics: logs each new record to wandb and, with `echo`, prints its
    console line. `poll` often while the run goes on; `close` once it has ended."""

    def __init__(
        self, cfg: Any, run: RunDir, echo: bool, group: str | None = None, prefix: str = ""
    ) -> None:
        self.tail = MetricsTail(run)
        self.console = Console(cfg.max_steps, cfg.console.fields)
        self.echo, self.prefix = echo, prefix  # prefix: whose line it is (a sweep's point)
        self.tracker = Tracker(cfg, run, group)
        self.run = run
        self.said_at = time.monotonic()  # when the console last said something of the run

    def poll(self) -> None:
        for record in self.tail.read():
            self.tracker.log(record)
            text = self.console.line(record)
            if text:
                self.said_at = time.monotonic()
            if text and self.echo:
                print(self.prefix + text, flush=True)
        quiet = time.monotonic() - self.said_at
        if self.echo and quiet > QUIET_S:
            self.said_at = time.monotonic()
            print(self.prefix + waiting_line(self.run, quiet), flush=True)

    def close(self, exit_code: int = 0) -> str:
        """Log what is left and end the wandb run (also when what is left cannot be followed:
        a full disk); returns its mode."""
        try:
            self.poll()
        finally:
            self.tracker.finish(exit_code)
        return self.tracker.mode
