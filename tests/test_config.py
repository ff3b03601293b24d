"""The config tree: every option composes, the schema rejects bad input, the CLI is fast."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rl.core.config import GROUPS
from tests.support.runs import ROOT, compose_run, options


def rl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_composes(group: str) -> None:
    names = options(group)
    assert names, f"conf/{group} has no options"
    for name in names:
        cfg = compose_run(f"{group}={name}")
        assert cfg[group].name == name
        # Every field resolves: no MISSING left in a shipped option.
        OmegaConf.to_container(cfg[group], resolve=True, throw_on_missing=True)


def test_named_options_exist() -> None:
    assert set(options("model")) >= {
        "tiny",
        "smollm2_135m",
        "qwen3_0_6b",
        "qwen3_30b_a3b",
        "glm5",
        "minimax_m2",
    }
    assert set(options("parallel")) >= {"single", "fsdp", "hsdp", "ep8", "cp2"}
    clusters = {"local", "slurm", "slurm_cpu", "kubernetes", "kubernetes_cpu"}
    assert set(options("cluster")) == clusters


def test_real_model_facts() -> None:
    glm5 = compose_run("model=glm5").model
    assert (glm5.total_params_b, glm5.active_params_b, glm5.num_experts) == (744, 40, 256)
    assert glm5.inference.quantization == "fp8" and glm5.inference.pd_disaggregation
    moe = compose_run("model=qwen3_30b_a3b").model
    assert (moe.num_experts, moe.experts_per_token, moe.num_layers) == (128, 8, 48)
    m2 = compose_run("model=minimax_m2").model
    assert (m2.total_params_b, m2.active_params_b, m2.context_length) == (230, 10, 196608)


def test_schema_rejects_unknown_key_and_bad_type() -> None:
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose_run("model.not_a_field=1")
    with pytest.raises(ConfigCompositionException):
        compose_run("algorithm.lr=fast")
    with pytest.raises(ConfigCompositionException):
        compose_run("algorithm.loss=nonsense")


def test_help_lists_groups_and_documented_settings() -> None:
    out = rl("--help")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for group in GROUPS:
        assert any(x.split() and x.split()[0] == group for x in lines), group
    assert "glm5" in out.stdout and "ep8" in out.stdout and "[reverse_text]" in out.stdout
    # Each setting with its composed value and its description from rl/core/config.py.
    lr = next(x for x in lines if x.strip().startswith("algorithm.lr="))
    assert lr.split()[0] == "algorithm.lr=0.0003" and "the one the trainer uses" in lr
    assert any(x.split()[:3] == ["max_steps=300", "RL", "trainer"] for x in lines if x.strip())
    glm5 = rl("model=glm5", "--help").stdout
    assert "  model.name=glm5 " in glm5
    # A line that does not show its whole description says how to read the rest.
    seed = next(x for x in lines if x.strip().startswith("seed="))
    assert seed.endswith(" (more: rl --help seed)")


def test_help_of_a_key_prints_its_whole_description() -> None:
    from launcher.errors import ConfigError
    from launcher.help import describe

    out = rl("--help", "algorithm.lr")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "algorithm.lr=0.0003"
    assert "`rl --cfg job --resolve` shows the value." in " ".join(out.stdout.split())
    warmup = describe(["warmup"], ["warmup.steps=7"]).splitlines()
    assert "warmup.steps=7" in warmup and "warmup.seed=0" in warmup
    with pytest.raises(ConfigError, match="algorithm.lrr: no such setting; did you mean"):
        describe(["algorithm.lrr"], [])


def test_one_learning_rate_shown_resolved() -> None:
    """`algorithm.lr` is the trainer's learning rate; it defaults to the model's, and
    `--cfg job --resolve` shows the number."""
    out = rl("model=smollm2_135m", "--cfg", "job", "--resolve")
    config = OmegaConf.create(out.stdout)
    assert config.algorithm.lr == config.model.lr
    out = rl("model=smollm2_135m", "algorithm.lr=3e-5", "--cfg", "job", "--resolve")
    assert OmegaConf.create(out.stdout).algorithm.lr == 3e-5


def test_cfg_job_prints_composed_config() -> None:
    out = rl("--cfg", "job")
    assert out.returncode == 0, out.stderr
    cfg = OmegaConf.create(out.stdout)
    assert cfg.model.name == "tiny" and cfg.cluster.kind == "local"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["model=nope"], "model=nope: no such option; valid: glm5, minimax_m2, qwen3_0_6b"),
        (["model.nope=1"], "model.nope: no such setting (uv run rl --help lists them)"),
        (["algoritm.lr=1"], "algoritm.lr: no such setting; did you mean algorithm.lr?"),
        (["algorithm.lrr=1"], "algorithm.lrr: no such setting; did you mean algorithm.lr?"),
        # Hydra adds a key with + silently, where nothing would read it.
        (["+foo=1"], "+foo=1: no such setting"),
        (["+max_step=9"], "+max_step=9: no such setting; did you mean max_steps?"),
        # A key a free-form dict lacks: the close one it has, and Hydra's `+` to add it.
        (
            ["environment.args.nope=1"],
            "environment.args.nope: not in the config; to add it, write +environment.args.nope=1",
        ),
        (
            ["environment.args.max_lne=3"],
            "environment.args.max_lne: not in the config; did you mean environment.args.max_len? "
            "(to add it: +environment.args.max_lne=3)",
        ),
        # Hydra's own hint to sweep is kept, on the same line.
        (["algorithm.lr=1e-4,3e-4"], "to sweep over the values add -m (--multirun)"),
        (["algorithm.lr=abc"], "algorithm.lr: Value 'abc'"),
        (["algorithm.loss=xx"], "expected one of [default, aipo, grpo, gspo, cispo]"),
        (
            ["inference.weight_transport=disk"],
            "inference.weight_transport: Invalid value 'disk', expected one of "
            "[filesystem, broadcast]",
        ),
        (
            ["model=qwen3_0_6b", "parallel=ep8", "dry_run=true"],
            "parallel.trainer.ep=8: expert parallelism needs an MoE model",
        ),
        # Not a dry run: refused before any role starts (stdout stays empty).
        (["algorithm.lr=-1"], "algorithm.lr=-1.0: must be a positive number"),
    ],
)
def test_cli_errors_are_one_line(args: list[str], expected: str) -> None:
    out = rl(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: ") and expected in lines[0]
    assert out.stdout == ""


def test_dry_run_glm5_slurm_prints_plan() -> None:
    out = rl("model=glm5", "parallel=ep8", "cluster=slurm", "dry_run=true")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for needle in (
        "trainer",
        "inference-0-prefill",
        "inference-0-decode",
        "rl.trainer.torchrun",
        "--enable-expert-parallel",
        "--quantization fp8",
        # The balance rule's trainer: 21 nodes, with checkpointing and the float32 master
        # state on the host (a step's weight sync, ~58 s, outweighs the offload's cost).
        "--nnodes 21",
        "weight sync ~58.2 s a version: rank 0 gathers 1,488 GB (bfloat16)",
        "then broadcasts 746 GB by NCCL",
        "kv_producer",
    ):
        assert needle in text, needle
    assert not (ROOT / "outputs").exists() or not any((ROOT / "outputs").glob("*glm5*"))


def test_loss_registry_matches_schema() -> None:
    from rl.core.config import Loss
    from rl.trainer.losses import LOSSES

    assert set(LOSSES) == {loss.value for loss in Loss}
    assert set(options("algorithm")) == set(LOSSES)


def test_every_sweep_plans(tmp_path) -> None:
    sweeps = sorted(p.stem for p in (ROOT / "sweeps").glob("*.yaml"))
    assert "loss_comparison" in sweeps
    for name in sweeps:
        out = rl("--config-dir", "sweeps", "--config-name", name, "-m", "dry_run=true",
                 f"hydra.sweep.dir={tmp_path / name}")  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert out.stdout.count("\nrun ") + out.stdout.startswith("run ") >= 2
    out = rl("--config-dir", "sweeps", "--config-name", "loss_comparison", "-m", "dry_run=true",
             f"hydra.sweep.dir={tmp_path / 'x'}")  # fmt: skip
    for loss in ("default", "aipo", "grpo", "gspo", "cispo"):
        assert f"algorithm={loss}" in out.stdout + out.stderr


def test_every_experiment_preset_composes_and_plans() -> None:
    presets = options("experiment")
    assert "arithmetic_smollm2" in presets
    for name in presets:
        cfg = compose_run(f"experiment={name}")
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        out = rl(f"experiment={name}", "dry_run=true")
        assert out.returncode == 0, out.stderr
    cfg = compose_run("experiment=arithmetic_smollm2")
    assert (cfg.model.name, cfg.environment.name, cfg.warmup.steps) == (
        "smollm2_135m",
        "arithmetic",
        0,
    )


def test_every_agent_setting_the_docs_list_can_be_overridden() -> None:
    """docs/agents.md's settings are keys of conf/environment/agent.yaml (a key the YAML lacks
    cannot be overridden without `+`), and `task_args` reaches the tasks environment."""
    import re

    from rl.orchestrator.agents import AgentArgs, agent_args, tasks_config

    table = (ROOT / "docs" / "agents.md").read_text().split("Settings (`environment.args`")[1]
    documented = set(re.findall(r"^\| ([^|]+) \|", table.split("\n\n")[1], re.M))
    documented = {k for cell in documented for k in re.findall(r"`(\w+)`", cell)}
    in_yaml = set(compose_run("environment=agent").environment.args)
    assert documented <= in_yaml == set(AgentArgs.__dataclass_fields__)
    for given, expected in [("{}", {}), ("{max_turns: 4}", {"max_turns": 4})]:
        env = compose_run("environment=agent", f"environment.args.task_args={given}").environment
        assert tasks_config(env, agent_args(env)).args == expected
    env = compose_run("environment=agent").environment
    assert tasks_config(env, agent_args(env)).args == {}  # the tasks environment's defaults


def test_runs_are_named_after_the_environments_identity() -> None:
    """A verifiers run is named after the environment it loads, not `verifiers`."""
    assert compose_run().name == "reverse_text-tiny"
    cfg = compose_run("environment=verifiers", "environment.args.id=reverse_text_env")
    assert cfg.name == "reverse_text_env-tiny"
    assert compose_run("environment=verifiers").name == "verifiers-tiny"  # no id given yet


def test_sweep_points_are_named_after_their_overrides() -> None:
    from rl.core.config import dirname

    assert dirname("algorithm.lr=0.001,max_steps=4") == "algorithm.lr=0.001,max_steps=4"
    assert dirname("model.path=/data/w/step_4") == "model.path=_data_w_step_4"  # one level
    assert dirname("") == "defaults"


def test_tab_completion_as_the_readme_sets_it_up() -> None:
    """`rl` on the PATH (the activated environment) completes groups, options and keys
    through Hydra's bash completion."""
    script = (
        'eval "$(rl -sc install=bash)"; '
        'COMP_LINE="rl environment=wo"; COMP_POINT=${#COMP_LINE}; COMP_CWORD=1; '
        'hydra_bash_completion; echo "${COMPREPLY[*]}"'
    )
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["environment=wordle"]


def test_a_dry_or_refused_run_removes_only_the_directories_it_made(tmp_path: Path) -> None:
    """A dry run, and a run the plan refuses, leave nothing behind, but only what they made
    goes: the user's own directories stay, empty or not (they used to go with the run's, up
    to two levels above it)."""
    mine, empty = tmp_path / "mine", tmp_path / "empty"
    mine.mkdir()
    empty.mkdir()
    dry = rl("dry_run=true", f"hydra.run.dir={mine}/a/b")
    refused = rl("parallel.trainer.tp=2", f"hydra.run.dir={mine}/c")
    assert dry.returncode == 0 and refused.returncode == 2, (dry.stderr, refused.stderr)
    assert mine.is_dir() and list(mine.iterdir()) == []
    assert rl("dry_run=true", f"hydra.run.dir={empty}").returncode == 0
    assert empty.is_dir()


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("algorithm.temperature=0", "algorithm.temperature=0: greedy sampling gives the"),
        ("environment.group_size=0", "environment.group_size=0: needs >= 2 for a baseline"),
    ],
)
def test_a_role_refuses_a_config_the_launcher_would_refuse(
    tmp_path: Path, override: str, said: str
) -> None:
    """The rules are the config's, not the launcher's: a config.yaml edited by hand (or written
    by another tool) fails as a role loads it, naming the setting, instead of a role running on
    it unchecked."""
    from rl.core.config import InvalidConfig
    from rl.core.runtime import load_run_config
    from tests.support.runs import write_run_dir

    key, value = override.split("=")
    cfg = compose_run()
    OmegaConf.update(cfg, key, int(value) if value.isdigit() else value, force_add=True)
    write_run_dir(tmp_path / "run", cfg, "0" * 32)
    with pytest.raises(InvalidConfig) as refused:
        load_run_config(tmp_path / "run")
    assert str(refused.value).startswith(said), str(refused.value)


def test_a_run_directory_given_again_is_refused_naming_the_resume(tmp_path: Path) -> None:
    """`rl hydra.run.dir=<a run's directory>` ended in a traceback (FileExistsError on its
    token); it is refused in one line that says how to continue that run, and the run's
    files are left as they were."""
    from rl.core.rundir import RunDir
    from tests.support.runs import write_run_dir

    run = RunDir(write_run_dir(tmp_path / "run", compose_run(), "0" * 32))
    before = sorted(p.name for p in run.root.rglob("*"))
    out = rl(f"hydra.run.dir={run.root}", "max_steps=1")
    assert out.returncode == 2, out.stderr
    assert out.stderr == (
        f"error: hydra.run.dir={run.root}: it holds a run already; continue it with "
        f"resume={run.root}, or give another directory\n"
    )
    assert sorted(p.name for p in run.root.rglob("*")) == before
