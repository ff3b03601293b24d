"""The plan's memory model, balance and estimates at the flagship's scale (issue 38, items 3-8):
pure planning, milliseconds each. The GLM-5 arithmetic is checked against a hand calculation
written out here from its published config."""

from __future__ import annotations

import pytest

from launcher.errors import PlanError
from launcher.memory import inference_memory, params, trainer_memory
from launcher.plan import plan
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
    assert params(cfg.model).trained == GLM5_PARAMS  # 743.9B of the published 744B
    # 16 trainer nodes (prime-rl's), EP 8, activation checkpointing, 8192-token micro-batches.
    mesh = {"world": 128, "dp_replicate": 1, "dp_shard": 128, "cp": 1, "ep": 8}
    mem = trainer_memory(cfg, mesh, checkpointing=True, offload=False)
    state = GLM5_PARAMS * 2 / 128 / GIB  # bf16, sharded over 128 ranks: 10.8 GiB
    block = (ATTENTION + EXPERT + 256 * H + 256 / 8 * EXPERT) / GIB  # one MoE block, 32 experts
    saved = 2 * (2048 + 512 + 64 + HEADS * (256 + 192 + 256 + 256) + 2 * H)  # attention
    saved += 2 * (8 * (H + 3 * 2048) + 3 * 2048 + 2 * H) + 4 * 256  # MoE and router scores
    saved += 2 * 2 * H  # residual stream
    expected = {
        "parameters": state,
        "gradients": state,
        "optimizer": 2 * state,
        "gathered blocks": block * (2 * 2 + 4),
        "activations": 8192 * (LAYERS * 2 * H + saved) / GIB,
        "logits": 8192 * VOCAB * (2 + 8) / GIB,
        "context": 1.0,
    }
    assert mem.terms == pytest.approx(expected, rel=1e-9)
    assert mem.total == pytest.approx(77.2, abs=0.1) and not mem.fits  # > 0.95 x 80
    assert trainer_memory(cfg, mesh, checkpointing=True, offload=True).fits

    # Inference: 4 nodes x 8 GPUs per instance, TP 1, experts over 32, FP8, 0.8 of 80 GiB.
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
    assert served.kv_cache == pytest.approx(64 - sum(served.terms.values()))
    assert served.fits and served.kv_tokens // 131072 == 1


def test_item3_activations_turn_on_checkpointing_or_refuse_with_numbers() -> None:
    p_cfg = compose_run(*GLM5, "parallel.trainer.nodes=26")
    p = plan(p_cfg)
    assert p_cfg.trainer.activation_checkpointing and not p_cfg.trainer.cpu_offload
    note = next(n for n in p.notes if n.startswith("trainer memory per GPU"))
    assert "activation checkpointing" in note and "activations" in note and "logits" in note
    few = compose_run(*GLM5, "parallel.trainer.nodes=16")
    plan(few)  # 16 nodes fit only with the optimiser state on the host, as prime-rl runs
    assert few.trainer.cpu_offload
    with pytest.raises(PlanError, match=r"does not fit 32 trainer GPUs .* activations"):
        plan(compose_run(*GLM5, "parallel.trainer.nodes=4"))


def test_item4_replicated_weights_and_kv_size_the_replica() -> None:
    p = plan(compose_run(*GLM5, "environment.max_context_tokens=131072"))
    prefill = [q for q in p.role("inference") if q.name.startswith("inference-0-prefill")]
    assert len(prefill) == 4  # nodes of one instance
    with pytest.raises(PlanError, match=r"nodes_per_replica=2: .* no KV cache .* replicated"):
        plan(compose_run(*GLM5, "parallel.inference.nodes_per_replica=2"))


def test_item5_balance_is_of_the_order_of_prime_rls_glm5_layout() -> None:
    cfg = compose_run(*GLM5, *PRIME_RL_GLM5)
    p = plan(cfg)
    jobs = {j.name: j.nodes for j in p.jobs}
    # prime-rl: 16 trainer nodes, 16 inference nodes (2 x (4 prefill + 4 decode)).
    assert 8 <= jobs["trainer"] <= 32 and 8 <= jobs["inference"] <= 32, jobs
    balance = next(n for n in p.notes if n.startswith("balance per step"))
    waits = [int(w) for w in __import__("re").findall(r"(\d+)%", balance)]
    assert max(waits) < 50, balance  # neither side waits most of the step


def test_item6_weight_sync_is_estimated_against_the_link_and_disk() -> None:
    # At scale the default is NCCL broadcast, prefill/decode instances included: 746 GB over
    # one 50 GB/s link at 80% is 18.6 s, against 746 GB x (1 write + 2 reads) at 20 GB/s.
    cfg = compose_run(*GLM5)
    p = plan(cfg)
    assert weight_transport(cfg) == WeightTransport.broadcast
    note = next(n for n in p.notes if n.startswith("weight sync"))
    assert "746 GB per version by NCCL broadcast in buckets at 50 GB/s" in note, note
    assert "~18.6 s" in note
    disk = plan(compose_run(*GLM5, "inference.weight_transport=filesystem"))
    note = next(n for n in disk.notes if n.startswith("weight sync"))
    assert "746 GB per version through the filesystem" in note and "TB)" in note
    # Where broadcast is not the default: one machine, CPUs, LoRA (vLLM loads adapters from
    # directories), colocated roles.
    for overrides in (
        (),
        ("cluster=slurm_cpu",),
        (*GLM5, "model.lora.rank=16"),
        ("cluster=slurm", "cluster.gpus_per_node=8", "placement=colocated"),
    ):
        assert weight_transport(compose_run(*overrides)) == WeightTransport.filesystem


def test_item7_signal_delay_covers_the_step_and_the_checkpoint() -> None:
    cfg = compose_run(*GLM5)
    plan(cfg)
    full = cfg.cluster.signal_delay_s
    assert full > 120  # 4.5 TB at 20 GB/s is ~4 min, after the step under way
    light = compose_run(*GLM5, "trainer.stop_checkpoint_optimizer=false")
    plan(light)
    assert light.cluster.signal_delay_s < full
    with pytest.raises(PlanError, match=r"signal_delay_s=120: too short: .* 4.46 TB"):
        plan(compose_run(*GLM5, "cluster.signal_delay_s=120"))
    with pytest.raises(PlanError, match="more than half of cluster.time_min=10"):
        plan(compose_run(*GLM5, "cluster.time_min=10"))


def test_item8_control_job_goes_to_the_cpu_partition() -> None:
    p = plan(compose_run(*GLM5, "cluster.partition=gpu", "cluster.cpu_partition=cpu"))
    partitions = {j.name: j.partition for j in p.jobs}
    assert partitions == {"control": "cpu", "inference": "gpu", "trainer": "gpu"}


def test_flagship_defaults_no_warm_up_and_the_environments_served_length() -> None:
    cfg = compose_run(*GLM5)
    p = plan(cfg)
    assert cfg.warmup.steps == 0 and compose_run().warmup.steps == 80  # tiny still warms up
    assert p.max_model_len == 256  # reverse_text's need, not 131072
