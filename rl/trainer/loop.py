"""The trainer: pulls step N's batch from the rollout queue, computes the loss with importance
correction against the inference logprobs, steps AdamW, publishes policy version N+1 (to
`weights/step_{N+1}/`, or by broadcast straight to the inference workers) and checkpoints.
Runs under torchrun; torch.distributed is initialised even for one process, so the same code
path serves a larger world.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist

from rl.core import wire
from rl.core.chat import ChatTemplate
from rl.core.derive import (
    CHECKPOINT_COPIES,
    ParallelDims,
    learning_rate,
    lr_factor,
    max_model_len,
    precision,
    trainer_dims,
)
from rl.core.disk import DiskFull, check_room, free_bytes, writing
from rl.core.kinds import is_train
from rl.core.lora import enabled as lora_enabled
from rl.core.lora import targets as lora_targets
from rl.core.model import empty_model, ensure_checkpoint, load_tokenizer
from rl.core.records import BatchShard, RunLimits, Sample, ScoreBounds, TrainRecord, WarmupRecord
from rl.core.rundir import RunDir, drop_records, is_complete, mark_complete, write_atomic
from rl.core.runtime import (
    CHECKPOINT_ON_TERM_ENV,
    Peer,
    load_run_config,
    run_auth,
    setup_logging,
)
from rl.envs import make_environment
from rl.inference.engines import engine_of
from rl.trainer.batches import IDLE, micro_batch, mini_batch, sft_batch, token_logprobs
from rl.trainer.checkpoint import (
    load_checkpoint,
    load_model_state,
    save_checkpoint,
    save_model_state,
)
from rl.trainer.loading import load_shards, materialize
from rl.trainer.lora import adapter_start, numel, train_only, wrap
from rl.trainer.losses import LOSSES, loss_stats, reduce
from rl.trainer.metrics import (
    SUMMED_STATS,
    BatchSummary,
    env_metrics,
    memory_metrics,
    step_metrics,
)
from rl.trainer.packing import packed_logprobs
from rl.trainer.parallel import (
    clip_grad_norm,
    compute_context,
    local_parameter_bytes,
    local_tensor,
    parallelize,
    rank_device,
    torch_dtype,
)
from rl.trainer.streaming import GatheredBlocks
from rl.weights import lora as lora_versions
from rl.weights.factory import make_publisher


class StopWaiting(BaseException):
    """Raised by the SIGTERM handler into the trainer's wait for a batch: no step is under way,
    and a long poll (wire.LONG_POLL_S) could outlast Slurm's KillWait."""


class Trainer:
    """One trainer rank of a run (module docstring); every rank runs the same steps."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = RunDir(run_dir)
        self.cfg = cfg = load_run_config(run_dir)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.log = setup_logging(f"trainer-{self.rank}")
        self.terminated = False
        self.waiting = False  # for a batch: a SIGTERM then ends the wait (`_terminated`)
        if os.environ.get(CHECKPOINT_ON_TERM_ENV):
            signal.signal(signal.SIGTERM, self._terminated)
        self.base = self.built_base()
        self.device = rank_device(cfg)
        self.dims = self.mesh_dims()
        self.precision = precision(cfg)
        self.tokenizer = load_tokenizer(self.base)
        self.model = self.build_model()
        self.layout = parallelize(
            self.model, self.dims, cfg.trainer, self.device, precision=self.precision
        )
        self.load_weights()
        self.log.info(
            "mesh %s on %s: %.1f MB of parameters on this rank",
            self.dims, self.device, local_parameter_bytes(self.model) / 1e6,
        )  # fmt: skip
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=learning_rate(cfg),
            betas=tuple(cfg.algorithm.betas),
            eps=cfg.algorithm.adam_eps,
            weight_decay=cfg.algorithm.weight_decay,
        )
        self.loss_fn = LOSSES[str(cfg.algorithm.loss)]
        self.reference: Any = None
        layout = engine_of(cfg).checkpoint_layout
        self.weights = make_publisher(cfg, run_dir, self.log, layout)

    def built_base(self) -> Path:
        """The base checkpoint, built (or converted) once by rank 0 before the others look."""
        torch.manual_seed(self.cfg.seed)
        if self.rank == 0:
            ensure_checkpoint(self.cfg.model)
        dist.barrier()
        return ensure_checkpoint(self.cfg.model)

    def mesh_dims(self) -> ParallelDims:
        """`parallel.trainer`'s degrees, which must make a mesh of the ranks torchrun started."""
        dims = trainer_dims(self.cfg.parallel.trainer, self.world)
        if dims.world != self.world:
            raise ValueError(
                f"parallel.trainer: the degrees make a mesh of {dims.world} ranks, but "
                f"the trainer was started with {self.world}"
            )
        return dims

    def build_model(self) -> Any:
        """The model before parallelism, on the meta device (shapes, no memory: every rank
        reads its own shards once it is parallelized), in the master dtype; with LoRA, wrapped
        with its adapter (a resumed run's base is its version 0, the model after warm-up)."""
        cfg = self.cfg
        self.weights_source = self.lora_base() if lora_enabled(cfg.model) else self.base
        # In evaluation mode, as transformers loads a model (activation checkpointing,
        # applied later, switches to training mode).
        model = empty_model(self.weights_source, dtype=self.precision.master).eval()
        model.config.dtype = self.precision.published  # what its versions' config.json say
        # Bytes of a weight update (for LoRA, the adapter's) and of the full weights, as
        # published; the elements the optimizer updates (a checkpoint's size).
        published = torch_dtype(self.precision.published).itemsize
        self.trained_numel = numel(model.parameters())
        self.update_bytes = self.full_bytes = self.trained_numel * published
        if not lora_enabled(cfg.model):
            return model
        model = wrap(model, cfg.model, cfg.seed)  # before sharding: FSDP shards it too
        self.trained_numel = numel(p for p in model.parameters() if p.requires_grad)
        self.update_bytes = self.trained_numel * published
        self.log.info(
            "LoRA rank %d on %s: a weight update moves %.3f MB, the full weights %.3f MB "
            "(%.1fx fewer)",
            cfg.model.lora.rank, ",".join(lora_targets(cfg.model)), self.update_bytes / 1e6,
            self.full_bytes / 1e6, self.full_bytes / self.update_bytes,
        )  # fmt: skip
        return model

    def load_weights(self) -> None:
        """Each rank reads its own shards of the weights (one process: all of them), and a
        LoRA adapter starts from the run's seed (rl/trainer/loading.py)."""
        t0 = time.monotonic()
        load_shards(
            self.model,
            self.weights_source,
            self.device,
            partial(adapter_start, seed=self.cfg.seed),
            offload=self.cfg.trainer.cpu_offload and self.dims.sharded,
        )
        self.log.info("weights read from %s in %.1f s", self.weights_source, time.monotonic() - t0)

    def lora_base(self) -> Path:
        """The weights a LoRA run's adapter sits on: its published version 0 when it resumes
        from a checkpoint (the warm-up trained them), else the model's."""
        step_0 = self.run_dir.weights_for(0)
        if self.run_dir.latest_checkpoint() is not None and 0 in self.run_dir.published_versions():
            return step_0
        return self.base

    def warmup(self) -> None:
        """Supervised warm-up: cross-entropy on the answers of training examples. Every weight
        trains, with LoRA too: the warm-up makes the base the adapter is then trained on."""
        cfg = self.cfg.warmup
        if cfg.steps <= 0:
            return
        examples = make_environment(self.cfg.environment).train_examples()
        chat = ChatTemplate(self.tokenizer)
        adapted = lora_enabled(self.cfg.model)
        if adapted:  # the base trains, the adapter (B = 0, so it adds nothing) waits
            train_only(self.model, adapter=False)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=cfg.lr, eps=self.cfg.algorithm.adam_eps)
        # The warm-up makes the base every seed of the RL run starts from: its own seed.
        torch.manual_seed(cfg.seed)
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        t0 = time.monotonic()
        for step in range(cfg.steps):
            picks = torch.randint(len(examples), (cfg.batch_size,), generator=gen).tolist()
            mine = picks[self.layout.dp_rank :: self.layout.dp_world]
            batch = sft_batch(self.tokenizer, [examples[i] for i in mine], chat, cfg.chat_share)
            ids, attention, completion = (t.to(self.device) for t in batch)
            with compute_context(self.precision, self.dims, self.device):
                logp, _ = token_logprobs(self.model, ids, attention)
            total = completion.sum().float()
            if self.world > 1:  # normalised by the whole batch's tokens, gradients summed
                dist.all_reduce(total)  # (CP ranks count theirs cp times: they add cp grads)
            loss = -(logp * completion).sum() / total
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 10 == 9 or step == cfg.steps - 1:
                self.log.info("warmup step %d/%d loss %.4f", step + 1, cfg.steps, loss.item())
                if self.rank == 0:  # the launcher shows warm-up progress from these
                    done = WarmupRecord(step + 1, cfg.steps, loss.item(), time.monotonic() - t0)
                    self.run_dir.append_metrics(done.to_json())
        if adapted:
            train_only(self.model, adapter=True)
        self.log.info("warmup done in %.1f s", time.monotonic() - t0)

    def fetch(self, http: httpx.Client, queue: Peer, step: int) -> BatchShard | None:
        """This rank's shard of step `step`: long-polls until the queue has assembled it, for
        at most `timeouts.batch_s`, then fails saying what it waited for; None when a stop is
        asked for meanwhile (no step is under way: the trainer checkpoints where it is). Each
        sample is checked against the run (the queue checked it when it was pushed): a
        RecordError naming it."""
        deadline = time.monotonic() + self.cfg.timeouts.batch_s
        params = {
            "step": step,
            "rank": self.layout.dp_rank,
            "world": self.layout.dp_world,
            "wait": wire.LONG_POLL_S,
            "micro_tokens": self.cfg.trainer.micro_batch_tokens,
        }
        if self.rank == 0:
            self.run_dir.trainer_waiting.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.run_dir.trainer_waiting, str(step))
        try:
            return self.wait_for(http, queue, step, params, deadline)
        finally:
            if self.rank == 0:
                self.run_dir.trainer_waiting.unlink(missing_ok=True)

    def wait_for(
        self, http: httpx.Client, queue: Peer, step: int, params: dict, deadline: float
    ) -> BatchShard | None:
        """`fetch`'s long polls for batch `step`, until it comes, a stop or the deadline."""
        while True:
            try:
                self.waiting = True
                response = queue.request(
                    http, "GET", "/batch", params=params, headers={"Accept": wire.CONTENT_TYPE}
                )
            except StopWaiting:
                self.log.info("SIGTERM while waiting for batch %d: stopping here", step)
                return None
            finally:
                self.waiting = False
            if response.status_code == 200:
                groups, meta = wire.decode(response.content)
                shard = BatchShard.from_wire(meta, groups[0]["samples"])
                limits = self.run_limits()
                for i, sample in enumerate(shard.samples):
                    limits.check(sample, f"batch {step}, rank {self.rank}'s sample {i}")
                return shard
            if response.status_code != 204:
                response.raise_for_status()
            if self.terminated or self.run_dir.checkpoint_request.exists():
                self.log.info("asked to stop while waiting for batch %d", step)
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"trainer rank {self.rank}: batch {step} not assembled by the queue within "
                    f"{self.cfg.timeouts.batch_s:g} s (timeouts.batch_s); is the orchestrator "
                    "generating?"
                )

    def run_limits(self) -> RunLimits:
        """What each sample of a batch must fit, score bounds included once the orchestrator
        declared them (the queue refuses pushes until it has)."""
        raw = self.run_dir.read_scores()
        scores = None if raw is None else ScoreBounds.parse(raw)
        return RunLimits(self.cfg.model.vocab_size, max_model_len(self.cfg), scores)

    def batch_totals(self, samples: list[Sample]) -> dict[str, float]:
        """Whole-batch denominators (over every rank) for the loss normalisation."""
        trained = sum(s.trained_tokens for s in samples)
        counts = torch.tensor([float(trained), float(len(samples))])
        if self.world > 1:
            dist.all_reduce(counts)
            counts /= self.dims.cp  # each CP group's ranks hold the same samples
        tokens, sequences = counts.tolist()
        return {
            "tokens": max(tokens, 1.0),
            "sequences": max(sequences, 1.0),
            "max_tokens": float(self.cfg.environment.max_tokens),
        }

    def logprobs(self, model: Any, mb: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token log-probabilities and entropies of a micro-batch, packed or padded, computed
        in the compute dtype (the results in float32)."""
        with compute_context(self.precision, self.dims, self.device):
            return self._logprobs(model, mb)

    def _logprobs(self, model: Any, mb: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layout.cp is not None and model is self.model:
            return packed_logprobs(model, mb["sequences"], self.layout.cp, self.cfg.trainer.packing)
        if self.cfg.trainer.packing:
            shared = mb["prompt_lens"] if self.cfg.trainer.share_prompts else None
            return packed_logprobs(model, mb["sequences"], prompt_lens=shared)
        return token_logprobs(model, mb["ids"], mb["attention"])

    def passes(self, mine: int) -> int:
        """Forward/backward passes of this step: the most any rank needs (FSDP runs
        collectives in every pass, so ranks with fewer micro-batches add idle ones)."""
        if not self.dims.sharded:
            return mine
        most = torch.tensor([mine])
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most.item())

    def train_step(
        self, samples: list[Sample], micro_batches: list[list[int]], step: int
    ) -> dict[str, float]:
        """Step `step`'s `algorithm.updates_per_batch` optimiser steps over this rank's samples
        (the queue's packed micro-batches dealt out over as many mini-batches), at the
        scheduled learning rate; the numbers are their means."""
        updates = self.cfg.algorithm.updates_per_batch
        lr = learning_rate(self.cfg) * lr_factor(step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        parts = [mini_batch(micro_batches, j, updates) for j in range(updates)]
        each = [self.update(samples, part) for part in parts]
        mean = {key: sum(e[key] for e in each) / updates for key in each[0]}
        return {
            **mean,
            "ratio_max": max(e["ratio_max"] for e in each),
            "ratio_min": min(e["ratio_min"] for e in each),
        }

    def update(self, samples: list[Sample], micro_batches: list[list[int]]) -> dict[str, float]:
        """One optimiser step over the samples of `micro_batches` (indices into `samples`)."""
        algo = self.cfg.algorithm
        totals = self.batch_totals([samples[i] for mb in micro_batches for i in mb])
        self.optimizer.zero_grad()
        sums = dict.fromkeys(SUMMED_STATS, 0.0)
        ratio_max, ratio_min = 0.0, float("inf")
        for k in range(self.passes(len(micro_batches))):
            idle = k >= len(micro_batches)
            part = IDLE if idle else [samples[i] for i in micro_batches[k]]
            mb = micro_batch(part, self.tokenizer.pad_token_id, self.device)
            logp, entropy = self.logprobs(self.model, mb)
            if idle:  # FSDP's collectives need the same passes on every rank: add zero
                (logp.sum() * 0.0).backward()
                continue
            out = self.loss_fn(
                logp,
                mb["inference_logprobs"],
                mb["advantages"],
                algo,
                mask=mb["mask"],
                ref_logprobs=self.reference_logprobs(mb),
            )
            loss = reduce(out.per_token, mb["mask"], str(algo.normalization), totals)
            loss.backward()
            sums["loss"] += loss.item()
            sums["entropy"] += float((entropy * mb["mask"]).sum()) / totals["tokens"]
            stats = loss_stats(out, logp, mb["inference_logprobs"], mb["mask"])
            for key in ("masked_fraction", "clipped_fraction", "mismatch_kl", "ratio_mean"):
                sums[key] += float(stats[key]) / totals["tokens"]
            ratio_max = max(ratio_max, float(stats["ratio_max"]))
            ratio_min = min(ratio_min, float(stats["ratio_min"]))
        grad_norm = clip_grad_norm(self.model, algo.max_grad_norm, self.dims)
        self.optimizer.step()
        return {**self.whole_batch_stats(sums, ratio_max, ratio_min), "grad_norm": float(grad_norm)}

    def optimizer_steps(self) -> int:
        """AdamW's own count of the steps it took (a parameter's), over the run so far."""
        for state in self.optimizer.state.values():
            return int(state["step"])
        return 0

    def whole_batch_stats(
        self, sums: dict[str, float], ratio_max: float, ratio_min: float
    ) -> dict[str, float]:
        """This rank's sums (each term already divided by whole-batch totals) added over the
        ranks, and the ratio's extremes over them: the step's numbers, the same on every
        rank. The ranks of a CP group computed the same sums, so they count once."""
        if self.world == 1:
            return {**sums, "ratio_max": ratio_max, "ratio_min": ratio_min}
        added = torch.tensor([sums[key] for key in SUMMED_STATS], dtype=torch.float64)
        dist.all_reduce(added)
        added /= self.dims.cp
        extremes = torch.tensor([ratio_max, -ratio_min], dtype=torch.float64)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        whole = dict(zip(SUMMED_STATS, added.tolist(), strict=True))
        return {**whole, "ratio_max": extremes[0].item(), "ratio_min": -extremes[1].item()}

    def publish(self, version: int) -> None:
        """Policy `version` for inference, through the configured weight transport
        (rl/weights/), in the model's dtype; rank 0 publishes. The weights are walked block by
        block as rank 0 writes or sends them (rl/trainer/streaming.py: under FSDP every rank
        takes part in each block's gather, when rank 0 says there is anything to publish)."""
        if not self.on_rank_0(self.weights.wanted(version)):
            return
        blocks = self.version_blocks(version)
        if blocks is None:  # one process, its master copy in the published dtype
            if self.rank == 0:
                self.weights.publish(version, self.model, self.tokenizer, None)
            return
        if self.rank != 0:
            blocks.follow()
            return
        try:
            self.weights.publish(version, self.model, self.tokenizer, blocks)
        finally:
            blocks.done()

    def version_blocks(self, version: int) -> GatheredBlocks | None:
        """The tensors version `version` holds, block by block, cast to the published dtype
        (a LoRA run's: the base for version 0, the adapter after); None where one process
        publishes its module as it is (its master dtype is the published one)."""
        if not self.dims.sharded and self.precision.master == self.precision.published:
            return None
        dtype = torch_dtype(self.precision.published)
        select = lora_versions.select(version) if lora_enabled(self.cfg.model) else None
        return GatheredBlocks(self.model, self.rank, dtype, select)

    def checkpoint(self, step: int, with_optimizer: bool = True) -> None:
        """Model, optimiser and step as a DCP checkpoint in `checkpoints/step_N/` (every rank
        writes its shards; the COMPLETE marker comes last). Without room for it on the disk
        (rank 0 decides for all) it is not started: rl/core/disk.py's DiskFull says so."""
        target = self.run_dir.checkpoint_for(step)
        if self.on_rank_0(is_complete(target)):
            return
        # The world's shards together: weights and AdamW's moments, in the master dtype.
        need = CHECKPOINT_COPIES * self.trained_numel * torch_dtype(self.precision.master).itemsize
        if not self.on_rank_0(check_room(target, need) is None):  # every rank stops alike
            raise DiskFull(target, errno.ENOSPC, free_bytes(target), need)
        with writing(target, partial=target):  # a full disk: none of it is of use
            save_checkpoint(
                self.model,
                self.optimizer,
                step,
                target,
                lora_enabled(self.cfg.model),
                with_optimizer=with_optimizer,
            )
        dist.barrier()
        if self.rank == 0:
            mark_complete(target)
            trainer = self.cfg.trainer
            gone = self.run_dir.prune_checkpoints(
                trainer.keep_checkpoints, list(trainer.keep_checkpoint_steps)
            )
            if gone:
                self.log.info("checkpoints of steps %s deleted (trainer.keep_checkpoints)", gone)

    def reference_logprobs(self, mb: dict[str, Any]) -> torch.Tensor | None:
        """The KL reference's token logprobs of a micro-batch, where the loss has a KL term:
        with LoRA the model with its adapter switched off, else the frozen copy."""
        if self.cfg.algorithm.kl_coef <= 0:
            return None
        with torch.no_grad():
            if lora_enabled(self.cfg.model):
                with self.model.disable_adapter():
                    return self.logprobs(self.model, mb)[0]
            return self.logprobs(self.reference, mb)[0]

    def make_reference(self) -> Any:
        """The KL reference: a frozen copy of the policy as it is now, built and sharded as the
        policy is (the same mesh), each rank copying its own shards: nothing is gathered, and
        no rank holds the whole model. Frozen, it is kept in the compute dtype."""
        reference = empty_model(self.base, dtype=self.precision.compute)
        offload = self.cfg.trainer.cpu_offload and self.dims.sharded
        parallelize(
            reference, self.dims, self.cfg.trainer, self.device, self.layout.mesh, self.precision
        )
        materialize(reference, self.device, offload)
        with torch.no_grad():
            pairs = [
                *zip(reference.parameters(), self.model.parameters(), strict=True),
                *zip(reference.buffers(), self.model.buffers(), strict=True),
            ]
            for mine, policy in pairs:
                local_tensor(mine).copy_(local_tensor(policy))
        return reference.eval().requires_grad_(False)

    def resume(self) -> int:
        """Load the newest checkpoint, if there is one; returns the step to continue from.

        The queue serves step N's batch again when asked twice, so steps after the checkpoint
        that a hard kill cut off are recomputed from the same samples.
        """
        path = self.run_dir.latest_checkpoint()
        if path is None:
            return 0
        step = load_checkpoint(self.model, self.optimizer, path, lora_enabled(self.cfg.model))
        reference = self.run_dir.reference
        if self.cfg.algorithm.kl_coef > 0 and not lora_enabled(self.cfg.model):
            if not is_complete(reference):
                raise RuntimeError(
                    f"{reference}: no KL reference saved whole (algorithm.kl_coef="
                    f"{self.cfg.algorithm.kl_coef}), so this run cannot resume with its KL term"
                )
            self.reference = self.make_reference()
            load_model_state(self.reference, reference)
        if self.rank == 0:
            # Steps after the checkpoint are trained again from the same batches: their first
            # records go, so every step is recorded once.
            dropped = drop_records(self.run_dir.metrics, lambda r: is_train(r) and r["step"] > step)
            if dropped:
                self.log.info("dropped the records of %d steps after the checkpoint", dropped)
        self.log.info("resumed from %s: continuing at step %d", path, step + 1)
        return step

    def start(self) -> int:
        """Warm up and publish version 0, or resume; returns the first RL step to run."""
        step = self.resume()
        if step:
            return step
        self.warmup()
        torch.manual_seed(self.cfg.seed)  # the RL run's from here, warmed up here or not
        if self.cfg.algorithm.kl_coef > 0 and not lora_enabled(self.cfg.model):
            # The KL reference is the policy RL starts from: the weights after warm-up (with
            # LoRA: the same model with its adapter off, no copy).
            self.reference = self.make_reference()
            self.save_reference()
        self.publish(0)
        return 0

    def save_reference(self) -> None:
        """The KL reference's weights, for a resume: each rank writes its shards (DCP), rank 0
        the COMPLETE marker last."""
        path = self.run_dir.reference
        with writing(path, partial=path):
            save_model_state(self.reference, path)
        dist.barrier()
        if self.rank == 0:
            mark_complete(path)

    def on_rank_0(self, flag: bool) -> bool:
        """Rank 0's value of `flag` on every rank, so that all ranks take the same branch into
        a collective."""
        if self.world == 1:
            return flag
        value = torch.tensor([float(flag)])
        dist.broadcast(value, src=0)
        return bool(value.item())

    def _terminated(self, signum: int, frame: object) -> None:
        """SIGTERM from Slurm (directly, and again from torchrun): finish the step under way,
        then checkpoint and stop, before Slurm's KillWait ends in SIGKILL; a wait for a batch
        ends at once."""
        if not self.terminated:
            self.log.warning("SIGTERM: checkpointing after the step under way, then stopping")
        self.terminated = True
        if self.waiting:  # for a batch, which may never come: the orchestrator is stopping too
            self.waiting = False
            raise StopWaiting

    def stop_requested(self) -> bool:
        """Whether the job supervisor asked for a checkpoint and stop (Slurm preemption or
        time limit), or Slurm sent SIGTERM under a supervisor that wants a checkpoint first;
        every rank gets rank 0's answer, so all stop at the same step."""
        asked = self.terminated or self.run_dir.checkpoint_request.exists()
        flag = torch.tensor([float(asked)])
        if self.world > 1:
            dist.broadcast(flag, src=0)
        return bool(flag.item())

    def stop(self, step: int) -> None:
        """Checkpoint after `step` steps, as asked, and say so (`checkpointed`: the supervisor,
        a cancel or Ctrl-C wait for it); before the first step there is nothing to keep."""
        if step:
            self.checkpoint(step, self.cfg.trainer.stop_checkpoint_optimizer)
        if self.rank == 0:
            self.run_dir.checkpointed.write_text(str(step))
        self.log.info("checkpointed at step %d and stopped, as asked", step)

    def every_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (a collective where there are several)."""
        if self.world == 1:
            return flag
        value = torch.tensor([float(flag)])  # gloo's, beside NCCL on GPUs
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return bool(value.item())

    def run(self) -> None:
        cfg = self.cfg
        first = self.start()
        if cfg.max_steps == 0:  # the warm-up alone: a shared-inference sweep's base
            self.log.info("done: warm-up only, version 0 published")
            return
        http = httpx.Client(auth=run_auth(self.run_dir.root), timeout=cfg.timeouts.request_s)
        queue = Peer(self.run_dir.root, "queue", cfg.timeouts.peer_s)
        for step in range(first, cfg.max_steps):
            if self.stop_requested():
                self.stop(step)
                return
            t0 = time.monotonic()
            batch = self.fetch(http, queue, step)
            if not self.every_rank(batch is not None):  # asked to stop while waiting for it
                self.stop(step)
                return
            assert batch is not None
            t_fetch = time.monotonic() - t0
            train_start = time.time()
            stats = self.train_step(batch.samples, batch.micro_batches, step)
            t_train = time.monotonic() - t0 - t_fetch
            train_end = time.time()  # before the publish, which lets the next batch start
            self.publish(step + 1)
            elapsed = time.monotonic() - t0
            times = {
                "at/train_start": train_start,  # wall clock, to line up with generation's
                "at/train_end": train_end,
                "at/published": time.time(),
                "time/step": elapsed,
                "time/wait_batch": t_fetch,
                "time/train": t_train,
                "time/weight_sync": elapsed - t_fetch - t_train,
            }
            self.record_step(step, batch, stats, times)  # before the checkpoint covering it
            if cfg.trainer.checkpoint_every and (step + 1) % cfg.trainer.checkpoint_every == 0:
                self.checkpoint(step + 1)
        self.checkpoint(cfg.max_steps)
        self.log.info("done: %d steps", cfg.max_steps)

    def record_step(
        self, step: int, batch: BatchShard, stats: dict[str, float], times: dict[str, float]
    ) -> None:
        """Step `step + 1`'s record, written by rank 0 from the whole batch's summary (a
        collective: every rank takes part)."""
        whole = self.whole_batch(batch.samples)
        if self.rank == 0:
            self.record(step, batch, whole, stats, times)

    def whole_batch(self, samples: list[Sample]) -> BatchSummary:
        """On rank 0, the summary of every data-parallel rank's samples of the step (the ranks
        of a CP group hold the same ones: counted once), added in rank order, so that the
        step's numbers describe the whole batch and not rank 0's shard. Each rank sends its
        shard's summary only: a few hundred bytes whatever the batch (other ranks get None)."""
        mine = BatchSummary.of(samples)
        if self.world == 1:
            return mine
        shards: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object((self.layout.dp_rank, mine), shards, dst=0)
        if shards is None:
            return BatchSummary()
        parts = dict(sorted(dict(shards).items()))
        whole = BatchSummary()
        for part in parts.values():
            whole = whole.add(part)
        return whole

    def record(
        self,
        step: int,
        batch: BatchShard,
        whole: BatchSummary,
        stats: dict[str, float],
        times: dict[str, float],
    ) -> None:
        """Append step `step + 1`'s record (rl/trainer/metrics.py), with the learning rate, the
        bytes a weight update moves, and memory."""
        record = {
            **step_metrics(step, batch, whole, stats, times),
            "lr": self.optimizer.param_groups[0]["lr"],
            "optimizer/steps": self.optimizer_steps(),
            "weights/update_bytes": self.update_bytes,  # what one version moves to inference
            "weights/full_bytes": self.full_bytes,
            **memory_metrics(self.device),
            "timestamp": time.time(),
            **env_metrics(whole),
        }
        self.run_dir.append_metrics(TrainRecord(step + 1, record).to_json())
        self.log.info(
            "step %d reward %.3f loss %.4f staleness %d (wait %.2f s, step %.2f s)",
            step + 1,
            record["reward/mean"],
            record["loss"],
            record["off_policy/staleness_max"],
            times["time/wait_batch"],
            times["time/step"],
        )
