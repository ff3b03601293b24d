"""The trainer: pulls step N's batch from the rollout queue, computes the loss with importance
correction against the inference logprobs, steps AdamW, publishes policy version N+1 (to
`weights/step_{N+1}/`, or by broadcast straight to the inference workers) and checkpoints.
Runs under torchrun; torch.distributed is initialised even for one process, so the same code
path serves a larger world.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist
import torch.nn.functional as F

from rl import lora, parallel, wire
from rl.algorithms import LOSSES, loss_stats, reduce
from rl.config import RunConfig
from rl.context_parallel import ContextParallel
from rl.derive import learning_rate, trainer_dims
from rl.envs import Example, make_environment
from rl.model import empty_model, ensure_checkpoint, load_model, load_tokenizer
from rl.packing import packed_logprobs
from rl.records import BatchShard, Sample, TrainRecord, WarmupRecord, is_train
from rl.rundir import RunDir, drop_records, is_complete, mark_complete
from rl.runtime import (
    CHECKPOINT_ON_TERM_ENV,
    Peer,
    auth_headers,
    die_with_parent,
    load_run_config,
    role_args,
    run_token,
    setup_logging,
    start_heartbeat,
)
from rl.weights.factory import make_publisher


def pad_batch(
    sequences: list[list[int]], completion_starts: list[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask, and a mask over the completion tokens of each row."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    completion = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, (seq, start) in enumerate(zip(sequences, completion_starts, strict=True)):
        ids[row, : len(seq)] = torch.tensor(seq)
        attention[row, : len(seq)] = 1
        completion[row, start : len(seq)] = True
    return ids, attention, completion


def sft_batch(
    tokenizer: Any, examples: list[Example]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Supervised warm-up rows: BOS + prompt + answer + EOS, with the answer (and EOS) masked
    in as the tokens to learn."""
    sequences, starts = [], []
    for example in examples:
        prompt = [
            tokenizer.bos_token_id,
            *tokenizer.encode(example.prompt, add_special_tokens=False),
        ]
        answer = tokenizer.encode(example.answer, add_special_tokens=False)
        sequences.append(prompt + answer + [tokenizer.eos_token_id])
        starts.append(len(prompt))
    return pad_batch(sequences, starts, tokenizer.pad_token_id)


def token_logprobs(model: Any, ids: torch.Tensor, attention: torch.Tensor) -> tuple[Any, Any]:
    """Log-probability of each token given its prefix (position t scores token t), and the
    entropy of the predicting distribution; position 0 gets 0."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logp_all = F.log_softmax(logits, dim=-1)
    picked = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros_like(picked[:, :1])
    return torch.cat([zero, picked], dim=1), torch.cat([zero, entropy], dim=1)


def env_metrics(samples: list[Sample]) -> dict[str, float]:
    """Means over the batch of the per-episode metrics an environment keeps (`env/<name>`)."""
    values: dict[str, list[float]] = {}
    for sample in samples:
        for key, value in sample.env_metrics.items():
            values.setdefault(f"env/{key}", []).append(value)
    return {key: sum(v) / len(v) for key, v in values.items()}


def rank_device(cfg: RunConfig) -> torch.device:
    """This rank's device: `trainer.device`, where `auto` is the GPU torchrun's LOCAL_RANK
    names when the cluster has GPUs (`cluster.gpus_per_node`) and torch sees them, else the
    CPU."""
    choice = str(cfg.trainer.device)
    gpus = (cfg.cluster.gpus_per_node or 0) > 0 and torch.cuda.is_available()
    if choice == "cpu" or (choice == "auto" and not gpus):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda: torch sees no CUDA device on this node")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


# Per-step numbers that are sums over micro-batches (and ranks).
SUMMED_STATS = (
    "loss",
    "entropy",
    "masked_fraction",
    "clipped_fraction",
    "mismatch_kl",
    "ratio_mean",
)
# A one-token sample for a pass that contributes nothing.
IDLE = [Sample([0], [0], [0.0], reward=0.0, advantage=0.0, min_version=0, max_version=0)]


class Trainer:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = RunDir(run_dir)
        self.cfg = cfg = load_run_config(run_dir)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.log = setup_logging(f"trainer-{self.rank}")
        self.terminated = False
        if os.environ.get(CHECKPOINT_ON_TERM_ENV):
            signal.signal(signal.SIGTERM, self._terminated)
        torch.manual_seed(cfg.seed)
        if self.rank == 0:  # build the base model once, before the other ranks look for it
            ensure_checkpoint(cfg.model, seed=cfg.seed)
        dist.barrier()
        self.base = base = ensure_checkpoint(cfg.model, seed=cfg.seed)
        self.device = rank_device(cfg)
        self.dims = trainer_dims(cfg.parallel.trainer, self.world)
        if self.dims.world != self.world:
            raise ValueError(
                f"parallel.trainer: the degrees make a mesh of {self.dims.world} ranks, but "
                f"the trainer was started with {self.world}"
            )
        # Sharded, only rank 0 reads the weights; the others build the model on the meta
        # device (shapes, no memory) and receive their shards from it after sharding.
        # With LoRA, a resumed run's base is its version 0 (the model after warm-up).
        weights = self.lora_base() if lora.enabled(cfg.model) else base
        if self.dims.sharded and self.rank != 0:
            self.model = empty_model(weights, dtype=cfg.model.dtype)
        else:
            self.model = load_model(weights, dtype=cfg.model.dtype, device=self.device)
        self.tokenizer = load_tokenizer(base)
        # Bytes of a weight update (for LoRA, the adapter's) and of the full weights.
        self.update_bytes = self.full_bytes = lora.nbytes(self.model.parameters())
        if lora.enabled(cfg.model):  # before sharding: FSDP shards the adapter with the rest
            torch.manual_seed(cfg.seed)  # A's random start: the same in any layout
            self.model = lora.wrap(self.model, cfg.model)
            self.update_bytes = lora.nbytes(p for p in self.model.parameters() if p.requires_grad)
            self.log.info(
                "LoRA rank %d on %s: a weight update moves %.3f MB, the full weights %.3f MB "
                "(%.1fx fewer)",
                cfg.model.lora.rank,
                ",".join(lora.targets(cfg.model)),
                self.update_bytes / 1e6,
                self.full_bytes / 1e6,
                self.full_bytes / self.update_bytes,
            )
        # Data-parallel rank and world: which share of each batch this rank trains on (the
        # ranks of one CP group share theirs, EP ranks have their own).
        self.dp_rank, self.dp_world = 0, self.dims.dp
        self.cp: ContextParallel | None = None
        if cfg.trainer.activation_checkpointing:
            parallel.apply_activation_checkpointing(self.model)
        if self.dims.sharded:
            mesh = parallel.build_mesh(self.dims, self.device.type)
            self.dp_rank = parallel.data_parallel_rank(mesh)
            if self.dims.cp > 1:
                self.cp = ContextParallel(mesh["cp"])
                self.cp.enable(self.model)
            whole = dict(self.model.state_dict()) if self.rank == 0 else {}
            parallel.apply_fsdp(self.model, mesh, self.dims, cpu_offload=cfg.trainer.cpu_offload)
            parallel.fill_from_rank0(
                self.model, whole, self.device, cpu_offload=cfg.trainer.cpu_offload
            )
            del whole
        self.log.info(
            "mesh %s on %s: %.1f MB of parameters on this rank",
            self.dims,
            self.device,
            parallel.local_parameter_bytes(self.model) / 1e6,
        )
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=learning_rate(cfg),
            betas=tuple(cfg.algorithm.betas),
            weight_decay=cfg.algorithm.weight_decay,
        )
        self.loss_fn = LOSSES[str(cfg.algorithm.loss)]
        self.reference: Any = None
        self.weights = make_publisher(cfg, run_dir, self.log)

    def lora_base(self) -> Path:
        """The weights a LoRA run's adapter sits on: its published version 0 when it resumes
        from a checkpoint (the warm-up trained them), else the model's."""
        step_0 = self.run_dir.weights_for(0)
        if self.run_dir.latest_checkpoint() is not None and is_complete(step_0):
            return step_0
        return self.base

    def warmup(self) -> None:
        """Supervised warm-up: cross-entropy on the answers of training examples. Every weight
        trains, with LoRA too: the warm-up makes the base the adapter is then trained on."""
        cfg = self.cfg.warmup
        if cfg.steps <= 0:
            return
        examples = make_environment(self.cfg.environment).train_examples()
        adapted = lora.enabled(self.cfg.model)
        if adapted:  # the base trains, the adapter (B = 0, so it adds nothing) waits
            lora.train_only(self.model, adapter=False)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=cfg.lr)
        gen = torch.Generator().manual_seed(self.cfg.seed + 1)
        t0 = time.monotonic()
        for step in range(cfg.steps):
            picks = torch.randint(len(examples), (cfg.batch_size,), generator=gen).tolist()
            mine = picks[self.dp_rank :: self.dp_world]
            batch = sft_batch(self.tokenizer, [examples[i] for i in mine])
            ids, attention, completion = (t.to(self.device) for t in batch)
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
            lora.train_only(self.model, adapter=True)
        self.log.info("warmup done in %.1f s", time.monotonic() - t0)

    def fetch(self, http: httpx.Client, queue: Peer, step: int) -> BatchShard:
        """This rank's shard of step `step`: long-polls until the queue has assembled it, for
        at most `timeouts.batch_s`, then fails saying what it waited for."""
        deadline = time.monotonic() + self.cfg.timeouts.batch_s
        params = {
            "step": step,
            "rank": self.dp_rank,
            "world": self.dp_world,
            "wait": 10,
            "micro_tokens": self.cfg.trainer.micro_batch_tokens,
        }
        while True:
            response = queue.request(
                http, "GET", "/batch", params=params, headers={"Accept": wire.CONTENT_TYPE}
            )
            if response.status_code == 200:
                groups, meta = wire.decode(response.content)
                return BatchShard.from_wire(meta, groups[0]["samples"])
            if response.status_code != 204:
                response.raise_for_status()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"trainer rank {self.rank}: batch {step} not assembled by the queue within "
                    f"{self.cfg.timeouts.batch_s:g} s (timeouts.batch_s); is the orchestrator "
                    "generating?"
                )

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

    def micro_batch(self, part: list[Sample]) -> dict[str, Any]:
        sequences = [list(s.prompt_ids) + list(s.completion_ids) for s in part]
        ids, attention, completion = pad_batch(
            sequences, [len(s.prompt_ids) for s in part], self.tokenizer.pad_token_id
        )
        inference_logp = torch.zeros(ids.shape)
        for row, s in enumerate(part):
            start = len(s.prompt_ids)
            inference_logp[row, start : start + len(s.logprobs)] = torch.as_tensor(s.logprobs)
            for begin, end in s.env_spans:  # an environment's turns carry no loss
                completion[row, start + begin : start + end] = False
        tensors = {
            "ids": ids,
            "attention": attention,
            "mask": completion,
            "inference_logprobs": inference_logp,
            "advantages": torch.tensor([float(s.advantage) for s in part]),
        }
        return {
            **{key: t.to(self.device) for key, t in tensors.items()},
            "sequences": sequences,
            "prompt_lens": [len(s.prompt_ids) for s in part],
        }

    def logprobs(self, model: Any, mb: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token log-probabilities and entropies of a micro-batch, packed or padded."""
        if self.cp is not None and model is self.model:
            return packed_logprobs(model, mb["sequences"], self.cp, self.cfg.trainer.packing)
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

    def train_step(self, samples: list[Sample], micro_batches: list[list[int]]) -> dict[str, float]:
        """One optimiser step over this rank's samples, in the queue's packed micro-batches."""
        algo = self.cfg.algorithm
        totals = self.batch_totals(samples)
        self.optimizer.zero_grad()
        sums = dict.fromkeys(SUMMED_STATS, 0.0)
        ratio_max, ratio_min = 0.0, float("inf")
        for k in range(self.passes(len(micro_batches))):
            idle = k >= len(micro_batches)
            mb = self.micro_batch(IDLE if idle else [samples[i] for i in micro_batches[k]])
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
        grad_norm = parallel.clip_grad_norm(self.model, algo.max_grad_norm, self.dims)
        self.optimizer.step()
        return {**self.whole_batch_stats(sums, ratio_max, ratio_min), "grad_norm": float(grad_norm)}

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
        (rl/weights/). Under FSDP the shards are gathered first (every rank takes part, when
        rank 0 says there is anything to publish); rank 0 publishes."""
        if not self.on_rank_0(self.weights.wanted(version)):
            return
        # Gathered under FSDP (a collective); one process publishes its own module directly.
        state = parallel.full_state_dict(self.model) if self.dims.sharded else None
        if self.rank == 0:
            self.weights.publish(version, self.model, self.tokenizer, state)

    def checkpoint(self, step: int) -> None:
        """Model, optimiser and step as a DCP checkpoint in `checkpoints/step_N/` (every rank
        writes its shards; the COMPLETE marker comes last)."""
        target = self.run_dir.checkpoint_for(step)
        if self.on_rank_0(is_complete(target)):
            return
        parallel.save_checkpoint(
            self.model, self.optimizer, step, target, lora.enabled(self.cfg.model)
        )
        dist.barrier()
        if self.rank == 0:
            mark_complete(target)

    def reference_logprobs(self, mb: dict[str, Any]) -> torch.Tensor | None:
        """The KL reference's token logprobs of a micro-batch, where the loss has a KL term:
        with LoRA the model with its adapter switched off, else the frozen copy."""
        if self.cfg.algorithm.kl_coef <= 0:
            return None
        with torch.no_grad():
            if lora.enabled(self.cfg.model):
                with self.model.disable_adapter():
                    return self.logprobs(self.model, mb)[0]
            return self.logprobs(self.reference, mb)[0]

    def make_reference(self, state: dict[str, Any] | None = None) -> Any:
        """The KL reference: an unsharded, frozen copy of the policy (or of `state`)."""
        reference = load_model(self.base, dtype=self.cfg.model.dtype, device=self.device)
        reference.load_state_dict(
            state if state is not None else parallel.full_state_dict(self.model, every_rank=True)
        )
        return reference.eval().requires_grad_(False)

    def resume(self) -> int:
        """Load the newest checkpoint, if there is one; returns the step to continue from.

        The queue serves step N's batch again when asked twice, so steps after the checkpoint
        that a hard kill cut off are recomputed from the same samples.
        """
        path = self.run_dir.latest_checkpoint()
        if path is None:
            return 0
        step = parallel.load_checkpoint(
            self.model, self.optimizer, path, lora.enabled(self.cfg.model)
        )
        reference = self.run_dir.reference
        if (
            self.cfg.algorithm.kl_coef > 0
            and reference.exists()
            and not lora.enabled(self.cfg.model)
        ):
            self.reference = self.make_reference(torch.load(reference))
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
        if self.cfg.algorithm.kl_coef > 0 and not lora.enabled(self.cfg.model):
            # The KL reference is the policy RL starts from: the weights after warm-up (with
            # LoRA: the same model with its adapter off, no copy).
            self.reference = self.make_reference()
            if self.rank == 0:
                self.run_dir.checkpoints.mkdir(exist_ok=True)
                torch.save(self.reference.state_dict(), self.run_dir.reference)
        self.publish(0)
        return 0

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
        then checkpoint and stop, before Slurm's KillWait ends in SIGKILL."""
        if not self.terminated:
            self.log.warning("SIGTERM: checkpointing after the step under way, then stopping")
        self.terminated = True

    def stop_requested(self) -> bool:
        """Whether the job supervisor asked for a checkpoint and stop (Slurm preemption or
        time limit), or Slurm sent SIGTERM under a supervisor that wants a checkpoint first;
        every rank gets rank 0's answer, so all stop at the same step."""
        asked = self.terminated or self.run_dir.checkpoint_request.exists()
        flag = torch.tensor([float(asked)])
        if self.world > 1:
            dist.broadcast(flag, src=0)
        return bool(flag.item())

    def run(self) -> None:
        cfg = self.cfg
        first = self.start()
        if cfg.max_steps == 0:  # the warm-up alone: a shared-inference sweep's base
            self.log.info("done: warm-up only, version 0 published")
            return
        token = run_token(self.run_dir.root)
        http = httpx.Client(headers=auth_headers(token), timeout=cfg.timeouts.request_s)
        queue = Peer(self.run_dir.root, "queue", cfg.timeouts.peer_s)
        for step in range(first, cfg.max_steps):
            if self.stop_requested():
                self.checkpoint(step)
                if self.rank == 0:
                    self.run_dir.checkpointed.write_text(str(step))
                self.log.info("checkpointed at step %d and stopped, as asked", step)
                return
            t0 = time.monotonic()
            batch = self.fetch(http, queue, step)
            t_fetch = time.monotonic() - t0
            train_start = time.time()
            stats = self.train_step(batch.samples, batch.micro_batches)
            t_train = time.monotonic() - t0 - t_fetch
            self.publish(step + 1)
            elapsed = time.monotonic() - t0
            times = {
                "at/train_start": train_start,  # wall clock, to line up with generation's
                "at/train_end": time.time(),
                "time/step": elapsed,
                "time/wait_batch": t_fetch,
                "time/train": t_train,
                "time/weight_sync": elapsed - t_fetch - t_train,
            }
            whole = self.whole_batch(batch.samples)  # a collective: every rank takes part
            if self.rank == 0:  # recorded before the checkpoint that covers it
                self.record(step, batch, whole, stats, times)
            if cfg.trainer.checkpoint_every and (step + 1) % cfg.trainer.checkpoint_every == 0:
                self.checkpoint(step + 1)
        self.checkpoint(cfg.max_steps)
        self.log.info("done: %d steps", cfg.max_steps)

    def whole_batch(self, samples: list[Sample]) -> list[Sample]:
        """Every data-parallel rank's samples of the step, on every rank (the ranks of a CP
        group hold the same ones: counted once), so that the step's numbers describe the whole
        batch and not rank 0's shard."""
        if self.world == 1:
            return samples
        shards: list[Any] = [None] * self.world
        dist.all_gather_object(shards, (self.dp_rank, samples))
        return [sample for part in dict(shards).values() for sample in part]

    def record(
        self,
        step: int,
        batch: BatchShard,
        samples: list[Sample],
        stats: dict[str, float],
        times: dict[str, float],
    ) -> None:
        """Append step `step + 1`'s record: the loss numbers of this rank's `stats` (already
        whole-batch sums), the step's `times`, the rest from the whole batch's `samples`."""
        staleness = [step - s.min_version for s in samples]
        tokens = sum(s.tokens for s in samples)
        elapsed = times["time/step"]
        record = {
            "reward/mean": sum(s.reward for s in samples) / len(samples),
            "loss": stats["loss"],
            "entropy": stats["entropy"],
            "mismatch_kl": stats["mismatch_kl"],
            "masked_fraction": stats["masked_fraction"],
            "clipped_fraction": stats["clipped_fraction"],
            "ratio/mean": stats["ratio_mean"],
            "ratio/max": stats["ratio_max"],
            "ratio/min": stats["ratio_min"],
            "filter/zero_advantage_groups": sum(s.filtered_groups for s in samples),
            "grad_norm": stats["grad_norm"],
            "off_policy/staleness_max": max(staleness),
            "off_policy/staleness_mean": sum(staleness) / len(staleness),
            "off_policy/dropped": batch.dropped,
            "queue/depth": batch.depth,
            "micro_batches": len(batch.micro_batches),
            "versions": sorted({s.min_version for s in samples}),
            "samples": len(samples),
            **times,
            "throughput/tokens_per_s": tokens / elapsed,
            "throughput/samples_per_s": len(samples) / elapsed,
            "lr": self.optimizer.param_groups[0]["lr"],
            "weights/update_bytes": self.update_bytes,  # what one version moves to inference
            "weights/full_bytes": self.full_bytes,
            **memory_metrics(self.device),
            "timestamp": time.time(),
            **env_metrics(samples),
        }
        self.run_dir.append_metrics(TrainRecord(step + 1, record).to_json())
        self.log.info(
            "step %d reward %.3f loss %.4f staleness %d (wait %.2f s, step %.2f s)",
            step + 1,
            record["reward/mean"],
            record["loss"],
            record["off_policy/staleness_max"],
            times["time/wait_batch"],
            elapsed,
        )


def memory_metrics(device: torch.device) -> dict[str, float]:
    """This process's resident memory, and the most GPU memory torch has held, in GB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    found = {"memory/rss_gb": pages * os.sysconf("SC_PAGE_SIZE") / 1e9}
    if device.type == "cuda":
        found["memory/gpu_max_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return found


def main() -> None:
    args = role_args("trainer")
    # torchrun starts each rank in a session of its own: a rank must not outlive torchrun
    # (killed outright, it could not stop them, and a restarted one would start more).
    parent = os.getppid()
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit("trainer: torchrun exited before this rank started")
    cfg = load_run_config(args.run_dir)
    start_heartbeat(args.run_dir, cfg.timeouts.hung_s)
    backend = "gloo"
    if rank_device(cfg).type == "cuda":
        backend = "cpu:gloo,cuda:nccl"  # NCCL for GPU tensors, gloo for small CPU ones
    # Rendezvous and every collective fail after this long (a rank that hangs or dies).
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeouts.collective_s))
    try:
        Trainer(args.run_dir).run()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
