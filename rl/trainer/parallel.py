"""Trainer parallelism as plain functions over a DeviceMesh, applied by `parallelize` in one
fixed order (torchtitan's): context parallelism, activation checkpointing, expert parallelism,
then FSDP2.

`ParallelDims` (rl/core/derive.py, torch-free: the planner resolves the same degrees) is the
validated description, checked without building a mesh; `build_mesh` turns it into a DeviceMesh
with named dimensions; `apply_fsdp` shards a Hugging Face causal LM with FSDP2 (`fully_shard`)
per decoder block and at the root, over `dp_shard` (FSDP) or `dp_replicate x dp_shard` (HSDP:
sharded inside a group, replicated across groups), with a mixed-precision policy and optional
CPU offload.

Mixed precision as the field keeps it (`rl.core.derive.Precision`): parameters, their gradients
and AdamW's moments in the master dtype (float32), forward and backward in the compute dtype
(the model's, bfloat16 for every real model), gradients reduced across ranks in float32. FSDP2
gathers each block's weights in the compute dtype; one process computes under autocast.

Every rank builds the model on the meta device; once it is parallelized, each rank reads its
own shards from the checkpoint (rl/trainer/loading.py).

Gradients are those of the whole batch's loss: each rank's loss is already normalised by the
whole batch's token count, so gradients are summed across ranks, not averaged.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from rl.core.config import RunConfig, TrainerConfig
from rl.core.derive import ParallelDims, Precision
from rl.trainer import head
from rl.trainer.context_parallel import ContextParallel
from rl.trainer.expert_parallel import ExpertParallel, apply_expert_parallel

MESH_DIMS = ("dp_replicate", "efsdp", "cp", "ep")


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh:
    """The world as (dp_replicate, efsdp, cp, ep), where efsdp x ep = dp_shard, with two
    flattened views: `dp_shard_cp` (efsdp, cp, ep) for the dense weights and `efsdp_cp`
    (efsdp, cp) for the experts. EP is innermost, so each flattened view is contiguous."""
    shape = (dims.dp_replicate, dims.dp_shard // dims.ep, dims.cp, dims.ep)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    mesh["efsdp", "cp", "ep"]._flatten("dp_shard_cp")
    mesh["efsdp", "cp"]._flatten("efsdp_cp")
    return mesh


def _submesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """`mesh[names]`, where names may be flattened views. torch 2.13 warns that slicing those
    from the root will be deprecated; HSDP with EP needs (dp_replicate, efsdp_cp) on the root
    mesh that also holds `ep`, which only that slicing gives today."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[names]


def data_parallel_rank(mesh: DeviceMesh) -> int:
    """Which share of the batch this rank trains on: its place among (dp_replicate, efsdp,
    ep); the ranks of one CP group share a share."""
    rank = 0
    for name in ("dp_replicate", "efsdp", "ep"):
        rank = rank * mesh[name].size() + mesh[name].get_local_rank()
    return rank


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The transformer blocks of an HF causal LM (`model.model.layers`; under a PEFT model's
    wrapping for LoRA)."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return list(model.model.layers)


def apply_activation_checkpointing(model: Any, offload: bool = False) -> None:
    """Recompute each decoder block's activations in the backward pass instead of keeping them
    (the blocks' own checkpointing, which passes their keyword arguments through); with
    `offload`, each block's input, all that is kept of it, waits for the backward pass in host
    memory (`offloaded_checkpoint`)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if offload:
        for layer in decoder_layers(model):
            layer._gradient_checkpointing_func = offloaded_checkpoint
    model.train()  # the blocks checkpoint only in training mode


def offloaded_checkpoint(function: Any, *args: Any) -> Any:
    """A block's forward under activation checkpointing with its input (the hidden states, its
    first argument) kept on the host: copied there as the block starts, copied back to the
    block's device in the forward and again when the backward pass recomputes the block. The
    device copy is freed once the block has run: a long sample's block inputs then take host
    memory, not the GPU's. (On a CPU trainer the copy is the tensor itself.)"""
    if not args or not isinstance(args[0], torch.Tensor):
        return checkpoint(function, *args, use_reentrant=False)
    hidden, *rest = args
    device = hidden.device
    stored = hidden.to("cpu")

    def run(on_host: torch.Tensor, *others: Any) -> Any:
        return function(on_host.to(device), *others)

    return checkpoint(run, stored, *rest, use_reentrant=False)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a config names (`float32`, `bfloat16`, `float16`)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def mixed_precision(precision: Precision | None) -> MixedPrecisionPolicy:
    """FSDP2's policy over master-dtype parameters: each block's weights gathered in the
    compute dtype (left as they are where it is the master's), gradients reduced in the reduce
    dtype and kept, sharded, in the master's."""
    if precision is None:
        return MixedPrecisionPolicy(reduce_dtype=torch.float32)
    compute = torch_dtype(precision.compute) if precision.mixed else None
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch_dtype(precision.reduce))


def apply_fsdp(
    model: Any,
    mesh: DeviceMesh,
    dims: ParallelDims,
    experts: list[ExpertParallel] = (),  # type: ignore[assignment]
    precision: Precision | None = None,
    cpu_offload: bool = False,
) -> Any:
    """Shard each expert-parallel module over the ranks that share its experts, then every
    decoder block, then the root (embeddings, final norm, LM head)."""
    if cpu_offload and not torch.cuda.is_available():
        raise ValueError("trainer.cpu_offload=true moves GPU state to the host; there is no GPU")
    kwargs: dict[str, Any] = {"mp_policy": mixed_precision(precision)}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for module in experts:  # experts first: already split over ep
        fully_shard(module, mesh=_submesh(mesh, dims.expert_fsdp_dims), **kwargs)
    kwargs["mesh"] = _submesh(mesh, dims.fsdp_dims)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    # Each rank's loss is normalised by the whole batch: sum gradients, do not average them
    # (a plain SUM reduction: gloo has no pre-multiplied sum).
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def clip_grad_norm(model: torch.nn.Module, max_norm: float, dims: ParallelDims) -> float:
    """Scale gradients so that their global norm is at most `max_norm`; returns the norm
    before clipping. Within one replica the ranks' gradient shards (FSDP's, and EP's expert
    slices) tile every parameter exactly once, so the squares are summed over all ranks and
    divided by the number of replicas; DTensors over different meshes never meet."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    device = local[0].device if local else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for g in local:
        squares += g.detach().float().pow(2).sum()
    if dims.sharded:
        dist.all_reduce(squares)
        squares /= dims.dp_replicate
    norm = squares.sqrt()
    scale = float((max_norm / (norm + 1e-6)).clamp(max=1.0))
    if scale < 1.0:
        for g in local:
            g.mul_(scale)
    return float(norm)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds (its shards only)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


@dataclass(frozen=True)
class Layout:
    """Where a rank stands once the model is parallelized: which share of each batch it trains
    on (the ranks of one CP group share theirs, EP ranks have their own), and its CP group."""

    dp_rank: int = 0
    dp_world: int = 1
    cp: ContextParallel | None = None
    mesh: DeviceMesh | None = None
    """The device mesh (None for one process): a second model (the KL reference) is
    parallelized over the same groups."""


def parallelize(
    model: Any,
    dims: ParallelDims,
    trainer: TrainerConfig,
    device: torch.device,
    mesh: DeviceMesh | None = None,
    precision: Precision | None = None,
) -> Layout:
    """Apply the trainer's parallelism to `model` (built on the meta device: the weights are
    read into its shards afterwards), in this order:

    1. context parallelism: attention over the `cp` group (rl/trainer/context_parallel.py);
    2. the LM head in chunks (`trainer.lm_head_chunk`, rl/trainer/head.py), and activation
       checkpointing of every decoder block (`trainer.activation_checkpointing`, its inputs
       on the host with `trainer.activation_offload`);
    3. expert parallelism: each MoE layer's experts split over `ep` (rl/trainer/expert_parallel.py);
    4. FSDP2: the experts over the ranks that share them, then every block, then the root.

    One process applies only what needs no mesh (activation checkpointing; it computes in
    `precision.compute` under autocast: `compute_context`). `mesh`: the one another model of
    the trainer was parallelized over (else a new one)."""
    if mesh is None and dims.sharded:
        mesh = build_mesh(dims, device.type)
    cp = None
    if mesh is not None and dims.cp > 1:
        cp = ContextParallel(mesh["cp"])
        cp.enable(model)
    if trainer.lm_head_chunk:
        head.enable(model, int(trainer.lm_head_chunk))
    if trainer.activation_checkpointing:
        apply_activation_checkpointing(model, bool(trainer.activation_offload))
    if mesh is None:
        return Layout(dp_world=dims.dp)
    experts = apply_expert_parallel(model, mesh["ep"]) if dims.ep > 1 else []
    apply_fsdp(model, mesh, dims, experts, precision, cpu_offload=trainer.cpu_offload)
    return Layout(data_parallel_rank(mesh), dims.dp, cp, mesh)


def compute_context(
    precision: Precision, dims: ParallelDims, device: torch.device
) -> contextlib.AbstractContextManager[Any]:
    """What a forward pass runs under: FSDP2 casts the weights it gathers itself; one process
    whose compute dtype is not its master copy's computes under autocast (matmuls in the
    compute dtype, the weights and their gradients staying in the master's)."""
    if dims.sharded or not precision.mixed:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch_dtype(precision.compute))


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
