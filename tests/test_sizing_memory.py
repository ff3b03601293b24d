"""The plan's memory model, balance and estimates at the flagship's scale (issue 38, items 3-8):
pure planning, milliseconds each. The GLM-5 arithmetic is checked against a hand calculation
written out here from its published config."""

from __future__ import annotations

import pytest

from launcher.clusters.base import cluster_of
from launcher.errors import PlanError
from launcher.plan.costs.fit import fill_gpus, replica_nodes
from launcher.plan.costs.memory import TrainerOptions, inference_memory, params, trainer_memory
from launcher.plan.planner import plan
from rl.core.config import WeightTransport
from rl.core.derive import weight_transport
from tests.support.runs import compose_run, options

GIB = 2**30
GLM5 = ("model=glm5", "parallel=ep8", "cluster=slurm")
# prime-rl's published GLM-5 run (examples/advanced/glm-5.2/swe.toml): 4096 samples a step
# (group 16) at seq_len 131072; samples average half of it here, 16K of it generated.
PRIME_RL_GLM5 = (
    "environment.prompts_per_step=256",
    "environment.group_size=16",
    "environment.max_context_tokens=131072",
    "environment.max_tokens=16384",
)

# GLM-5's config.json, by hand.
H, VOCAB, LAYERS, HEADS = 6144, 154880, 78, 64
ATTENTION = (
    H * 2048  # q_a_proj (q_lora_rank 2048)
    + 2048 * HEADS * 256  # q_b_proj to 64 heads of 192 + 64
    + H * (512 + 64)  # kv_a_proj: latent 512 + rotary key 64
    + 512 * HEADS * (192 + 256)  # kv_b_proj: nope keys and values
    + HEADS * 256 * H  # o_proj
    + 2048 * 32 * 128
    + H * 128
    + H * 32  # the indexer: 32 heads of 128
)
EXPERT = 3 * H * 2048
GLM5_PARAMS = VOCAB * H * 2 + LAYERS * ATTENTION + 3 * 3 * H * 12288 + 75 * (257 * EXPERT + 256 * H)


def test_derived_parameters_match_what_each_model_publishes() -> None:
    for name in options("model"):
        model = compose_run(f"model={name}").model
        derived = params(model).trained / 1e9
        # Published models within 1.2%; the tiny ones' totals are rounded to two digits.
        tolerance = 0.02 if name.startswith("tiny") else 0.012
        assert derived == pytest.approx(model.total_params_b, rel=tolerance), name


def test_glm5_memory_against_a_hand_calculation() -> None:
    cfg = compose_run(*GLM5)
    fill_gpus(cfg)  # cluster.gpu=h100's figures, as the plan fills them in
    assert params(cfg.model).trained == GLM5_PARAMS  # 743.9B of the published 744B
    # 16 trainer nodes (prime-rl's), EP 8, activation checkpointing, 8192-token micro-batches
    # of reverse-text samples (256 tokens at most).
    mesh = {"world": 128, "dp_replicate": 1, "dp_shard": 128, "cp": 1, "ep": 8}
    mem = trainer_memory(cfg, mesh, TrainerOptions(checkpointing=True))
    state = GLM5_PARAMS / 128 / GIB  # elements of each rank's shard
    block = (ATTENTION + EXPERT + 256 * H + 256 / 8 * EXPERT) / GIB  # one MoE block, 32 experts
    saved = 2 * (2048 + 512 + 64 + HEADS * (256 + 192 + 256 + 256) + 2 * H)  # attention
    saved += 2 * (8 * (H + 3 * 2048) + 3 * 2048 + 2 * H) + 4 * 256  # MoE and router scores
    saved += 2 * 2 * H  # residual stream
    expected = {
        # float32 master weights, gradients and AdamW's moments: 16 bytes an element
        "parameters": 4 * state,
        "gradients": 4 * state,
        "optimizer": 8 * state,
        # two blocks gathered in bf16, the block's bf16 gradient and its fp32 cast
        "gathered blocks": block * (2 * 2 + 2 + 4),
        "activations": 8192 * (LAYERS * 2 * H + saved) / GIB,
        # packed rows of 256: the DSA indexer's 32 fp32 heads (scores and their ReLU), its
        # weighted score, top-k and combined masks, the mask and SDPA's bf16 copy of it
        "attention": 8192 * 256 * (32 * 8 + 4 + 1 + 1 + 1 + 2) / GIB,
        "logits": 8192 * VOCAB * (2 + 8) / GIB,
        "expert all-to-all": 3 * 8192 * 8 * H * 2 / GIB,  # one MoE block's rows in flight
        "NCCL communicators": 5 * 1.0,  # world, FSDP, experts' FSDP, EP, weight broadcast
        "context": 1.0,
    }
    assert mem.terms == pytest.approx(expected, rel=1e-9)
    assert mem.usable == pytest.approx(79.6 * 0.95)  # an H100 as nvidia-smi reports it
    assert mem.total == pytest.approx(130.9, abs=0.1) and not mem.fits
    # The master state on the host, as the plan turns it on for this layout:
    on_host = TrainerOptions(checkpointing=True, head_chunk=2048, offload=True)
    offloaded = trainer_memory(cfg, mesh, on_host)
    assert offloaded.fits and offloaded.host_per_gpu == pytest.approx(16 * state)

    # Inference: 4 nodes x 8 GPUs per instance, TP 1, experts over 32, FP8, 0.8 of 79.6 GiB.
    served = inference_memory(cfg, 32, 131072)
    fp8 = 1 + 4 / 128**2  # a byte per weight and an fp32 scale per 128 x 128 block
    replicated = LAYERS * ATTENTION + 3 * 3 * H * 12288 + 75 * (EXPERT + 256 * H)
    mtp = ATTENTION + EXPERT + 256 * H + 2 * H * H
    assert served.terms == pytest.approx(
        {
            "replicated weights": replicated * fp8 / GIB,  # copied to every GPU: ~16 GiB
            "embeddings": VOCAB * H * 2 * 2 / GIB,
            "experts": 75 * 256 * EXPERT * fp8 / 32 / GIB,
            "MTP draft": (mtp * fp8 + 256 * EXPERT * fp8 / 32) / GIB,
            "vLLM workspace": 4.0,
        },
        rel=1e-9,
    )
    kv_per_token = LAYERS * ((512 + 64) * 2 + 128 + 4)  # bf16 latent + fp8 indexer keys
    assert served.kv_per_token == kv_per_token
    assert served.kv_cache == pytest.approx(0.8 * 79.6 - sum(served.terms.values()))
    assert served.fits and served.kv_tokens // 131072 == 1


def glm5_131k_per_gpu(served: int) -> float:
    """One GLM-5 trainer rank's memory (GiB) for samples of `served` tokens (> 8192) with all
    the plan can turn on: activation checkpointing with the block inputs on the host, the LM
    head in chunks of 2048, the master state on the host (CP is refused: DSA); by hand."""
    block = (ATTENTION + EXPERT + 256 * H + 256 / 8 * EXPERT) / GIB
    saved = 2 * (2048 + 512 + 64 + HEADS * (256 + 192 + 256 + 256) + 2 * H)
    saved += 2 * (8 * (H + 3 * 2048) + 3 * 2048 + 2 * H) + 4 * 256 + 2 * 2 * H
    return (
        block * 10  # gathered blocks
        + served * (2 * 2 * H + saved) / GIB  # two block inputs in flight, one block recomputed
        + served**2 * (32 * 8 + 9) / GIB  # the dense DSA indexer and masks, one sample alone
        + (2048 * VOCAB * (2 + 12) + served * H * 2) / GIB  # one chunk of logits, head input
        + 3 * served * 8 * H * 2 / GIB  # expert all-to-all
        + 5 * 1.0  # NCCL communicators
        + 1.0  # CUDA context
    )


@pytest.mark.parametrize(
    ("gpu", "usable", "longest"), [("h100", 75.62, 13213), ("h200", 133.38, 19755)]
)
def test_glm5_at_131k_tokens_is_refused_naming_every_term(
    gpu: str, usable: float, longest: int
) -> None:
    """prime-rl's GLM-5 workload (131,072-token samples) against the trainer as it is: its
    attention is transformers' DeepSeek sparse attention, whose indexer scores every query
    against every key (32 fp32 heads), which context parallelism does not split. The plan
    refuses, naming every term, and says the longest sample that fits (checked by hand: it
    fits, one token more does not)."""
    cfg = compose_run(*GLM5, *PRIME_RL_GLM5, f"cluster.gpu={gpu}")
    with pytest.raises(PlanError) as refused:
        plan(cfg)
    message = str(refused.value)
    assert message.startswith("cluster.nodes: model=glm5 does not fit 512 trainer GPUs")
    for term in (
        "activation checkpointing, LM head in chunks of 2,048 tokens, activation offload, "
        "CPU offload; context parallelism does not split this model's sparse-attention indexer",
        f"of {usable:.1f} GiB usable",
        "attention 4240.0",  # 131072^2 pairs x 265 bytes
        "logits 5.6",
        "expert all-to-all 36.0",
        f"a served length of at most {longest:,} tokens",
    ):
        assert term in message, term
    assert glm5_131k_per_gpu(longest) <= usable < glm5_131k_per_gpu(longest + 1)
    with pytest.raises(PlanError, match="parallel.trainer.cp=2: .* sparse attention"):
        plan(compose_run(*GLM5, "parallel.trainer.cp=2"))


def test_a_long_context_moe_plans_context_parallelism_and_the_chunked_head() -> None:
    """MiniMax-M2 (grouped-query attention) at 131,072 tokens on 16 trainer nodes: the plan
    turns on checkpointing, the chunked head and CP 4 (not offload), records them, and its
    trainer line shows the long-context terms."""
    cfg = compose_run(
        "model=minimax_m2", "parallel=ep8", "cluster=slurm", "parallel.trainer.nodes=16",
        "environment.max_context_tokens=131072", "environment.max_tokens=16384",
    )  # fmt: skip
    p = plan(cfg)
    cfg = p.config  # as planned: what the run directory records
    assert p.mesh["cp"] == 4 and cfg.parallel.trainer.cp == 4
    trainer = cfg.trainer
    assert trainer.activation_checkpointing and trainer.lm_head_chunk == 2048
    assert not trainer.activation_offload and not trainer.cpu_offload
    note = next(n for n in p.notes if n.startswith("trainer memory per GPU"))
    for term in ("cp 4", "micro-batches of up to 131,072 tokens", "gathered K/V (CP)", "logits"):
        assert term in note, term


def test_gpu_presets_fill_the_figures_the_plan_uses() -> None:
    c = plan(compose_run(*GLM5, "cluster.gpu=h200")).config.cluster
    assert (c.gpu_memory_gb, c.gpu_tflops, c.gpu_bandwidth_gbs, c.link_gbs) == (
        140.4,
        989.0,
        4800.0,
        50.0,
    )
    # a set figure stays; the rest are the preset's
    mine = plan(compose_run(*GLM5, "cluster.gpu=b200", "cluster.link_gbs=100")).config
    assert (mine.cluster.gpu_tflops, mine.cluster.link_gbs) == (2250.0, 100.0)


def test_activations_turn_on_checkpointing_or_refuse_with_numbers() -> None:
    p = plan(compose_run(*GLM5, "parallel.trainer.nodes=26"))
    assert p.config.trainer.activation_checkpointing
    note = next(n for n in p.notes if n.startswith("trainer memory per GPU"))
    assert "activation checkpointing" in note and "activations" in note and "logits" in note
    # 744B float32 master weights and moments are 11.9 TB: 208 GPUs hold them only on the host
    assert p.config.trainer.cpu_offload
    with pytest.raises(PlanError, match=r"does not fit 32 trainer GPUs .* activations"):
        plan(compose_run(*GLM5, "parallel.trainer.nodes=4"))


def test_replicated_weights_and_kv_size_the_replica() -> None:
    # One instance serving 131,072-token samples spans four nodes (its trainer is refused at
    # that length: the test above).
    cfg = compose_run(*GLM5, "environment.max_context_tokens=131072")
    fill_gpus(cfg)
    assert replica_nodes(cfg) == 4
    with pytest.raises(PlanError, match=r"nodes_per_replica=2: .* no KV cache .* replicated"):
        plan(compose_run(*GLM5, "parallel.inference.nodes_per_replica=2"))


def test_balance_is_of_the_order_of_prime_rls_glm5_layout() -> None:
    # prime-rl's batch (4096 samples), at 8192 tokens: the longest GLM-5 trains at here.
    cfg = compose_run(*GLM5, *PRIME_RL_GLM5[:2], "environment.max_context_tokens=8192",
                      "environment.max_tokens=4096")  # fmt: skip
    p = plan(cfg)
    trainer = p.role("trainer")[0].nodes
    jobs = {"trainer": trainer, "inference": p.jobs[0].nodes - trainer}  # one allocation
    # prime-rl: 16 trainer nodes, 16 inference nodes (2 x (4 prefill + 4 decode)); the float32
    # master state takes more trainer nodes here.
    assert 8 <= jobs["trainer"] <= 48 and 8 <= jobs["inference"] <= 32, jobs
    balance = next(n for n in p.notes if n.startswith("balance per step"))
    waits = [int(w) for w in __import__("re").findall(r"(\d+)%", balance)]
    assert max(waits) < 50, balance  # neither side waits most of the step


def test_weight_sync_is_estimated_against_the_link_and_disk() -> None:
    # At scale the default is NCCL broadcast, prefill/decode instances included. Rank 0
    # gathers the bf16 version from 168 ranks' shards (1,488 GB x 167/168 over one 50 GB/s
    # link at 80%: 37.0 s), re-quantizes it to FP8 on its GPU (4 passes over 1,488 GB at 70%
    # of 3,350 GB/s: 2.5 s), and broadcasts 746 GB over the link (18.6 s).
    cfg = compose_run(*GLM5)
    p = plan(cfg)
    assert cfg.inference.weight_transport is None  # the config given is left as it is
    assert weight_transport(p.config) == WeightTransport.broadcast  # as the plan decided it
    assert weight_transport(compose_run(*GLM5), spans_nodes=True) == WeightTransport.broadcast
    note = next(n for n in p.notes if n.startswith("weight sync"))
    for part in (
        "weight sync ~58.2 s a version",
        "gathers 1,488 GB (bfloat16) block by block at 50 GB/s (~37.0 s)",
        "re-quantizes it to FP8 on its GPU (~2.5 s)",
        "broadcasts 746 GB by NCCL in buckets at 50 GB/s per GPU link (~18.6 s",
    ):
        assert part in note, note
    disk = plan(compose_run(*GLM5, "inference.weight_transport=filesystem"))
    note = next(n for n in disk.notes if n.startswith("weight sync"))
    assert "writes 746 GB through the filesystem" in note and "TB)" in note
    # Where broadcast is not the default: one machine, CPUs, LoRA (vLLM loads adapters from
    # directories), colocated roles.
    for overrides in (
        (),
        ("cluster=slurm_cpu",),
        (*GLM5, "model.lora.rank=16"),
        ("cluster=slurm", "cluster.gpus_per_node=8", "placement=colocated"),
    ):
        cfg = compose_run(*overrides)
        assert weight_transport(cfg, cluster_of(cfg).spans_nodes) == WeightTransport.filesystem


def test_signal_delay_covers_the_step_and_the_checkpoint() -> None:
    full = plan(compose_run(*GLM5)).config.cluster.signal_delay_s
    assert full > 120  # 8.9 TB at 20 GB/s is ~7 min, after the step under way
    light = plan(compose_run(*GLM5, "trainer.stop_checkpoint_optimizer=false")).config
    assert light.cluster.signal_delay_s < full
    with pytest.raises(PlanError, match=r"signal_delay_s=120: too short: .* 8.9 TB"):
        plan(compose_run(*GLM5, "cluster.signal_delay_s=120"))
    with pytest.raises(PlanError, match="more than half of cluster.time_min=10"):
        plan(compose_run(*GLM5, "cluster.time_min=10"))


def test_control_job_goes_to_the_cpu_partition() -> None:
    """Per role, the control job (no GPUs) asks only the cluster.cpu_* options, not the GPU
    jobs' constraint, QOS or extra sbatch options; one allocation has no control job."""
    site = (
        "cluster.partition=gpu", "cluster.cpu_partition=cpu", "cluster.constraint=h100",
        "cluster.qos=high", "cluster.account=lab", "+cluster.sbatch_extra.comment=x",
    )  # fmt: skip
    p = plan(compose_run(*GLM5, *site, "cluster.allocation=per_role"))
    asked = {j.name: (j.partition, j.account, j.qos, j.constraint, j.sbatch_extra) for j in p.jobs}
    gpu = ("gpu", "lab", "high", "h100", {"comment": "x"})
    assert asked == {"control": ("cpu", "lab", None, None, {}), "inference": gpu, "trainer": gpu}
    assert {j.name: j.partition for j in plan(compose_run(*GLM5, *site)).jobs} == {"run": "gpu"}


def test_flagship_defaults_no_warm_up_and_the_environments_served_length() -> None:
    cfg = compose_run(*GLM5)
    p = plan(cfg)
    assert cfg.warmup.steps == 0 and compose_run().warmup.steps == 80  # tiny still warms up
    assert p.max_model_len == 256  # reverse_text's need, not 131072
