"""Relay against TRL's GRPOTrainer on this machine: time to a held-out score, over seeds.

Both systems train Relay's tiny model on one task (reverse_text unless an override picks another
environment) for `--steps` optimiser steps of prompts_per_step x group_size samples, the
environment's max_tokens, temperature 1, the run's learning rate (constant), AdamW betas
(0.9, 0.99), gradient clipping at 1.0, no KL term, from the same weights: Relay's supervised
warm-up (`warmup.*`, as in rl/trainer/loop.py) is run once here and saved; Relay gets
`model.path=<those weights> warmup.steps=0` and TRL loads the same directory.

- Relay runs as the real `rl` command (its defaults: split placement, async_level 1, its loss),
  keeping every published version so that each is scored afterwards.
- TRL runs `GRPOTrainer` in a process of its own with both cores (OMP_NUM_THREADS=2), generating
  with transformers. Its loss is `dapo` (token-level, Relay's `token` normalisation) with
  `scale_rewards="none"` (Relay's `group_mean` advantages); with one optimiser step per
  generation batch it is on-policy. A callback scores it every `--eval-every` steps; that time
  is taken out of TRL's clock.

Both are scored by one function (greedy held-out exact match over the environment's eval
prompts, decoded as Relay's embedded engine decodes) at the same trained-sample counts. Two
clocks, scoring time excluded from both:
- the RL loop's: Relay from its trainer's first step (less the version-0 eval its server runs
  meanwhile), TRL from `train()`'s start;
- the user's: from the command (`rl`; TRL's worker script) to the same points, start-up
  included: the RL clock plus each run's start-up (Relay: the command to its trainer's first
  step; TRL: the command to `train()`'s start, less the benchmark's scoring of the start).

Fairness under noise: the seeds run interleaved (A B, then B A, ...), each run in a process of
its own; for each run the script records its CPU time and the CPU time the rest of the machine
used meanwhile (/proc/stat), and a seed whose runs shared the machine with more than
`--max-other-load` cores of other work is flagged and left out of the summary.

    uv run --group bench python benchmarks/trl_comparison.py [--steps 300] [--seeds 3]
        [--first-seed 0]
        [--variant LABEL="OVERRIDE ..."] [--no-trl] [overrides for both sides ...]

`--variant` adds Relay runs with extra overrides (the ablations); `--no-trl` leaves TRL out.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from rl.core.derive import learning_rate
from rl.core.kinds import is_eval, is_train
from rl.core.model import ensure_checkpoint, load_model, load_tokenizer
from rl.core.rundir import RunDir, mark_complete
from rl.envs import Environment, make_environment
from rl.inference.generation import generate
from rl.trainer.batches import sft_batch, token_logprobs
from tests.support.runs import ROOT, compose_run

TRL = "trl"
RELAY = "relay"


def warm_up(cfg: DictConfig, target: Path) -> Path:
    """Relay's supervised warm-up (rl/trainer/loop.py `Trainer.warmup`, one process), saved to
    target in HF layout: the weights both systems start RL from."""
    base = ensure_checkpoint(cfg.model)
    model, tokenizer = load_model(base, dtype=cfg.model.dtype), load_tokenizer(base)
    examples = make_environment(cfg.environment).train_examples()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.warmup.lr)
    picker = torch.Generator().manual_seed(cfg.seed + 1)
    for _ in range(cfg.warmup.steps):
        picks = torch.randint(len(examples), (cfg.warmup.batch_size,), generator=picker).tolist()
        ids, attention, completion = sft_batch(tokenizer, [examples[i] for i in picks])
        logp, _ = token_logprobs(model, ids, attention)
        loss = -(logp * completion).sum() / completion.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    mark_complete(target)
    return target


def exact_match(model: Any, tokenizer: Any, env: Environment, max_tokens: int) -> float:
    """Greedy held-out exact match, decoded the way Relay's inference server decodes."""
    examples = env.eval_examples()
    prompts = [
        [tokenizer.bos_token_id, *tokenizer.encode(e.prompt, add_special_tokens=False)]
        for e in examples
    ]
    was_training = model.training
    model.eval()
    samples = generate(model, tokenizer, prompts, max_tokens, 0.0)
    model.train(was_training)
    texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
    hits = [env.exact_match(e, t) for e, t in zip(examples, texts, strict=True)]
    return sum(hits) / len(hits)


@dataclass
class Run:
    """One system's run at one seed: its score curve and what it cost."""

    label: str
    seed: int
    curve: list[tuple[int, float, float]] = field(default_factory=list)
    """(trained samples, RL seconds, held-out exact match), from version 0."""
    generated: int = 0
    wall_s: float = 0.0
    started: float = 0.0
    """Wall clock (time.time()) when its command was started."""
    startup_s: float = 0.0
    """Seconds from the command to the RL clock's start (the user's clock less the RL's)."""
    cpu_s: float = 0.0
    other_cores: float = 0.0
    """Mean cores of other work on the machine while this run ran."""
    profile: dict[str, float] = field(default_factory=dict)
    """Seconds per phase over the RL loop."""

    @property
    def final(self) -> float:
        return self.curve[-1][2]

    @property
    def rl_s(self) -> float:
        return self.curve[-1][1]

    def time_to(self, target: float) -> float | None:
        """RL seconds at the first scored point at or above target (None: never reached)."""
        return next((t for _, t, score in self.curve if score >= target - 1e-9), None)

    def user_time_to(self, target: float) -> float | None:
        """The same on the user's clock: from the command, start-up included."""
        seconds = self.time_to(target)
        return None if seconds is None else self.startup_s + seconds

    @property
    def user_s(self) -> float:
        """The user's clock at the last scored point: start-up and every step."""
        return self.startup_s + self.rl_s

    def score_at_time(self, seconds: float) -> float:
        """The score of the newest point scored by `seconds` of RL."""
        return [score for _, t, score in self.curve if t <= seconds][-1]


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measured(run: Run, cmd: list[str], env: dict[str, str]) -> None:
    """Run cmd to completion, filling in run's wall, CPU and other-load figures."""
    busy0, cpu0, t0 = machine_busy_s(), children_cpu_s(), time.perf_counter()
    run.started = time.time()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    run.wall_s = time.perf_counter() - t0
    run.cpu_s = children_cpu_s() - cpu0
    run.other_cores = max(0.0, machine_busy_s() - busy0 - run.cpu_s) / run.wall_s
    if out.returncode != 0:
        raise SystemExit(f"{run.label} run (seed {run.seed}) failed:\n{out.stderr[-3000:]}")


def run_relay(
    cfg: DictConfig, start: Path, run: Run, run_dir: Path, every: int, overrides: list[str]
) -> Run:
    """The real `rl` command from the warmed-up weights; every `every`-th version scored after."""
    steps = cfg.max_steps
    cmd = [
        sys.executable, "-m", "launcher.cli", f"hydra.run.dir={run_dir}", f"seed={run.seed}",
        "warmup.steps=0", f"model.path={start}", f"environment.eval_every={steps}",
        f"trainer.keep_weights={steps + 1}", *overrides,
    ]  # fmt: skip
    measured(run, cmd, {**os.environ, "WANDB_MODE": "disabled"})
    layout = RunDir(run_dir)
    records = layout.read_metrics()
    train = sorted(filter(is_train, records), key=lambda r: r["step"])
    rollouts = [r for r in records if r.get("kind") == "rollout"]
    eval0 = next(r for r in records if is_eval(r) and r["step"] == 0)["time/eval"]
    # The eval at version 0 runs on the inference server while the first step waits for it.
    begin = train[0]["timestamp"] - train[0]["time/step"]
    run.startup_s = begin - run.started
    clock = {r["step"]: r["timestamp"] - begin - eval0 for r in train}
    trained = {0: 0}
    for r in train:
        trained[r["step"]] = trained[r["step"] - 1] + r["samples"]
    env = make_environment(cfg.environment)
    tokenizer = load_tokenizer(start)
    for version in [*range(0, steps, every), steps]:
        model = load_model(layout.weights_for(version), dtype=cfg.model.dtype)
        score = exact_match(model, tokenizer, env, cfg.environment.max_tokens)
        run.curve.append((trained[version], clock.get(version, 0.0), score))
    run.generated = sum(r["samples/generated"] for r in rollouts)  # every round's completions
    run.profile = {
        "trainer: train": sum(r["time/train"] for r in train),
        "trainer: wait for batch": sum(r["time/wait_batch"] for r in train),
        "trainer: publish weights": sum(r["time/weight_sync"] for r in train),
        "inference: generate": sum(r["time/generate"] for r in rollouts),
        "inference: load weights": sum(r["time/weight_load"] for r in rollouts),
        "start-up and end (not RL)": run.wall_s - run.rl_s,
    }
    return run


def trl_worker(spec_path: Path) -> None:
    """In its own process: TRL's GRPOTrainer from the warmed-up weights, scored every `every`
    steps by a callback whose time is taken out of the clock; writes the curve as JSON."""
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(spec_path.read_text())
    cfg = compose_run(*spec["overrides"])
    start, every, steps = Path(spec["start"]), spec["every"], cfg.max_steps
    env_cfg = cfg.environment
    env = make_environment(env_cfg)
    tokenizer = load_tokenizer(start)
    model = load_model(start, dtype=cfg.model.dtype)
    examples = env.train_examples()
    # The char tokenizer adds no specials by itself; Relay's server prepends BOS to every prompt.
    dataset = Dataset.from_dict(
        {
            "prompt": [tokenizer.bos_token + e.prompt for e in examples],
            "index": list(range(len(examples))),
        }
    )
    scored = [0]

    def task_reward(completions: list[str], index: list[int], **_: Any) -> list[float]:
        scored[0] += len(completions)
        return [env.reward(examples[i], c) for c, i in zip(completions, index, strict=True)]

    batch = env_cfg.prompts_per_step * env_cfg.group_size
    clock = {"start": 0.0, "paused": 0.0, "generate": 0.0, "step": 0.0}
    curve: list[tuple[int, float, float]] = []

    class HeldOut(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock["start"] = time.perf_counter()
            clock["start_wall"] = time.time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            step = state.global_step
            if step % every and step != steps:
                return
            now = time.perf_counter()
            with torch.random.fork_rng(devices=[]):  # scoring must not move TRL's sampling
                score = exact_match(kw["model"], tokenizer, env, env_cfg.max_tokens)
            curve.append((step * batch, now - clock["start"] - clock["paused"], score))
            clock["paused"] += time.perf_counter() - now

    args = GRPOConfig(
        output_dir=spec["output_dir"],
        max_steps=steps,
        per_device_train_batch_size=batch,  # one optimiser step per generation batch
        gradient_accumulation_steps=1,
        num_generations=env_cfg.group_size,
        max_completion_length=env_cfg.max_tokens,
        temperature=cfg.algorithm.temperature,
        learning_rate=learning_rate(cfg),
        lr_scheduler_type="constant",
        adam_beta1=cfg.algorithm.betas[0],
        adam_beta2=cfg.algorithm.betas[1],
        weight_decay=cfg.algorithm.weight_decay,
        max_grad_norm=cfg.algorithm.max_grad_norm,
        loss_type="dapo",
        scale_rewards="none",
        beta=0.0,
        num_iterations=1,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=cfg.seed,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=task_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[HeldOut()],
    )
    trainer.remove_callback(PrinterCallback)  # one log dict per step otherwise

    def timed(fn: Any, phase: str) -> Any:
        """fn, adding the seconds each call takes to clock[phase]."""

        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                clock[phase] += time.perf_counter() - t0

        return wrapper

    trainer._generate_and_score_completions = timed(
        trainer._generate_and_score_completions, "generate"
    )
    trainer.training_step = timed(trainer.training_step, "step")
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        before = exact_match(model, tokenizer, env, env_cfg.max_tokens)
    clock["scoring the start"] = time.perf_counter() - t0
    trainer.train()
    rl_s = curve[-1][1]
    Path(spec["result"]).write_text(
        json.dumps(
            {
                "curve": [(0, 0.0, before), *curve],
                "generated": scored[0],
                "train_start": clock["start_wall"],
                "scoring_start_s": clock["scoring the start"],
                "profile": {
                    "generate and score": clock["generate"],
                    "forward, backward": clock["step"] - clock["generate"],
                    "optimiser step, loop, callbacks": rl_s - clock["step"],
                },
            }
        )
    )


def run_trl(start: Path, run: Run, tmp: Path, every: int, overrides: list[str]) -> Run:
    spec = tmp / f"trl-{run.seed}.json"
    result = tmp / f"trl-{run.seed}-result.json"
    spec.write_text(
        json.dumps(
            {
                "start": str(start),
                "every": every,
                "overrides": [*overrides, f"seed={run.seed}"],
                "output_dir": str(tmp / f"trl-{run.seed}"),
                "result": str(result),
            }
        )
    )
    threads = {"OMP_NUM_THREADS": str(os.cpu_count()), "WANDB_MODE": "disabled"}
    cmd = [sys.executable, __file__, "--trl-worker", str(spec)]
    measured(run, cmd, {**os.environ, **threads})
    data = json.loads(result.read_text())
    run.curve = [tuple(point) for point in data["curve"]]
    run.startup_s = data["train_start"] - run.started - data["scoring_start_s"]
    run.generated = data["generated"]
    run.profile = {**data["profile"], "start-up and end (not RL)": run.wall_s - run.rl_s}
    return run


def mean_sd(values: list[float], fmt: str = "{:.1f}") -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{fmt.format(statistics.mean(values))} ± {fmt.format(sd)}"


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = [cell.rjust(width) for cell, width in zip(row, widths, strict=True)]
        print("  ".join([row[0].ljust(widths[0]), *cells[1:]]))
    print()


def report(runs: list[Run], labels: list[str], targets: list[float], max_other: float) -> None:
    fmt_t = lambda t: "-" if t is None else f"{t:.1f}"  # noqa: E731
    names = [f">= {t:.3f}" for t in targets]
    print_table(
        ["system", "seed", "other cores", "CPU s", "wall s", "start-up s", "RL s", "trained",
         "generated", "exact end", *[f"s to {n}" for n in names]],
        [
            [r.label, str(r.seed), f"{r.other_cores:.2f}", f"{r.cpu_s:.0f}", f"{r.wall_s:.1f}",
             f"{r.startup_s:.1f}", f"{r.rl_s:.1f}", str(r.curve[-1][0]), str(r.generated),
             f"{r.final:.3f}",
             *[fmt_t(r.time_to(t)) for t in targets]]
            for r in runs
        ],
    )  # fmt: skip
    noisy = sorted({r.seed for r in runs if r.other_cores > max_other})
    if noisy:
        print(f"left out (other work above {max_other} cores during a run): seeds {noisy}\n")
    clean = [r for r in runs if r.seed not in noisy]
    by = {label: [r for r in clean if r.label == label] for label in labels}
    if not all(by.values()):
        print("no seed ran clean on every system: no summary")
        return
    horizon = min(statistics.mean(r.rl_s for r in rs) for rs in by.values())
    rows = []
    for label, rs in by.items():
        times = [[r.time_to(t) for r in rs] for t in targets]
        rows.append(
            [label, str(len(rs)), mean_sd([r.startup_s for r in rs]),
             mean_sd([r.rl_s for r in rs]),
             mean_sd([r.final for r in rs], "{:.3f}"),
             mean_sd([r.score_at_time(horizon) for r in rs], "{:.3f}"),
             *[f"{mean_sd([t for t in ts if t is not None])} ({sum(t is not None for t in ts)}"
               f"/{len(ts)})" for ts in times]]
        )  # fmt: skip
    print(f"mean ± sd over clean seeds; exact at equal wall time = at {horizon:.1f} RL s")
    print_table(
        [
            "system",
            "seeds",
            "start-up s",
            "RL s",
            "exact at equal samples",
            "exact at equal time",
            *[f"s to {n} (reached)" for n in names],
        ],
        rows,
    )
    base = labels[0]
    for label in labels[1:]:
        parts = []
        for target, name in zip(targets, names, strict=True):
            mine = [r.time_to(target) for r in by[label]]
            theirs = [r.time_to(target) for r in by[base]]
            if None in mine or None in theirs:
                parts.append(f"time to {name}: not reached in every seed")
            elif statistics.mean(theirs) == 0:
                parts.append(f"time to {name}: reached before RL")
            else:
                parts.append(
                    f"time to {name} {statistics.mean(mine) / statistics.mean(theirs):.2f}"
                )
        finals = statistics.mean(r.final for r in by[label]) / max(
            statistics.mean(r.final for r in by[base]), 1e-9
        )
        parts.append(f"exact at equal samples {finals:.2f}")
        print(f"ratio {label}/{base}: " + ", ".join(parts))
        final = statistics.mean(r.final for r in by[base])
        reached = [r for r in by[label] if r.time_to(final) is not None]
        if len(reached) < len(by[label]):
            print(
                f"  {label}: {len(by[label]) - len(reached)} of {len(by[label])} seeds never "
                f"reached {base}'s mean final score {final:.3f}; the figures below are over the "
                f"{len(reached)} that did"
            )
        if reached:
            reach = statistics.mean(r.time_to(final) or 0.0 for r in reached)
            whole = statistics.mean(r.rl_s for r in by[base])
            print(
                f"  {label} reached {base}'s mean final score {final:.3f} in {reach:.1f} s, "
                f"{base} took {whole:.1f} s for all its steps: ratio {reach / whole:.2f}"
            )
            user = statistics.mean(r.user_time_to(final) or 0.0 for r in reached)
            whole = statistics.mean(r.user_s for r in by[base])
            print(
                f"  on the user's clock (from the command, start-up included): {label} "
                f"{user:.1f} s, {base} {whole:.1f} s for all its steps: ratio {user / whole:.2f}"
            )
    print()
    phases = sorted({k for rs in by.values() for r in rs for k in r.profile}, key=str)
    for label, rs in by.items():
        print(f"where {label}'s time went (mean seconds per run):")
        for phase in phases:
            values = [r.profile[phase] for r in rs if phase in r.profile]
            if values:
                print(f"  {phase:32} {statistics.mean(values):8.1f}")
    print()
    print("mean held-out exact match by trained samples:")
    points = [p[0] for p in by[base][0].curve]
    shown = list(dict.fromkeys([*points[:: max(1, len(points) // 10)], points[-1]]))
    print_table(
        ["system", *[str(s) for s in shown]],
        [
            [label, *[f"{statistics.mean(dict((p[0], p[2]) for p in r.curve)[s] for r in rs):.3f}"
                      for s in shown]]
            for label, rs in by.items()
        ],
    )  # fmt: skip


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--trl-worker":
        return trl_worker(Path(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="RL steps for each system")
    parser.add_argument("--seeds", type=int, default=3, help="seeds (runs per system)")
    parser.add_argument("--first-seed", type=int, default=0, help="seeds from this one")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between scores")
    parser.add_argument(
        "--targets", type=float, nargs="*", default=[0.4, 0.6],
        help="fixed exact-match targets; the first system's mean final score is added",
    )  # fmt: skip
    parser.add_argument("--max-other-load", type=float, default=0.3, help="cores; else flagged")
    parser.add_argument("--no-trl", action="store_true", help="Relay runs only")
    parser.add_argument(
        "--variant", action="append", default=[], metavar='LABEL="OVERRIDE ..."',
        help="a Relay run with extra overrides, compared with the others (repeatable)",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="rl overrides for both sides")
    args = parser.parse_args()
    overrides = [f"max_steps={args.steps}", *args.overrides]
    cfg = compose_run(*overrides)
    env = make_environment(cfg.environment)
    systems = {} if args.no_trl else {TRL: None}
    systems[RELAY] = []
    for variant in args.variant:
        label, _, extra = variant.partition("=")
        systems[label] = shlex.split(extra)
    labels = list(systems)
    batch = cfg.environment.prompts_per_step * cfg.environment.group_size
    print(
        f"{cfg.environment.name}: {args.steps} steps x {batch} samples "
        f"({cfg.environment.prompts_per_step} prompts x {cfg.environment.group_size}), "
        f"lr {learning_rate(cfg)}, max_tokens {cfg.environment.max_tokens}, "
        f"{len(env.eval_examples())} eval prompts scored every {args.eval_every} steps, "
        f"seeds {args.first_seed}-{args.first_seed + args.seeds - 1}; "
        f"TRL {os.cpu_count()} threads, Relay's roles as planned; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    for label, extra in systems.items():
        if extra:
            print(f"  {label}: {' '.join(extra)}")
    runs: list[Run] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        os.environ.setdefault("RELAY_CACHE", str(tmp / "cache"))
        start = warm_up(cfg, tmp / "warm")
        print(f"warm-up: {cfg.warmup.steps} SFT steps", flush=True)
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            order = labels if seed % 2 == 0 else labels[::-1]
            for label in order:
                run = Run(label, seed)
                if label == TRL:
                    run_trl(start, run, tmp, args.eval_every, overrides)
                else:
                    extra = [*overrides, *systems[label]]
                    run_dir = tmp / f"{label}-{seed}"
                    run_relay(compose_run(*extra), start, run, run_dir, args.eval_every, extra)
                runs.append(run)
                print(
                    f"{label} seed {seed}: {run.rl_s:.1f} RL s, exact {run.curve[0][2]:.3f} -> "
                    f"{run.final:.3f}, {run.cpu_s:.0f} CPU s, other work {run.other_cores:.2f} "
                    f"cores",
                    flush=True,
                )
    base = [r for r in runs if r.label == labels[0]]
    targets = [*args.targets, round(statistics.mean(r.final for r in base), 3)]
    print()
    report(runs, labels, targets, args.max_other_load)


if __name__ == "__main__":
    main()
