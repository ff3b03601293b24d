"""plan(): the pure planning function, over a matrix of real configs and its error cases."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from launcher.errors import PlanError
from launcher.plan.checks import check_weights
from launcher.plan.planner import format_plan, plan, plan_header
from rl.core.rundir import RunDir, mark_complete
from tests.support.runs import ROOT, compose_run, options

DENSE = ("tiny", "smollm2_135m", "qwen3_0_6b")
MOE = ("qwen3_30b_a3b", "minimax_m2", "qwen3_235b_a22b", "glm5")
# Parallel options that fit each model on the 8 x 80 GB Slurm cluster option.
FITS = {
    "tiny": ("single", "fsdp", "hsdp", "tp", "dp"),  # 128-token context: no cp
    "smollm2_135m": ("single", "fsdp", "hsdp", "tp", "dp", "cp2"),
    "qwen3_0_6b": ("single", "fsdp", "hsdp", "tp", "dp", "cp2"),
    "qwen3_30b_a3b": ("fsdp", "hsdp", "tp", "ep8", "cp2"),
    "minimax_m2": ("ep8",),
    "qwen3_235b_a22b": ("ep8",),
    "glm5": ("ep8",),
    # Tiny random instances of the MoE families (the trainer's EP tests run them on CPU).
    "tiny_qwen3_moe": ("single", "fsdp", "hsdp", "ep8"),
    "tiny_glm5": ("single", "fsdp", "ep8"),
    "tiny_minimax_m2": ("single", "hsdp", "ep8"),
}
# Context parallelism needs long sequences (and a served length to hold them).
LONG = ["environment.max_tokens=4096", "environment.max_context_tokens=8192"]


@pytest.mark.parametrize("model", [m for m in FITS])
def test_slurm_matrix_plans(model: str) -> None:
    assert set(FITS) == set(options("model"))
    for par in FITS[model]:
        extra = LONG if par == "cp2" else []
        cfg = compose_run(f"model={model}", f"parallel={par}", "cluster=slurm", *extra)
        p = plan(cfg)
        mesh = p.mesh
        assert mesh["world"] == mesh["dp_replicate"] * mesh["dp_shard"] * mesh["cp"]
        assert "tp" not in mesh  # the trainer has no tensor parallelism
        trainer = p.role("trainer")[0]
        assert trainer.nodes * trainer.gpus_per_node == mesh["world"]
        # One allocation: the inference nodes first, then the trainer's, every role in it.
        (job,) = p.jobs
        assert job.name == "run" and {q.job for q in p.processes} == {"run"}
        serving = max(q.node for q in p.role("inference")) + 1
        assert trainer.node == serving and job.nodes == serving + trainer.nodes
        inference = p.role("inference")
        assert inference and all("--tensor-parallel-size" in proc.argv for proc in inference)
        json.loads(p.to_json())
        assert "rl.trainer.torchrun" in format_plan(p, cfg)


@pytest.mark.parametrize("model", MOE)
def test_ep8_sizes_nodes_from_memory(model: str) -> None:
    """The trainer's nodes are at least the fewest whose GPUs hold a rank's memory (with
    checkpointing and offload where needed), and every term the plan prints fits."""
    from launcher.plan.costs.fit import fit_trainer

    p = plan(compose_run(f"model={model}", "parallel=ep8", "cluster=slurm"))
    cfg = p.config  # with the GPUs and options the plan decided
    nodes = p.role("trainer")[0].nodes
    assert fit_trainer(cfg, nodes) is not None
    assert p.mesh["ep"] == 8 and cfg.model.num_experts % 8 == 0
    memory = next(n for n in p.notes if n.startswith("trainer memory per GPU"))
    used, usable = (float(x) for x in re.findall(r": ([\d.]+) of ([\d.]+) GiB", memory)[0])
    assert used <= usable


def test_glm5_plan_serves_fp8_disaggregated_with_mtp() -> None:
    p = plan(compose_run("model=glm5", "parallel=ep8", "cluster=slurm"))
    names = [proc.name for proc in p.role("inference")]
    # ~0.75 TB of FP8 weights, with attention, dense and shared-expert weights copied to every
    # GPU, leave KV cache under 0.8 x 80 GB only on four nodes (as prime-rl's 4 + 4): each
    # instance is a head and a headless process on each of the next three nodes.
    assert names == [
        "inference-0-prefill",
        *(f"inference-0-prefill-node{i}" for i in (1, 2, 3)),
        "inference-0-decode",
        *(f"inference-0-decode-node{i}" for i in (1, 2, 3)),
    ]
    assert [proc.name for proc in p.role("router")] == ["inference-0"]
    argv = p.role("inference")[0].argv
    args = argv[argv.index("--") + 1 :]
    assert args[args.index("--quantization") + 1] == "fp8"
    assert json.loads(args[args.index("--speculative-config") + 1]) == {
        "method": "mtp",
        "num_speculative_tokens": 3,
    }
    assert args[args.index("--data-parallel-size") + 1] == "32"


def test_local_default_plan() -> None:
    p = plan(compose_run())
    assert [proc.role for proc in p.processes] == ["queue", "orchestrator", "inference", "trainer"]
    assert p.backend == "embedded" and p.trainer_world_size == 1 and p.jobs == []
    assert "--standalone" in p.role("trainer")[0].argv
    assert p.lr == compose_run().model.lr
    # The values the roles derive too are decided once and recorded in plan.json.
    recorded = json.loads(p.to_json())
    assert (recorded["max_model_len"], recorded["broadcast_backend"]) == (128, "gloo")


def test_algorithm_lr_overrides_model_lr() -> None:
    assert plan(compose_run("algorithm.lr=1e-5")).lr == 1e-5


def test_local_fsdp_two_cpu_processes() -> None:
    p = plan(compose_run("parallel=fsdp", "parallel.trainer.dp_shard=2"))
    assert p.trainer_world_size == 2
    assert "--nproc-per-node" in (argv := p.role("trainer")[0].argv)
    assert argv[argv.index("--nproc-per-node") + 1] == "2"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=qwen3_0_6b", "parallel=ep8"], "parallel.trainer.ep=8: expert parallelism needs"),
        (
            ["model=qwen3_30b_a3b", "parallel=ep8", "cluster=slurm", "parallel.trainer.ep=3"],
            "parallel.trainer.ep=3: must divide model=qwen3_30b_a3b's 128 experts",
        ),
        (
            [
                "model=qwen3_30b_a3b",
                "parallel=fsdp",
                "cluster=slurm",
                "parallel.trainer.ep=32",
                "parallel.trainer.nodes=2",
            ],
            "parallel.trainer.ep=32: must divide dp_shard=16",
        ),
        (
            [
                "cluster=slurm",
                "parallel=fsdp",
                "parallel.trainer.nodes=2",
                "parallel.trainer.dp_shard=3",
            ],
            "do not split evenly over 2 node(s) of 8 GPUs",
        ),
        (
            [
                "model=qwen3_0_6b",
                "cluster=slurm",
                "cluster.partition=gpu",
                "parallel=fsdp",
                "parallel.trainer.tp=2",
            ],
            "parallel.trainer.tp=2: the trainer has no tensor parallelism",
        ),
        (
            ["cluster=slurm", "parallel=tp", "parallel.inference.tp=3"],
            "parallel.inference.tp=3: must divide the 8 GPUs per node",
        ),
        (["parallel=cp2"], "parallel.trainer.cp=2: environment.max_tokens=12 is too short"),
        (["parallel=tp"], "cluster=local has cluster.gpus_per_node=0"),
        (
            ["trainer.device=cuda", "cluster.gpus_per_node=0"],
            "trainer.device=cuda: cluster=local has no GPUs (cluster.gpus_per_node=0",
        ),
        (
            ["cluster=slurm_cpu", "trainer.device=cuda"],
            "trainer.device=cuda: cluster=slurm_cpu has no GPUs (cluster.gpus_per_node=0)",
        ),
        (["parallel=hsdp"], "cluster=local: runs on one node"),
        (
            ["cluster=slurm", "model=glm5", "parallel=ep8", "parallel.trainer.nodes=4"],
            "parallel=ep8: model=glm5 does not fit 32 trainer GPUs of 79.6 GiB even with",
        ),
        (
            ["cluster=slurm", "model=glm5", "parallel=ep8", "cluster.nodes=16"],
            "cluster.nodes: the run needs 22 GPU nodes (14 trainer + 8 for 2 inference",
        ),
        (["cluster.gpus_per_node=1"], "share the one GPU, which needs its memory to split"),
        (
            [
                "cluster.gpus_per_node=2",
                "cluster.gpu_memory_gb=24",
                "parallel=fsdp",
                "parallel.trainer.dp_shard=2",
            ],  # fmt: skip
            "trainer (2) + inference (1) GPUs exceed the 2 this",
        ),
        (["algorithm.async_level=9"], "algorithm.async_level=9: must be >= 0 and <="),
        (["algorithm.temperature=0"], "algorithm.temperature=0: greedy sampling gives the 8"),
        (["eval.samples=4"], "eval.samples=4: greedy evaluation (eval.temperature=0) gives one"),
        (["sweep.metric=wall_s"], "sweep.metric=wall_s: valid: eval/exact_match/last, "),
        (  # the README's wordle command gives it model.inference.max_model_len=512
            ["environment=wordle"],
            "environment=wordle: 6 turns an episode, but the served length 128 cannot hold two",
        ),
        (
            ["algorithm.lr_warmup_steps=20", "max_steps=20"],
            "algorithm.lr_warmup_steps=20: the learning rate would never reach algorithm.lr",
        ),
        (["environment.group_size=1"], "environment.group_size=1: needs >= 2"),
        (["environment.max_tokens=500"], "must be below model=tiny's served length 128"),
        (
            ["inference.weight_transport=broadcast", "inference.broadcast_timeout_s=0"],
            "inference.broadcast_timeout_s=0.0: must be a positive number of seconds",
        ),
        (
            ["inference.weight_transport=broadcast", "inference.broadcast_backend=nccl"],
            "inference.broadcast_backend=nccl: NCCL needs GPUs and cluster=local has none",
        ),
        (  # refused by the plan, not once the run has started
            ["environment=verifiers", "environment.args.id=no_such_env_here"],
            "environment.args.id=no_such_env_here: no installed verifiers environment",
        ),
        (["environment=verifiers"], "environment.args.id: required"),
    ],
)
def test_plan_errors_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(PlanError) as err:
        plan(compose_run(*overrides))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_what_this_machine_cannot_do_is_refused_before_a_local_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A local run declaring GPUs that nvidia-smi does not find, or serving with vLLM from a
    python without it, is refused at plan time in one line (before, the dry run printed
    CUDA_VISIBLE_DEVICES=0 beside "no GPU found", and the run ended in vLLM's traceback)."""
    from launcher.plan import gpus
    from launcher.plan.checks import check_this_machine

    monkeypatch.setattr(gpus, "detect", lambda: [])
    two_args = ["cluster.gpus_per_node=2", "cluster.gpu_memory_gb=80", "inference.backend=embedded"]
    two = compose_run(*two_args)
    with pytest.raises(PlanError, match=r"^cluster.gpus_per_node=2: cluster=local runs on this "
                       r"machine, and no GPU found \(nvidia-smi\); leave it unset"):  # fmt: skip
        check_this_machine(two)
    check_this_machine(compose_run("cluster=slurm", "cluster.gpus_per_node=2"))  # not this one
    # A dry run plans the GPUs declared, and says in a note that the run is refused here.
    assert check_this_machine(compose_run(*two_args, "dry_run=true")) == [
        "cluster.gpus_per_node=2: cluster=local runs on this machine, and no GPU found "
        "(nvidia-smi): planned as declared (the run itself is refused here)"
    ]
    monkeypatch.setattr(gpus, "detect", lambda: [gpus.Gpu(0, "H100", 80.0)] * 2)
    assert check_this_machine(two) == []
    # wandb online without a key: wandb.init failed after the run directory was made.
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    online = compose_run("wandb.mode=online", "cluster=slurm")
    with pytest.raises(PlanError, match=r"^wandb.mode=online: no wandb API key here"):
        check_this_machine(online)
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password k\n")
    (tmp_path / ".netrc").chmod(0o600)
    check_this_machine(online)
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here: nothing to refuse")
    vllm = compose_run("inference.backend=vllm", f"inference.vllm_python={sys.executable}")
    with pytest.raises(PlanError) as err:
        check_this_machine(vllm)
    assert str(err.value) == (
        f"inference.backend=vllm: {sys.executable} cannot import vLLM (No module named 'vllm'); "
        "install vLLM there, name a python that has it (inference.vllm_python=...), or use "
        "inference.backend=embedded"
    )
    dry = compose_run("inference.backend=vllm", f"inference.vllm_python={sys.executable}",
                      "dry_run=true")  # fmt: skip
    assert check_this_machine(dry) == [
        f"inference.backend=vllm: {sys.executable} cannot import vLLM (No module named 'vllm'): "
        "the run itself is refused here"
    ]


def test_the_readmes_one_gpu_dry_run_plans_without_a_gpu() -> None:
    """README: the one-GPU plan's `dry_run=true` shows it without a GPU (it was refused: "no
    GPU found"); the run itself is still refused on a machine without one."""
    from launcher.plan import gpus

    if gpus.detect():
        pytest.skip("this machine has a GPU")
    command = ["model=qwen3_0_6b", "cluster.gpus_per_node=1", "cluster.gpu_memory_gb=24"]
    dry = subprocess.run([sys.executable, "-m", "launcher.cli", *command, "dry_run=true"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert "trainer" in dry.stdout and "CUDA_VISIBLE_DEVICES=0" in dry.stdout
    assert "planned as declared (the run itself is refused here)" in dry.stdout
    assert "one GPU (24 GB) shared by inference and trainer" in dry.stdout


EXTENSION = ["--worker-extension-cls", "rl.weights.sync.VllmWorkerExtension"]


def served_args(model: str, parallel: str, served: str = "null") -> dict[str, list[str]]:
    # At the model's own served length (or `served`), not the smoke test's; one replica.
    overrides = ("cluster=slurm", f"environment.max_context_tokens={served}")
    replicas = "parallel.inference.replicas=1"
    p = plan(compose_run(f"model={model}", f"parallel={parallel}", *overrides, replicas))
    return {proc.name: proc.argv[proc.argv.index("--") + 1 :] for proc in p.role("inference")}


def test_exact_vllm_args_glm5() -> None:
    # Served at 8192 tokens: the longest GLM-5 sample its trainer fits on H100s is ~13K
    # (transformers' sparse attention is a dense reference; tests/test_sizing_memory.py).
    common = [
        "--model", "zai-org/GLM-5-FP8", "--served-model-name", "glm5",
        "--tensor-parallel-size", "1", "--data-parallel-size", "32",
        "--data-parallel-size-local", "8", "--enable-expert-parallel", "--dtype", "bfloat16",
        "--max-model-len", "8192", "--gpu-memory-utilization", "0.8", "--quantization", "fp8",
        "--speculative-config", '{"method":"mtp","num_speculative_tokens":3}',
        "--enable-auto-tool-choice", "--tool-call-parser", "glm47", "--reasoning-parser", "glm45",
        "--trust-remote-code", "--kv-transfer-config",
    ]  # fmt: skip
    kv = '{"kv_connector":"NixlConnector","kv_role":"%s"}'
    head = [
        "--data-parallel-address", "${RELAY_HEAD_ADDR}",
        "--data-parallel-rpc-port", "${RELAY_HEAD_PORT}",
    ]  # fmt: skip
    prefill, decode = ([kv % role, *EXTENSION] for role in ("kv_producer", "kv_consumer"))
    expected = {}
    for part, args in (("prefill", prefill), ("decode", decode)):
        expected[f"inference-0-{part}"] = [*common, *args, *head]
        for node in (1, 2, 3):
            start = [*head, "--headless", "--data-parallel-start-rank", str(8 * node)]
            expected[f"inference-0-{part}-node{node}"] = [*common, *args, *start]
    assert served_args("glm5", "ep8", "8192") == expected


def test_exact_vllm_args_minimax_m2() -> None:
    # 196,608 tokens of KV cache do not fit beside the weights on one node: served shorter.
    assert served_args("minimax_m2", "ep8", "65536") == {
        "inference-0": [
            "--model", "MiniMaxAI/MiniMax-M2", "--served-model-name", "minimax_m2",
            "--tensor-parallel-size", "1", "--data-parallel-size", "8",
            "--enable-expert-parallel", "--dtype", "bfloat16", "--max-model-len", "65536",
            "--gpu-memory-utilization", "0.9", "--quantization", "fp8",
            "--enable-auto-tool-choice", "--tool-call-parser", "minimax_m2",
            "--reasoning-parser", "minimax_m2", "--trust-remote-code", *EXTENSION,
        ]
    }  # fmt: skip


def test_exact_vllm_args_qwen3_30b_a3b() -> None:
    tail = ["--dtype", "bfloat16", "--max-model-len", "32768", "--gpu-memory-utilization", "0.9",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--reasoning-parser", "qwen3", *EXTENSION]  # fmt: skip
    head = ["--model", "Qwen/Qwen3-30B-A3B", "--served-model-name", "qwen3_30b_a3b"]
    assert served_args("qwen3_30b_a3b", "ep8") == {
        "inference-0": [
            *head,
            "--tensor-parallel-size",
            "1",
            "--data-parallel-size",
            "8",
            "--enable-expert-parallel",
            *tail,
        ]  # fmt: skip
    }
    assert served_args("qwen3_30b_a3b", "tp") == {
        "inference-0": [*head, "--tensor-parallel-size", "8", *tail]
    }


def test_vllm_gets_relays_worker_extension() -> None:
    """Both transports load weights through Relay's worker methods (rl/weights/sync.py)."""
    for transport in ("filesystem", "broadcast"):
        overrides = ("inference.backend=vllm", f"inference.weight_transport={transport}")
        args = plan(compose_run(*overrides)).role("inference")[0].argv
        extension = args[args.index("--worker-extension-cls") + 1]
        assert extension == "rl.weights.sync.VllmWorkerExtension"


def test_cpu_vllm_args_reserve_a_bounded_kv_cache() -> None:
    args = plan(compose_run("inference.backend=vllm")).role("inference")[0].argv
    args = args[args.index("--") + 1 :]
    assert args[args.index("--dtype") + 1] == "float32" and "--enforce-eager" in args
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(512 * 2**20)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.lr=-1", "algorithm.lr=-1.0: must be a positive number"),
        ("algorithm.lr=nan", "algorithm.lr=nan: must be a positive number"),
        ("environment.prompts_per_step=-4", "environment.prompts_per_step=-4: must be >= 1"),
        ("trainer.micro_batch_tokens=0", "trainer.micro_batch_tokens=0: must be >= 1"),
        ("inference.max_batch_size=0", "inference.max_batch_size=0: must be >= 1"),
        ("environment.group_size=100000", "environment.group_size=100000: one prompt's group"),
        ("inference.port=70000", "inference.port=70000: must be 0 (any free) to 65535"),
        ("queue.port=-1", "queue.port=-1: must be 0 (any free) to 65535"),
        ("queue.max_request_mb=0", "queue.max_request_mb=0: must be >= 1"),
        ("seed=9223372036854775808", "seed=9223372036854775808: must be between 0 and"),
        ("trainer.checkpoint_every=-5", "trainer.checkpoint_every=-5: must be >= 0"),
        ("max_restarts=-1", "max_restarts=-1: must be >= 0"),
        ("warmup.steps=-1", "warmup.steps=-1: must be >= 0"),
        ("algorithm.max_off_policy_steps=-1", "algorithm.max_off_policy_steps=-1: must be >= 0"),
        ("queue.capacity=0", "queue.capacity=0: must hold at least one step's"),
        ("cluster.master_port=0", "cluster.master_port=0: must be 1 to 65535"),
        ("cluster.time_min=0", "cluster.time_min=0: must be >= 1"),
        ("cluster.time_min=-5", "cluster.time_min=-5: must be >= 1"),
        ("timeouts.hung_s=-1", "timeouts.hung_s=-1.0: must be >= 1"),
        ("timeouts.request_s=0", "timeouts.request_s=0.0: must be a positive number"),
        ("timeouts.batch_s=nan", "timeouts.batch_s=nan: must be a positive number"),
    ],
)
def test_settings_that_cannot_work_are_refused_by_name(override: str, message: str) -> None:
    """Values that started every role before failing (some restarting in a loop), or that ran
    to the end with nonsense, fail in the plan, naming the key."""
    with pytest.raises(PlanError) as err:
        plan(compose_run(override))
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["cluster.time_min=0"], "cluster.time_min=0: must be >= 1"),
        (["cluster.signal_delay_s=-1"], "cluster.signal_delay_s=-1: must be >= 0"),
        (
            ["cluster.time_min=2", "cluster.signal_delay_s=120"],
            "cluster.signal_delay_s=120: the checkpoint warning must come before the time "
            "limit, below cluster.time_min=2 x 60 s",
        ),
    ],
)
def test_slurm_time_limits_are_refused_by_name(overrides: list[str], message: str) -> None:
    """An unlimited or negative time limit, or a checkpoint warning that would come after it,
    is refused before anything is submitted."""
    with pytest.raises(PlanError) as err:
        plan(compose_run("cluster=slurm_cpu", *overrides))
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("environment.args.agent=no/such/agent.py:play", "no file no/such/agent.py"),
        ("environment.args.agent=docs/agents/wordle_agent.py:nothing", "nothing is not a function"),
        ("environment.args.agent=no_such_module:play", "importing no_such_module failed"),
        ("environment.args.agent=''", "set exactly one of agent"),
        ("environment.args.on_drift=sometimes", "on_drift=sometimes"),
        ("environment.args.tasks=nope", "environment.args.tasks=nope"),
        ("environment.args.episode_timeout_s=0", "episode_timeout_s=0"),
    ],
)
def test_an_agent_that_cannot_run_is_refused_before_anything_starts(
    override: str, said: str
) -> None:
    with pytest.raises(PlanError, match=said):
        plan(compose_run("experiment=wordle_agent", override))
    plan(compose_run("experiment=wordle_agent"))  # the shipped one plans


# Plans that printed without a warning and could not run (found when tried from outside).


@pytest.mark.parametrize("model", ["glm5", "minimax_m2", "qwen3_30b_a3b"])
def test_models_that_need_gpus_are_refused_on_a_cluster_without(model: str) -> None:
    with pytest.raises(PlanError, match=f"model={model}: .*(needs GPUs|GB of memory)"):
        plan(compose_run(f"model={model}", "dry_run=true"))


def test_fp8_experts_that_tensor_parallelism_would_cut_need_expert_parallelism() -> None:
    with pytest.raises(PlanError, match="parallel.inference.tp=8: .*192 wide.*expert parallel"):
        plan(compose_run("model=minimax_m2", "parallel=tp", "cluster=slurm", "dry_run=true"))
    served = plan(compose_run("model=minimax_m2", "parallel=ep8", "cluster=slurm", "dry_run=true"))
    assert "--enable-expert-parallel" in served.role("inference")[0].argv
    # Not FP8: tensor parallelism may split the experts.
    plan(compose_run("model=qwen3_30b_a3b", "parallel=tp", "cluster=slurm", "dry_run=true"))


def test_a_model_without_local_weights_is_refused_before_a_run_starts(tmp_path: Path) -> None:
    """The launcher refuses it with one line and leaves no run directory; the plan (and so the
    dry run) names what is missing."""
    run_dir = tmp_path / "run"
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "model=qwen3_0_6b", "max_steps=1",
         f"hydra.run.dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0 and not run_dir.exists()
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("error: model.path: model=qwen3_0_6b") and "Qwen/Qwen3-0.6B" in line
    dry = plan(compose_run("model=qwen3_0_6b", "dry_run=true"))
    assert any(note.startswith("model.path:") for note in dry.notes)
    with pytest.raises(PlanError, match="no config.json"):
        check_weights(compose_run("model=qwen3_0_6b", f"model.path={checkpoint}"))
    (checkpoint / "config.json").write_text("{}")
    check_weights(compose_run("model=qwen3_0_6b", f"model.path={checkpoint}"))


def test_dry_run_commands_paste_into_a_shell_as_planned() -> None:
    cfg = compose_run("model=glm5", "parallel=ep8", "cluster=slurm", "dry_run=true")
    planned = plan(cfg)
    printed = format_plan(planned, cfg)
    jsons = [a for p in planned.processes for a in p.argv if a.startswith("{")]
    assert jsons  # the KV-transfer and speculative configs
    table = printed.split("\nprocess ", 1)[1].splitlines()
    for proc in planned.processes:
        line = next(x for x in table if x.startswith(f"{proc.name} "))
        command = line[line.index(proc.argv[0]) :]  # after the environment assignments
        assert shlex.split(command) == proc.argv


def slurm_plan(*overrides: str) -> Any:
    return plan(compose_run("model=qwen3_0_6b", "cluster=slurm", "dry_run=true", *overrides))


PER_ROLE = "cluster.allocation=per_role"  # a job per role: the inference job's own layout


def test_replicas_needing_part_of_a_node_are_packed_and_bound_to_their_gpus() -> None:
    """parallel=dp's eight one-GPU replicas used to take eight 8-GPU nodes (56 GPUs idle)."""
    eight = slurm_plan("parallel=dp", PER_ROLE)
    assert next(j for j in eight.jobs if j.name == "inference").nodes == 1
    placed = [(p.node, p.env["CUDA_VISIBLE_DEVICES"]) for p in eight.role("inference")]
    assert placed == [(0, str(i)) for i in range(8)]
    pairs = slurm_plan("parallel=dp", "parallel.inference.tp=2", PER_ROLE)
    placed = [(p.node, p.env["CUDA_VISIBLE_DEVICES"]) for p in pairs.role("inference")]
    assert placed == [(n, f"{2 * i},{2 * i + 1}") for n in (0, 1) for i in range(4)]
    assert next(j for j in pairs.jobs if j.name == "inference").nodes == 2
    single = slurm_plan(PER_ROLE)  # one one-GPU replica: its job asks for that one GPU
    job = next(j for j in single.jobs if j.name == "inference")
    assert (job.nodes, job.gpus_per_node) == (1, 1)
    printed = format_plan(eight, compose_run("model=qwen3_0_6b", "cluster=slurm"))
    assert "CUDA_VISIBLE_DEVICES=7 python -m rl.inference" in printed


def test_a_replica_spanning_nodes_starts_on_every_node_of_its_share() -> None:
    """glm5's replicas used to start on their first node only; each instance spans 4 nodes."""
    cfg = compose_run("model=glm5", "parallel=ep8", "cluster=slurm", "dry_run=true", PER_ROLE)
    planned = plan(cfg)
    placed = [
        (p.name, p.node, p.head, p.env["CUDA_VISIBLE_DEVICES"]) for p in planned.role("inference")
    ]
    every = "0,1,2,3,4,5,6,7"
    assert placed == [
        (f"inference-0-{part}" + (f"-node{i}" if i else ""), first + i, first, every)
        for part, first in (("prefill", 0), ("decode", 4))
        for i in range(4)
    ]
    assert next(j for j in planned.jobs if j.name == "inference").nodes == 8
    for proc in planned.role("inference"):
        role_args = proc.argv[: proc.argv.index("--")]
        assert role_args[role_args.index("--nodes") + 1] == "4"
        assert ("--node" in role_args) == ("-node" in proc.name)
    router = planned.role("router")[0]
    assert (router.name, router.node, router.argv[2]) == ("inference-0", 0, "rl.inference.router")
    trainer = planned.role("trainer")[0]
    assert trainer.env["CUDA_VISIBLE_DEVICES"] == every


def test_the_dry_run_shows_both_nodes_of_prefill_and_decode_and_the_router() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "model=glm5", "parallel=ep8", "cluster=slurm",
         "cluster.partition=gpu", "dry_run=true"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("inf")}
    for part in ("prefill", "decode"):
        head, secondary = rows[f"inference-0-{part}"], rows[f"inference-0-{part}-node1"]
        assert f"--instance {part}" in head and "--headless" not in head
        assert "--data-parallel-address ${RELAY_HEAD_ADDR}" in head
        assert "--headless --data-parallel-start-rank 8" in secondary
    assert "python -m rl.inference.router" in rows["inference-0"]
    assert "note: ${RELAY_HEAD_ADDR} and ${RELAY_HEAD_PORT}" in out.stdout


def test_a_dense_replica_spanning_gpu_nodes_is_one_multi_node_executor() -> None:
    p = slurm_plan("parallel=tp", "parallel.inference.nodes_per_replica=2")
    args = {q.name: q.argv[q.argv.index("--") + 1 :] for q in p.role("inference")}
    head, secondary = args["inference-0"], args["inference-0-node1"]
    assert head[head.index("--pipeline-parallel-size") + 1] == "2"
    spanning = ["--nnodes", "2", "--master-addr", "${RELAY_HEAD_ADDR}"]
    assert all(flag in head and flag in secondary for flag in spanning)
    assert (head[head.index("--node-rank") + 1], secondary[secondary.index("--node-rank") + 1]) == (
        "0",
        "1",
    )
    assert "--headless" in secondary and "--headless" not in head


def test_a_cpu_replica_spanning_nodes_is_one_data_parallel_engine_per_node() -> None:
    """vLLM's CPU runner fails pipeline parallelism: CPU nodes split by data parallelism."""
    cfg = compose_run(
        "cluster=slurm_cpu", "inference.backend=vllm", "parallel.inference.nodes_per_replica=2"
    )
    args = {q.name: q.argv[q.argv.index("--") + 1 :] for q in plan(cfg).role("inference")}
    head, secondary = args["inference-0"], args["inference-0-node1"]
    assert head[head.index("--data-parallel-size") + 1] == "2"
    assert head[head.index("--data-parallel-size-local") + 1] == "1"
    assert secondary[-3:] == ["--headless", "--data-parallel-start-rank", "1"]
    assert "--pipeline-parallel-size" not in head


def test_a_cpu_prefill_decode_replica_hands_kv_over_through_files() -> None:
    cfg = compose_run("inference.backend=vllm", "model.inference.pd_disaggregation=true")
    p = plan(cfg)
    assert [q.name for q in p.role("inference")] == ["inference-0-prefill", "inference-0-decode"]
    assert [q.name for q in p.role("router")] == ["inference-0"]
    for proc, role in zip(p.role("inference"), ("kv_producer", "kv_consumer"), strict=True):
        args = proc.argv[proc.argv.index("--") + 1 :]
        assert json.loads(args[args.index("--kv-transfer-config") + 1]) == {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": "${RELAY_RUN_DIR}/kv/inference-0"},
        }
        assert args[args.index("--block-size") + 1] == "32"
    nixl = plan(compose_run("model=glm5", "parallel=ep8", "cluster=slurm"))
    args = nixl.role("inference")[0].argv
    assert '"kv_connector":"NixlConnector"' in args[args.index("--kv-transfer-config") + 1]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "model.inference.pd_disaggregation=true",
            "model.inference.pd_disaggregation=true: prefill and decode instances are vLLM",
        ),
        (
            "parallel.inference.nodes_per_replica=2",
            "parallel.inference.nodes_per_replica=2: a replica spanning nodes is a vLLM head",
        ),
    ],
)
def test_what_only_vllm_serves_is_refused_for_the_embedded_engine(
    override: str, message: str
) -> None:
    with pytest.raises(PlanError) as err:
        plan(compose_run("cluster=slurm_cpu", override))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_every_node_of_a_replica_finds_the_same_head(monkeypatch: pytest.MonkeyPatch) -> None:
    from launcher.clusters.slurm import cli as slurm_cli
    from launcher.clusters.slurm.supervisor import NodeSupervisor

    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[3-6]")
    monkeypatch.setattr(slurm_cli, "hostnames", lambda _: [f"node{i}" for i in range(3, 7)])
    monkeypatch.setattr(slurm_cli, "node_address", lambda node: f"10.0.0.{node[4:]}")
    supervisor = NodeSupervisor.__new__(NodeSupervisor)
    supervisor.job_id = "1234"
    first, second = supervisor.head_values(0), supervisor.head_values(2)
    assert (first["RELAY_HEAD_ADDR"], second["RELAY_HEAD_ADDR"]) == ("10.0.0.3", "10.0.0.5")
    assert first["RELAY_HEAD_PORT"] != second["RELAY_HEAD_PORT"]
    supervisor.job_id = "1235"
    assert supervisor.head_values(0)["RELAY_HEAD_PORT"] != first["RELAY_HEAD_PORT"]


def test_each_node_supervisor_starts_the_processes_placed_on_it() -> None:
    from launcher.clusters.slurm.supervisor import NodeSupervisor

    planned = json.loads(slurm_plan("parallel=dp", "parallel.inference.tp=2", PER_ROLE).to_json())
    for node, replicas in ((0, ["0", "1", "2", "3"]), (1, ["4", "5", "6", "7"])):
        supervisor = NodeSupervisor.__new__(NodeSupervisor)
        supervisor.plan, supervisor.job, supervisor.node = planned, "inference", node
        started = [p["argv"][p["argv"].index("--replica") + 1] for p in supervisor.processes()]
        assert started == replicas


def test_one_allocation_splits_its_nodes_by_role() -> None:
    """GLM-5's run as one job of 29 nodes: the two 4-node instances on nodes 0-7, the queue,
    orchestrator and router on node 0, the trainer on nodes 8-28; each node's supervisor
    starts what is placed on it, the trainer's with its node rank among the trainer's."""
    from launcher.clusters.slurm.jobs import sbatch_flags
    from launcher.clusters.slurm.supervisor import NodeSupervisor

    cfg = compose_run("model=glm5", "parallel=ep8", "cluster=slurm")
    p = plan(cfg)
    (job,) = p.jobs
    assert (job.name, job.nodes, job.gpus_per_node, job.mem_gb) == ("run", 29, 8, 0)
    flags = sbatch_flags(job, p.run_name, cfg).split()
    assert {"--requeue", "--exclusive", "--mem=0", "--job-name=reverse_text-glm5"} <= set(flags)
    assert not any(flag.startswith("--wckey") for flag in flags)
    planned = json.loads(p.to_json())
    started = {}
    for node in (0, 4, 7, 8, 28):
        supervisor = NodeSupervisor.__new__(NodeSupervisor)
        supervisor.plan, supervisor.job, supervisor.node = planned, "run", node
        started[node] = sorted(q["name"] for q in supervisor.processes())
    assert started == {
        0: ["inference-0", "inference-0-prefill", "orchestrator", "queue"],
        4: ["inference-0-decode"],
        7: ["inference-0-decode-node3"],
        8: ["trainer"],
        28: ["trainer"],
    }
    (trainer,) = p.role("trainer")
    assert (trainer.node, trainer.nodes) == (8, 21) and "${RELAY_NODE_RANK}" in trainer.argv


def test_planned_gpus_are_the_jobs_own() -> None:
    from launcher.clusters.slurm.supervisor import bind_devices
    from launcher.errors import ConfigError

    assert bind_devices("1", None) == "1"
    assert bind_devices("0,1", "4,5,6,7") == "4,5"  # Slurm gave the job GPUs 4-7
    with pytest.raises(ConfigError, match="only 4,5"):
        bind_devices("2", "4,5")


def test_a_resumes_plan_line_says_whether_the_trainer_warms_up_again(tmp_path: Path) -> None:
    """A resume from a checkpoint does not warm up again; one before the first checkpoint
    does, and the plan line says which."""
    cfg = compose_run("warmup.steps=80")
    p, run = plan(cfg), RunDir(tmp_path)
    assert ", warm-up 80 steps, seed 0," in plan_header(p, cfg)
    assert ", warm-up 80 steps again (no checkpoint yet), seed" in plan_header(p, cfg, run)
    run.checkpoint_for(40).mkdir(parents=True)
    mark_complete(run.checkpoint_for(40))
    resumed = plan_header(p, cfg, run)
    assert ", no warm-up (resumes from checkpoint step_40), seed" in resumed
    assert "warm-up 80" not in resumed
    assert ", no warm-up, seed" in plan_header(p, compose_run("warmup.steps=0"))


def test_the_plan_says_what_trains_and_puts_the_warm_up_in_its_first_lines() -> None:
    """A custom environment evaluated 1.000 at version 0 with no word that 80 supervised steps
    on its answers had run first; the plan line named neither LoRA nor the loss."""
    cfg = compose_run("model.lora.rank=8", "algorithm=gspo", "algorithm.lr_schedule=cosine")
    shown = format_plan(plan(cfg), cfg).splitlines()
    assert ", loss gspo, LoRA rank 8 (only the adapter trains)," in shown[0]
    assert " then cosine to 0," in shown[0]
    assert shown[1].startswith("warm-up: 80 supervised steps on the environment's answers")
    cold = compose_run("warmup.steps=0")
    assert "warm-up:" not in format_plan(plan(cold), cold)
