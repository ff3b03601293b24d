"""Trainer parallelism as plain functions over a DeviceMesh, applied in a fixed order.

`ParallelDims` (rl/derive.py, torch-free: the planner resolves the same degrees) is the
validated description, checked without building a mesh; `build_mesh`
turns it into a DeviceMesh with named dimensions; `apply_fsdp` shards a Hugging Face causal LM
with FSDP2 (`fully_shard`) per decoder block and at the root, over `dp_shard` (FSDP) or
`dp_replicate x dp_shard` (HSDP: sharded inside a group, replicated across groups), with a
mixed-precision policy, optional CPU offload and optional activation checkpointing.

Gradients are those of the whole batch's loss: each rank's loss is already normalised by the
whole batch's token count, so gradients are summed across ranks, not averaged.

Checkpoints go through torch.distributed.checkpoint (DCP): every rank writes its own shards,
and a checkpoint written by one world size loads into another. `full_state_dict` gathers the
weights for an HF-layout export on rank 0.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from rl.derive import ParallelDims
from rl.expert_parallel import apply_expert_parallel

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


def apply_activation_checkpointing(model: Any) -> None:
    """Recompute each decoder block's activations in the backward pass instead of keeping them
    (the blocks' own checkpointing, which passes their keyword arguments through)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # the blocks checkpoint only in training mode


def apply_fsdp(
    model: Any,
    mesh: DeviceMesh,
    dims: ParallelDims,
    param_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
) -> Any:
    """Shard every decoder block, then the root (embeddings, final norm, LM head)."""
    if cpu_offload and not torch.cuda.is_available():
        raise ValueError("trainer.cpu_offload=true moves GPU state to the host; there is no GPU")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kwargs: dict[str, Any] = {"mp_policy": policy}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if dims.ep > 1:  # experts first: split over ep, then sharded over the ranks sharing them
        for experts in apply_expert_parallel(model, mesh["ep"]):
            fully_shard(experts, mesh=_submesh(mesh, dims.expert_fsdp_dims), **kwargs)
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


def local_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds (its shards only)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def full_state_dict(model: torch.nn.Module, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """Whole, unsharded weights (a collective under FSDP: every rank calls it). Rank 0 gets
    them on the host; with `every_rank`, every rank gets them, on its device."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank)
    return get_model_state_dict(model, options=options)


def fill_from_rank0(
    model: Any, whole: dict[str, torch.Tensor], device: torch.device, cpu_offload: bool = False
) -> None:
    """Give a sharded model rank 0's weights (a collective). Rank 0 passes its whole state
    dict; the other ranks, whose model was built on the meta device, pass nothing, and each
    rank keeps only its shards. Buffers, which hold no learned state and are not all in a
    state dict (rotary tables), are sent from rank 0 as they are."""
    rank = dist.get_rank()
    if rank != 0:  # sharded parameters live on the host when FSDP offloads them
        model.to_empty(device="cpu" if cpu_offload else device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, whole, options=options)
    names = [(name, b.dtype, tuple(b.shape)) for name, b in model.named_buffers()]
    theirs = [names]
    dist.broadcast_object_list(theirs, src=0)
    if theirs[0] != names:
        raise RuntimeError(f"rank {rank} built other buffers than rank 0: {names} != {theirs[0]}")
    for module in model.modules():
        for leaf, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[leaf] = buffer = buffer.to(device)
                dist.broadcast(buffer, src=0)


def _checkpointed(
    model: Any, optimizer: Any, trainable_only: bool
) -> tuple[dict[str, Any], dict[str, Any], StateDictOptions]:
    """The model's and optimiser's state dicts a checkpoint holds: every parameter, or (a LoRA
    run, whose base is its published version 0) only those that train. A tied weight (the LM
    head that is the embedding) is not a parameter of its own and would slip past DCP's
    `ignore_frozen_params`: only names of trainable parameters are kept."""
    options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    if trainable_only:
        trained = {
            name.replace("._checkpoint_wrapped_module", "")
            for name, p in model.named_parameters()
            if p.requires_grad
        }
        model_state = {k: v for k, v in model_state.items() if k in trained}
    return model_state, optim_state, options


def save_checkpoint(
    model: Any, optimizer: Any, step: int, target: Path, trainable_only: bool = False
) -> None:
    """Model, optimiser and step with DCP, each rank writing its shards (a collective)."""
    model_state, optim_state, _ = _checkpointed(model, optimizer, trainable_only)
    dcp.save({"model": model_state, "optim": optim_state, "step": step}, checkpoint_id=target)


def load_checkpoint(model: Any, optimizer: Any, source: Path, trainable_only: bool = False) -> int:
    """Load a DCP checkpoint into the model and optimiser as they are sharded now (any world
    size); returns its step."""
    model_state, optim_state, options = _checkpointed(model, optimizer, trainable_only)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state, "step": 0}
    dcp.load(state, checkpoint_id=source)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=options,
    )
    return int(state["step"])
