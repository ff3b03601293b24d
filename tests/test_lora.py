"""LoRA (`model.lora.rank > 0`): the trainer steps only the adapter (after a warm-up that trains
the base), under FSDP2 as in one process; checkpoints hold the adapter and its optimiser and
resume into the same steps; version 0 is published as the full base and later versions as PEFT
adapter directories; the embedded engine serves them (from disk, by broadcast, after a restart)
exactly as the PEFT model computes; the plan refuses what cannot run.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader

from launcher.errors import PlanError
from launcher.plan.planner import plan
from rl.core import lora
from rl.core.auth import token_auth
from rl.core.kinds import is_train
from rl.core.model import encode_prompt, ensure_checkpoint, load_model, load_tokenizer
from rl.core.rundir import CHECKSUMS, RunDir, write_checksums
from rl.core.runtime import wait_for_address
from rl.inference import adapters
from rl.inference.engine import CompletionJob, Engine, LoadJob
from rl.inference.engines import engine_of
from rl.trainer import lora as lora_trainer
from rl.weights import lora as lora_weights
from rl.weights.broadcast import InferenceBroadcaster
from tests.support import dist_workers, parallel
from tests.support.lora import PROMPTS, adapted, greedy_ids, load, served_greedy
from tests.support.parallel import RTOL, assert_same_gradients, prepare
from tests.support.runs import (
    ROOT,
    TOKEN,
    compose_run,
    run_to_end,
    start_role,
    stop_role,
    write_run_dir,
)

cache = parallel.cache  # the module's model cache (a fixture)

LORA = ("model.lora.rank=8", "warmup.steps=2", "warmup.batch_size=8")
TARGETS = 4 * 2  # the tiny model's attention projections, two blocks


@pytest.fixture(scope="module")
def runs(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:  # noqa: F811
    """One process and two FSDP2 ranks, each: warm-up, version 0, steps 1-3 (checkpoint and
    version 2 after step 2) saved as `<run>/straight_<step>.pt`; then two ranks resume the
    FSDP2 run's checkpoint into step 3 again (`<run>/again_3.pt`)."""
    tmp = tmp_path_factory.mktemp("lora")
    single, init_1 = prepare(tmp, "single", *LORA, "parallel=single")
    fsdp, init_2 = prepare(tmp, "fsdp2", *LORA, "parallel=fsdp")
    moe = ("model=tiny_qwen3_moe", *LORA)
    moe_1, moe_init_1 = prepare(tmp, "moe-single", *moe, "parallel=single")
    moe_2, moe_init_2 = prepare(tmp, "moe-ep2", *moe, "parallel=fsdp", "parallel.trainer.ep=2")
    layouts = ((1, single, init_1, moe_1, moe_init_1), (2, fsdp, init_2, moe_2, moe_init_2))
    for world, run_dir, init, moe_dir, moe_init in layouts:
        one = (dist_workers.one_step, f"{init}_one", str(run_dir), (f"{run_dir}/one_step.pt",))
        job = (dist_workers.lora_steps, str(init), str(run_dir), (f"{run_dir}/straight", 1, 3))
        experts = (dist_workers.one_step, str(moe_init), str(moe_dir), (f"{moe_dir}/one.pt",))
        jobs = [one, job, experts]
        mp.spawn(dist_workers.in_sequence, args=(world, jobs), nprocs=world, join=True)
    again = (dist_workers.lora_steps, f"{init_2}_again", str(fsdp), (f"{fsdp}/again", 3, 3))
    mp.spawn(dist_workers.in_sequence, args=(2, [again]), nprocs=2, join=True)
    return {"single": single, "fsdp2": fsdp, "moe-single": moe_1, "moe-ep2": moe_2}


def saved(run_dir: Path, phase: str, step: int) -> dict[str, Any]:
    return torch.load(run_dir / f"{phase}_{step}.pt")


def test_only_the_adapter_trains_after_a_warm_up_of_the_base(runs: dict[str, Path]) -> None:
    run_dir = runs["single"]
    built = load_model(ensure_checkpoint(compose_run().model)).state_dict()
    first, last = saved(run_dir, "straight", 1), saved(run_dir, "straight", 3)
    assert len(first["stepped"]) == 2 * TARGETS  # A and B of each adapted module
    assert all(lora.is_adapter_name(name) for name in first["stepped"])
    base_1, base_3 = (
        lora_weights.base_tensors(first["state"]),
        lora_weights.base_tensors(last["state"]),
    )
    assert base_1.keys() == built.keys()
    assert any(not torch.equal(base_1[k], built[k]) for k in built)  # the warm-up trained it
    assert all(torch.equal(base_1[k], base_3[k]) for k in built)  # RL steps did not
    adapter_1, adapter_3 = (
        lora_weights.adapter_tensors(first["state"]),
        lora_weights.adapter_tensors(last["state"]),
    )
    assert len(adapter_1) == 2 * TARGETS
    assert all(t.abs().sum() > 0 for k, t in adapter_1.items())  # B moved off zero at step 1
    assert all(not torch.equal(adapter_1[k], adapter_3[k]) for k in adapter_1)


def assert_same_adapter_step(reference: Path, other: Path) -> None:
    """Two layouts' one step (tests/support/dist_workers.py's one_step): the same loss, and
    gradients for the adapter only, the same to float32 rounding."""
    want, got = torch.load(reference), torch.load(other)
    assert got["loss"] == pytest.approx(want["loss"], rel=RTOL)
    assert len(want["grads"]) == 2 * TARGETS
    assert all(lora.is_adapter_name(name) for name in want["grads"])
    assert_same_gradients(got["grads"], want["grads"])


def test_fsdp2_trains_the_adapter_of_one_process(runs: dict[str, Path]) -> None:
    """Two FSDP2 ranks compute one process's loss and adapter gradients (to float32 rounding
    of the other summation order), and only the adapter's."""
    assert_same_adapter_step(runs["single"] / "one_step.pt", runs["fsdp2"] / "one_step.pt")
    # Warm-up (the base trains) and steps (the adapter trains) under FSDP2 land on one
    # process's weights, to float32 rounding: the runs step Adam with an epsilon that makes each
    # step a smooth function of the gradient (tests/support/parallel.py's `prepare`). A weight
    # that did not train, or trained wrongly, is off by whole steps of lr (3e-4 and 1e-3 here).
    for step in (1, 2, 3):
        want = saved(runs["single"], "straight", step)["state"]
        got = saved(runs["fsdp2"], "straight", step)["state"]
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_expert_parallelism_trains_an_adapter_on_the_attention_of_a_moe(
    runs: dict[str, Path],
) -> None:
    """Qwen3-MoE with its experts split over two EP ranks: the attention adapter's gradients
    are one process's (the experts, not adapted, get none)."""
    assert_same_adapter_step(runs["moe-single"] / "one.pt", runs["moe-ep2"] / "one.pt")


def test_the_checkpoint_holds_the_adapter_and_resumes_into_the_same_step(
    runs: dict[str, Path],
) -> None:
    run_dir = runs["fsdp2"]
    metadata = FileSystemReader(run_dir / "checkpoints" / "step_2").read_metadata()
    model_keys = [k for k in metadata.state_dict_metadata if k.startswith("model.")]
    assert len(model_keys) == 2 * TARGETS
    assert all(lora.is_adapter_name(k) for k in model_keys)
    assert any(
        k.startswith("optim.state.") and ".lora_B." in k for k in metadata.state_dict_metadata
    )
    # Resumed on its version-0 base (the warm-up's), the same ranks repeat step 3 bit for bit.
    want, got = saved(run_dir, "straight", 3)["state"], saved(run_dir, "again", 3)["state"]
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_versions_are_the_base_in_full_then_peft_adapters(runs: dict[str, Path]) -> None:
    from peft import PeftModel

    run_dir = runs["single"]
    layout = RunDir(run_dir)
    state_1, state_2 = (saved(run_dir, "straight", s)["state"] for s in (1, 2))
    step_0 = load_model(layout.weights_for(0)).state_dict()
    base = lora_weights.base_tensors(state_1)
    assert step_0.keys() == base.keys() and all(torch.equal(step_0[k], base[k]) for k in base)
    step_2 = layout.weights_for(2)
    assert sorted(p.name for p in step_2.iterdir()) == sorted([
        "COMPLETE", CHECKSUMS, lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS,
    ])  # fmt: skip
    tensors = load_file(step_2 / lora.ADAPTER_WEIGHTS)
    want = lora_weights.adapter_tensors(state_2)
    assert tensors.keys() == want.keys() and all(torch.equal(tensors[k], want[k]) for k in want)
    # PEFT reads it onto version 0 and computes what the trainer's model computed.
    peft = PeftModel.from_pretrained(load_model(layout.weights_for(0)), step_2).eval()
    trainer = lora_trainer.wrap(load_model(layout.weights_for(0)), compose_run(*LORA).model)
    trainer.load_state_dict({k: v for k, v in state_2.items()}, strict=True)
    ids = torch.tensor([[1, 10, 11, 12, 13]])
    with torch.no_grad():
        torch.testing.assert_close(peft(ids).logits, trainer.eval()(ids).logits)


def test_export_merges_the_newest_adapter_into_full_weights(runs: dict[str, Path]) -> None:
    """`rl action=export run_dir=...`: the newest version (2, an adapter) merged into its base
    as an HF checkpoint that computes what the trainer's model did."""
    run_dir = runs["single"]
    out = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "action=export", f"run_dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    target = run_dir / "export" / "step_2"
    assert out.stdout.strip().endswith(f"full weights: {target}")
    assert (target / "COMPLETE").exists() and not lora.is_adapter_dir(target)
    trainer = lora_trainer.wrap(
        load_model(RunDir(run_dir).weights_for(0)), compose_run(*LORA).model
    )
    trainer.load_state_dict(saved(run_dir, "straight", 2)["state"])
    ids = torch.tensor([[1, 10, 11, 12, 13]])
    with torch.no_grad():
        torch.testing.assert_close(load_model(target)(ids).logits, trainer.eval()(ids).logits)


# The embedded engine serving a LoRA run.

SERVED = ("model.lora.rank=8", "inference.backend=embedded")


@pytest.fixture(scope="module")
def served(
    cache: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SimpleNamespace]:
    """An embedded server started on a LoRA run that has published version 0 (the base) and
    version 1 (an adapter): it must come up serving version 1."""
    cfg = compose_run(*SERVED)
    run_dir = write_run_dir(tmp_path_factory.mktemp("run"), cfg, TOKEN)
    tokenizer = load_tokenizer(ensure_checkpoint(cfg.model))
    first, second = adapted(cfg, seed=1), adapted(cfg, seed=2)
    layout = RunDir(run_dir)
    layout.weights.mkdir(parents=True)
    for version in (0, 1):
        lora_weights.publish(version, first, tokenizer, None, layout)
    proc = start_role("inference", run_dir, "--replica", "0")
    try:
        try:
            url = wait_for_address(run_dir, "inference-0", timeout=120)
        except TimeoutError:
            pytest.fail((run_dir / "inference.log").read_text()[-3000:])
        with httpx.Client(base_url=url, auth=token_auth(TOKEN), timeout=60) as client:
            yield SimpleNamespace(
                cfg=cfg, run_dir=run_dir, client=client, tokenizer=tokenizer,
                first=first, second=second,
            )  # fmt: skip
    finally:
        stop_role(proc)


@pytest.mark.slow
def test_the_engine_serves_adapters_from_disk_as_peft_computes(served: SimpleNamespace) -> None:
    tokenizer = served.tokenizer
    with served.first.disable_adapter():
        base = greedy_ids(served.first, tokenizer)
    first, second = greedy_ids(served.first, tokenizer), greedy_ids(served.second, tokenizer)
    assert first != base != second != first  # the adapters change what is decoded
    # Started on a run with versions 0 and 1 published: the adapter on its base.
    assert served_greedy(served) == (1, first)
    lora_weights.publish(2, served.second, tokenizer, None, RunDir(served.run_dir))
    assert load(served, 2).json()["policy_version"] == 2
    assert served_greedy(served) == (2, second)


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.slow
def test_the_engine_takes_an_adapter_by_broadcast_and_only_its_tensors_travel(
    served: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    sender = InferenceBroadcaster(
        served.run_dir,
        served.cfg,
        logging.getLogger("test.lora"),
        checkpoint_layout=engine_of(served.cfg).checkpoint_layout,
    )
    with caplog.at_level(logging.INFO, logger="test.lora"):
        sender.publish(3, served.first)
    assert served_greedy(served) == (3, greedy_ids(served.first, served.tokenizer))
    sent = float(re.search(r"broadcast version 3 over gloo: ([\d.]+) MB", caplog.text)[1])
    adapter = nbytes(lora_weights.adapter_tensors(served.first.state_dict()).values()) / 1e6
    full = nbytes(served.first.get_base_model().parameters()) / 1e6
    assert sent == pytest.approx(adapter, abs=0.05) and sent < full / 10


@pytest.mark.slow
def test_an_adapter_that_does_not_fit_is_refused_and_nothing_changes(
    served: SimpleNamespace,
) -> None:
    before = served_greedy(served)
    layout = RunDir(served.run_dir)
    lora_weights.publish(9, served.second, served.tokenizer, None, layout)
    weights = layout.weights_for(9) / lora.ADAPTER_WEIGHTS
    tensors = load_file(weights)
    name = next(k for k in tensors if ".lora_A." in k)
    tensors[name] = torch.zeros(8, 100)  # the module takes 128 inputs
    save_file(tensors, weights)
    write_checksums(weights.parent)  # as if the trainer had written it so
    response = load(served, 9)
    assert response.status_code == 400
    assert "do not fit its 128 -> " in response.json()["detail"]
    assert served_greedy(served) == before


def test_the_plan_refuses_what_lora_cannot_run() -> None:
    with pytest.raises(PlanError, match="no default LoRA targets for model_type foo"):
        plan(compose_run("model.lora.rank=8", "model.model_type=foo"))
    with pytest.raises(PlanError, match="LoRA on routed experts is not built"):
        plan(compose_run("model=tiny_qwen3_moe", "model.lora.rank=8",
                         "model.lora.target_modules=[experts]"))  # fmt: skip
    with pytest.raises(PlanError, match=r"model.lora.rank=32: above inference.max_lora_rank=16"):
        plan(compose_run("model.lora.rank=32", "inference.max_lora_rank=16"))
    with pytest.raises(PlanError, match="vLLM loads LoRA adapters from their directories"):
        plan(compose_run("model.lora.rank=8", "inference.backend=vllm",
                         "inference.weight_transport=broadcast"))  # fmt: skip
    with pytest.raises(PlanError, match="vLLM serves adapters up to rank 512"):
        plan(compose_run("model.lora.rank=1024", "inference.backend=vllm"))
    # vLLM gets LoRA on, at the smallest rank it accepts that holds the run's.
    served = plan(compose_run("model.lora.rank=12", "inference.backend=vllm",
                              "inference.max_loras=3"))  # fmt: skip
    (server,) = served.role("inference")
    args = " ".join(server.argv)
    assert "--enable-lora --max-lora-rank 16 --max-loras 3" in args
    note = next(n for n in plan(compose_run(*SERVED)).notes if n.startswith("LoRA"))
    assert note.startswith("LoRA rank 8 (scale 2) on q_proj, k_proj, v_proj, o_proj")
    # Explicit targets for a family without defaults make it plannable.
    custom = plan(
        compose_run(*SERVED, "model.model_type=foo", "model.lora.target_modules=[q_proj]")
    )
    assert any("on q_proj:" in n for n in custom.notes)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["filesystem", "broadcast"])
def test_a_lora_run_moves_only_adapters_to_inference(
    tmp_path: Path,
    cache: Path,  # noqa: F811
    transport: str,
) -> None:
    """A whole run (trainer, queue, orchestrator, embedded inference): every version after 0
    is an adapter, reaches inference, and moves over ten times fewer bytes than the weights."""
    run_dir = tmp_path / "run"
    overrides = (
        "model.lora.rank=16",
        "max_steps=4",
        "warmup.steps=10",
        "trainer.checkpoint_every=2",
    )
    records = run_to_end(run_dir, cache, *overrides, f"inference.weight_transport={transport}",
                         WANDB_MODE="disabled")  # fmt: skip
    train = [r for r in records if is_train(r)]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    update, full = train[-1]["weights/update_bytes"], train[-1]["weights/full_bytes"]
    assert update * 10 < full
    layout = RunDir(run_dir)
    published = layout.published_versions()
    assert published[0] == 0 and not lora.is_adapter_dir(layout.weights_for(0))
    assert published[1:] and all(lora.is_adapter_dir(layout.weights_for(v)) for v in published[1:])
    inference = (run_dir / "logs" / "inference-0.log").read_text()
    # Every version by broadcast; from disk, the orchestrator loads the newest, skipping any
    # that a faster trainer already replaced.
    loaded = [int(v) for v in re.findall(r"loaded version (\d+) from ", inference)]
    assert loaded == [0, 1, 2, 3, 4] if transport == "broadcast" else loaded[-1] == 4, inference
    assert loaded[0] == 0 and len(loaded) >= 3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["weights/update_bytes"] == update and summary["weights/full_bytes"] == full


@pytest.mark.gpu
def test_the_engine_applies_adapters_on_the_gpu(tmp_path: Path, cache: Path) -> None:  # noqa: F811
    """The engine on CUDA, version 0 then an adapter from disk: what PEFT's model decodes."""
    cfg = compose_run(*SERVED, "cluster.gpus_per_node=1")
    tokenizer = load_tokenizer(ensure_checkpoint(cfg.model))
    model = adapted(cfg, seed=1)
    layout = RunDir(write_run_dir(tmp_path / "run", cfg, TOKEN))
    layout.weights.mkdir(parents=True)
    for version in (0, 1):
        lora_weights.publish(version, model, tokenizer, None, layout)
    served = load_model(ensure_checkpoint(cfg.model), device="cuda").eval()
    engine = Engine(served, tokenizer, cfg, logging.getLogger("test.lora"))
    engine.start()
    try:
        for version in (0, 1):
            engine.submit(LoadJob(layout.weights_for(version), version)).result(timeout=60)
        prompts = [encode_prompt(tokenizer, p) for p in PROMPTS]
        version, samples = engine.submit(CompletionJob(prompts, 1, 12, 0.0, None)).result(60)
    finally:
        engine.stop()
    assert version == 1
    assert [s.token_ids for s in samples] == greedy_ids(model.to("cuda"), tokenizer)


@pytest.mark.slow
def test_two_adapters_are_served_side_by_side_under_their_names(served: SimpleNamespace) -> None:
    """A second adapter loaded under a name of its own: requests asking for that name get it,
    with its version, while the run's own policy keeps being served as the model's name."""
    layout, tokenizer = RunDir(served.run_dir), served.tokenizer
    lora_weights.publish(20, served.first, tokenizer, None, layout)
    lora_weights.publish(30, served.second, tokenizer, None, layout)
    assert load(served, 20).json()["policy_version"] == 20
    assert load(served, 30, adapter="other").json()["policy_version"] == 30
    names = [m["id"] for m in served.client.get("/v1/models").json()["data"]]
    assert names == ["tiny", "other"]
    first, second = greedy_ids(served.first, tokenizer), greedy_ids(served.second, tokenizer)
    assert served_greedy(served) == (20, first)
    assert served_greedy(served, "other") == (30, second)
    unknown = {"model": "nobody", "prompt": "ab", "max_tokens": 2}
    response = served.client.post("/v1/completions", json=unknown)
    assert response.status_code == 400 and "'tiny', 'other'" in response.json()["detail"]
    refused = load(served, 30, adapter="../x")
    assert refused.status_code == 400 and "adapter" in refused.text


def test_one_batch_mixes_adapters_row_by_row(tmp_path: Path, cache: Path) -> None:  # noqa: F811
    """Jobs for two adapters and the base queued together are decoded as one batch, each row
    with its own adapter, rows with the same prompt too: each job gets what its model decodes."""
    cfg = compose_run(*SERVED)
    tokenizer = load_tokenizer(ensure_checkpoint(cfg.model))
    models = {"tiny": adapted(cfg, seed=1), "other": adapted(cfg, seed=2)}
    layout = RunDir(write_run_dir(tmp_path / "run", cfg, TOKEN))
    layout.weights.mkdir(parents=True)
    lora_weights.publish(0, models["tiny"], tokenizer, None, layout)
    served = load_model(ensure_checkpoint(cfg.model)).eval()
    engine = Engine(served, tokenizer, cfg, logging.getLogger("test.lora"))
    prompts = [encode_prompt(tokenizer, p) for p in PROMPTS]
    for version, name in ((1, "tiny"), (2, "other")):
        lora_weights.publish(version, models[name], tokenizer, None, layout)
        engine.submit(LoadJob(layout.weights_for(version), version, adapter=name))
    jobs = [CompletionJob(prompts, 1, 12, 0.0, None, adapter=n) for n in ("other", "tiny", "")]
    futures = [engine.submit(job) for job in jobs]
    batches: list[int] = []
    real = adapters.Adapters.route
    adapters.Adapters.route = lambda self, names: (batches.append(len(names)), real(self, names))[1]
    try:
        engine.start()
        results = [f.result(timeout=60) for f in futures]
    finally:
        engine.stop()
        adapters.Adapters.route = real
    assert batches == [6, 9]  # one batch: 6 distinct (adapter, prompt) passes, then 9 rows
    want = {name: greedy_ids(model, tokenizer) for name, model in models.items()}
    assert [s.token_ids for s in results[0][1]] == want["other"]
    assert (
        [s.token_ids for s in results[1][1]] == want["tiny"] == [s.token_ids for s in results[2][1]]
    )
    assert [version for version, _ in results] == [2, 1, 1]
