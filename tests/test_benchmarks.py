"""Every script under benchmarks/ runs at its smallest arguments and prints the figures it
promises, so that none can rot between the times someone measures with it.

Each script runs as a user runs it (`python benchmarks/<name>.py <args>` from the checkout), in
a process group of its own, with a private model cache and temporary directory. SMALLEST holds,
for each script, its smallest arguments and the lines it then prints, as templates: `{n}` is a
number, `{w}` a word, a trailing ` ...` the rest of the line, and a run of spaces any run of
whitespace. A new script fails here until it has an entry. The figures themselves are timings
of this machine: no test holds them to a bound.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.runs import ROOT, child_env, rl_command, stop_role

pytestmark = pytest.mark.slow

BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
TIMEOUT_S = 600
"""A hung script is ended after this long (its process group); no bound on its figures."""
RUN_DIR = "{run}"
"""In a script's arguments: a small finished run (`rl`) made for it first."""

# A reverse-text run as small as it goes: no warm-up, 8 prompts x 4 samples a step, 16 held out.
TINY_RUN = (
    "warmup.steps=0 environment.prompts_per_step=8 environment.group_size=4 "
    "environment.eval_size=16"
)


@dataclass(frozen=True)
class Smallest:
    """A script's smallest arguments and the lines it then prints (in any order)."""

    args: str
    """As typed after the script's name."""
    prints: tuple[str, ...]
    needs: tuple[str, ...] = ()
    """Modules it imports that the default environment may lack: skipped without them."""
    unset: tuple[str, ...] = ()
    """Environment variables taken away from it (each would make it measure more)."""


SMALLEST: dict[str, Smallest] = {
    "async_throughput.py": Smallest(
        f"--steps 3 {TINY_RUN}",
        (
            "async_level=0: {n} samples/s",
            "async_level=1: {n} samples/s",
            "ratio async/sync: {n}",
        ),
    ),
    "cli_latency.py": Smallest(
        "--repeats 1",
        (
            "command median s min s",
            "rl --help {n} {n}",
            "rl dry_run=true {n} {n}",
            "rl model=glm5 parallel=ep8 cluster=slurm dry_run=true {n} {n}",
        ),
    ),
    # The tiny model's shape on whatever device is here (on a CPU the GPU-only figures are null).
    "gpu_figures.py": Smallest(
        "--model tiny --tokens 32 --batch 2 --prompt 8 --new 4 --steps 1 --no-compile",
        (
            '"model": "tiny",',
            '"tokens": 32,',
            '"compiled": false,',
            '"tokens_per_s": {n},',
            '"estimate_gib": {n},',
            '"batch": 2,',
            '"new_tokens": 4,',
            '"awake_gib": {n},',
            '"released_gib": {n},',
            '"taken_back_gib": {n}',
        ),
    ),
    # Long enough for the three phases it compares: before the load (steps 5 to 6), under it
    # (6 s from step 6) and after it (it stops by step 20 and the run goes on to 40).
    "hostile_load.py": Smallest(
        f"--steps 40 --load-from 6 --load-s 6 --stream-rate 4 {TINY_RUN}",
        (
            "load from step {n}",
            "load ends at step {n} after {n} rounds",
            '"exit": 0,',
            '"status": "finished",',
            '"steps_recorded_once": true,',
            '"streams_per_s": {n},',
            '"generate_ratio_during": {n},',
            '"checksum_share": {n},',
            "generation per step: quiet {n} s, under the load {n} s: {n}x (goal: within 1.33x); "
            "per 256 samples {n} s and {n} s: {n}x",
        ),
    ),
    "lora_update.py": Smallest(
        "--rank 2 --repeats 1",
        (
            "model kind MB publish s load s full/adapter MB full/adapter s",
            "tiny full {n} {n} {n} 1.0 1.0",
            "tiny adapter {n} {n} {n} {n} {n}",
            "small full {n} {n} {n} 1.0 1.0",
            "small adapter {n} {n} {n} {n} {n}",
        ),
    ),
    # A target of 0 is met at version 0: the column shows a time and a step, not "not reached".
    "placement.py": Smallest(
        f"--steps 3 --eval-every 3 --target 0 {TINY_RUN}",
        (
            "placement samples/s to exact >= 0.0 final",
            "split {n} 0 s, step 0 {n}",
            "colocated {n} 0 s, step 0 {n}",
        ),
    ),
    "queue_load.py": Smallest(
        "--producers 2 --ranks 2 --pushes 1 --prompts 2 --group-size 2 --prompt-tokens 8 "
        "--completion-tokens 8",
        (
            "2 producers x 1 pushes, 2 ranks; a step is 2 groups x 2 samples of 8 prompt + "
            "8 completion tokens = {n} MB binary",
            "groups: 4 pushed, duplicate pushes ignored: 2/2; no group lost or served twice",
            "push (one step) {n} {n} 2",
            "pull (one shard) {n} {n} 4",
            "raw loopback TCP (mean of before, after) {n} 1.000",
            "HTTP sink (same stack, body dropped) {n} {n}",
            "queue, nobody pulling {n} {n}",
            "queue, 2 ranks pulling {n} {n}",
            "disk: append + fsync each push {n} {n}",
        ),
    ),
    "queue_throughput.py": Smallest(
        "--groups 8",
        (
            "8 groups; one group is {n} MB binary, {n} MB JSON",
            "format groups/s push MB/s p50 ms p99 ms pull MB/s push/raw",
            "json {n} {n} {n} {n} {n} {n}",
            "binary {n} {n} {n} {n} {n} {n}",
            "raw loopback TCP, same bytes: {n} MB/s",
        ),
    ),
    # `--before REV` is left out: it adds a git worktree to the checkout.
    "schedule_cost.py": Smallest(
        f"--seeds 1 max_steps=3 {TINY_RUN}",
        (
            "fixed seed 0: RL {n} s, exact {n}, staleness {n}",
            "newest seed 0: RL {n} s, exact {n}, staleness {n}",
            "fixed {n} +- {n} {n} +- {n} {n} +- {n} 1.000x",
            "newest {n} +- {n} {n} +- {n} {n} +- {n} {n}x",
        ),
    ),
    "shared_sweep.py": Smallest(
        f"--steps 2 --lrs 1e-3 --rank 2 {TINY_RUN}",
        (
            "shared: {n} s",
            "sequential: {n} s",
            "1 LoRA points (rank 2), 2 steps each, this machine ({n} cores)",
            "| shared | {n} s | {n} | 0.001: {n} -> {n} (finished) |",
            "| sequential | {n} s | {n} | 0.001: {n} -> {n} (finished) |",
            "shared / sequential wall time: {n}",
        ),
    ),
    "startup.py": Smallest(
        f"--repeats 1 {TINY_RUN}",
        (
            "seconds from the `rl` command, 1 runs with the bytecode cache written "
            "(median, min-max):",
            *(
                f"{phase} {{n}} ({{n}}-{{n}})"
                for phase in (
                    "plan made (run directory)",
                    "queue listening",
                    "inference listening",
                    "trainer: weights read",
                    "version 0 served",
                    "eval at version 0 done",
                    "batch 0 generated",
                    "first RL step starts",
                    "first RL step done",
                    "run ends (2 steps, final eval, plot)",
                )
            ),
        ),
    ),
    # World 2 only: FSDP2's gather when publishing; world 1 runs in trainer_scaling.py.
    "step_overheads.py": Smallest(
        "--worlds 2 --batches 8 --steps 1",
        (
            "per rank per step, 1 steps per point, {n} CPUs; MB over TCP",
            "batch world rank fetch MB fetch s record MB record s publish MB publish s version MB",
            "8 2 0 {n} {n} {n} {n} {n} {n} {n}",
            "8 2 1 {n} {n} {n} {n} {n} {n}",
        ),
    ),
    "step_profile.py": Smallest(
        f"{RUN_DIR} --micro",
        (
            "{w}: 2 steps in {n} s of RL, {n} ms a step",
            "trainer: train (fwd, bwd, optimiser) {n} ms {n}%",
            "trainer: wait for its batch {n} ms {n}%",
            "trainer: publish weights {n} ms {n}%",
            "inference: generate and score a batch {n} ms {n}%",
            "inference: load new weights {n} ms {n}%",
            "inference: idle or between batches {n} ms {n}%",
            "samples trained {n}, generated {n} ({n} per trained; {n} in zero-advantage groups, "
            "{n} in surplus groups, {n} of them trained by the next batch)",
            "held-out exact match at version 2: {n}",
            "in-process, 1 thread, 256 samples (32 prompts):",
            "trainer forward+backward, shared prompts False {n} ms",
            "trainer forward+backward, shared prompts True {n} ms",
            "generate one batch (embedded engine's generate) {n} ms",
        ),
    ),
    "trainer_scaling.py": Smallest(
        "--steps 1 --samples 4 --shapes reverse_text",
        (
            "4 samples/step, 1 timed steps, {n} CPUs",
            "reverse_text {n} {n}",
            "shape packing world 1 tok/s world 2 tok/s 2/1",
            "reverse_text False {n} {n} {n}",
            "reverse_text True {n} {n} {n}",
            "reverse_text: packed/padded tokens/s at world 1: {n}",
        ),
    ),
    # Other work on the machine (the other benchmarks here) would leave its one seed out.
    "trl_comparison.py": Smallest(
        f"--steps 1 --seeds 1 --eval-every 1 --max-other-load 100 {TINY_RUN}",
        (
            "reverse_text: 1 steps x 32 samples (8 prompts x 4), lr {n}, max_tokens 12, "
            "16 eval prompts scored every 1 steps, seeds 0-0; ...",
            "trl seed 0: {n} RL s, exact {n} -> {n}, {n} CPU s, other work {n} cores",
            "relay seed 0: {n} RL s, exact {n} -> {n}, {n} CPU s, other work {n} cores",
            "trl 1 {n} ± {n} {n} ± {n} {n} ± {n} {n} ± {n} ...",
            "relay 1 {n} ± {n} {n} ± {n} {n} ± {n} {n} ± {n} ...",
            "ratio relay/trl: ...",
            "where relay's time went (mean seconds per run):",
            "relay {n} {n}",
        ),
        needs=("trl",),
    ),
    # The embedded backend: vLLM's CPU build (RELAY_VLLM_PYTHON) would add minutes.
    "weight_update.py": Smallest(
        "--repeats 1",
        (
            "RELAY_VLLM_PYTHON not set: measuring the embedded backend only",
            "tiny embedded {n} {n} {n} {n} {n} {n} {n}",
            "small embedded {n} {n} {n} {n} {n} {n} {n}",
        ),
        unset=("RELAY_VLLM_PYTHON",),
    ),
}

NUMBER = r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?"
PLACEHOLDERS = {"{n}": NUMBER, "{w}": r"\S+"}


def line_pattern(template: str) -> re.Pattern[str]:
    """The printed lines a template stands for (leading and trailing spaces stripped)."""
    rest = template.endswith(" ...")
    words = template.removesuffix(" ...").split()
    regexes = [
        "".join(PLACEHOLDERS.get(part) or re.escape(part) for part in re.split(r"(\{[nw]\})", w))
        for w in words
    ]
    return re.compile(r"\s+".join(regexes) + (r"(?:\s.*)?" if rest else ""))


def missing_modules(entry: Smallest) -> list[str]:
    return [module for module in entry.needs if importlib.util.find_spec(module) is None]


@dataclass(frozen=True)
class Ran:
    """What one command did: its argv, exit status, output and wall seconds."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def said(self) -> str:
        head = f"{' '.join(self.argv)}: exit {self.returncode} after {self.seconds:.0f} s"
        return f"{head}\nstdout:\n{self.stdout[-3000:]}\nstderr:\n{self.stderr[-3000:]}"


def run(argv: list[str], env: dict[str, str]) -> Ran:
    """`argv` from the checkout in a process group of its own, ended whole if it hangs."""
    start = time.monotonic()
    pipe = subprocess.PIPE
    with subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stop_role(proc)
            out, err = proc.communicate()
            err += f"\nended after {TIMEOUT_S} s"
    return Ran(argv, proc.returncode, out, err, time.monotonic() - start)


def run_benchmark(script: str, root: Path, cache: Path) -> Ran:
    """The script at its smallest arguments, with a run made first where it reads one."""
    entry = SMALLEST[script]
    scratch = root / script.removesuffix(".py")
    scratch.mkdir()
    env = child_env(cache, TMPDIR=str(scratch), WANDB_MODE="disabled")
    for name in entry.unset:
        env.pop(name, None)
    args = entry.args.split()
    if RUN_DIR in args:
        run_dir = scratch / "run"
        made = run(rl_command(run_dir, "max_steps=2", *TINY_RUN.split()), env)
        if made.returncode != 0:
            return made
        args = [str(run_dir) if a == RUN_DIR else a for a in args]
    return run([sys.executable, str(BENCHMARKS / script), *args], env)


@pytest.fixture(scope="module")
def ran(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[Ran]]]:
    """The selected scripts that have an entry and what it needs, started two at a time;
    each test waits for its own."""
    root, cache = tmp_path_factory.mktemp("benchmarks"), tmp_path_factory.mktemp("cache")
    selected = {
        item.callspec.params["script"]
        for item in request.session.items
        if getattr(item, "module", None) is request.module and hasattr(item, "callspec")
    }
    runnable = [s for s in SCRIPTS if s in selected and s in SMALLEST]
    runnable = [s for s in runnable if not missing_modules(SMALLEST[s])]
    with ThreadPoolExecutor(2) as pool:
        yield {s: pool.submit(run_benchmark, s, root, cache) for s in runnable}


def test_every_entry_names_a_script() -> None:
    assert SCRIPTS, f"no script found in {BENCHMARKS}"
    assert set(SMALLEST) <= set(SCRIPTS), f"no such script: {set(SMALLEST) - set(SCRIPTS)}"


def test_a_template_matches_its_lines_only() -> None:
    pattern = line_pattern("rl --help {n} {n}x ...")
    assert pattern.fullmatch("rl   --help  0.68 -1.5e-05x and more")
    assert pattern.fullmatch("rl --help 0.68 12x")
    assert not pattern.fullmatch("rl --help 0.68 nanx")
    assert not pattern.fullmatch("rl --help 0.68 12xy")
    assert line_pattern("{w}: 2 steps").fullmatch("/tmp/run: 2 steps")


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_runs_at_its_smallest_arguments(
    script: str, ran: dict[str, Future[Ran]], request: pytest.FixtureRequest
) -> None:
    entry = SMALLEST.get(script)
    assert entry is not None, (
        f"benchmarks/{script} has no entry in SMALLEST ({Path(__file__).name}): add its "
        "smallest arguments and the lines it then prints"
    )
    if missing := missing_modules(entry):
        pytest.skip(
            f"benchmarks/{script} needs {', '.join(missing)}: the `bench` dependency group "
            "(uv run --group bench pytest tests/test_benchmarks.py)"
        )
    result = ran[script].result()
    request.node.user_properties.append(("seconds", round(result.seconds, 1)))  # --junitxml
    assert result.returncode == 0, result.said()
    lines = [line.strip() for line in result.stdout.splitlines()]
    absent = [t for t in entry.prints if not any(map(line_pattern(t).fullmatch, lines))]
    assert not absent, f"lines not printed: {absent}\n{result.said()}"
