"""Trainer parallelism as plain functions over a DeviceMesh, applied in a fixed order.

`ParallelDims` is the validated description (checked without building a mesh); `build_mesh`
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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)


@dataclass(frozen=True)
class ParallelDims:
    """The trainer's degrees; their product is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    ep: int = 1
    world: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "cp", "ep", "world"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.trainer.{name}={getattr(self, name)}: must be >= 1")
        product = self.dp_replicate * self.dp_shard * self.cp
        if product != self.world:
            raise ValueError(
                f"dp_replicate x dp_shard x cp = {self.dp_replicate} x {self.dp_shard} x "
                f"{self.cp} = {product}, but the trainer has {self.world} ranks"
            )
        if (self.dp_shard * self.cp) % self.ep:
            raise ValueError(
                f"parallel.trainer.ep={self.ep}: must divide dp_shard x cp = "
                f"{self.dp_shard} x {self.cp} (EP borrows those ranks)"
            )

    @property
    def sharded(self) -> bool:
        """Whether any weight is split or replicated across ranks (world > 1)."""
        return self.world > 1

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        """Mesh dimensions FSDP shards over: one (FSDP) or two (HSDP: replicate, shard)."""
        return ("dp_replicate", "dp_shard") if self.dp_replicate > 1 else ("dp_shard",)

    def shard_degree(self) -> int:
        """Ranks one weight is split over (the parameter bytes per rank shrink by this)."""
        return self.dp_shard


def from_config(par: Any, world: int) -> ParallelDims:
    """The degrees of `parallel.trainer` with dp_shard = -1 resolved to what the world leaves."""
    fixed = par.dp_replicate * par.cp
    dp_shard = par.dp_shard if par.dp_shard != -1 else max(1, world // fixed)
    return ParallelDims(par.dp_replicate, dp_shard, par.cp, par.ep, world)


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh:
    if dims.cp > 1 or dims.ep > 1:
        raise NotImplementedError(
            f"parallel.trainer cp={dims.cp} ep={dims.ep}: context and expert parallelism are not "
            "in the trainer yet; use dp_replicate and dp_shard"
        )
    return init_device_mesh(
        device_type, (dims.dp_replicate, dims.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
    )


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The transformer blocks of an HF causal LM (`model.model.layers`)."""
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
    kwargs: dict[str, Any] = {"mesh": mesh[dims.fsdp_dims], "mp_policy": policy}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
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


def sum_gradients(model: torch.nn.Module) -> None:
    """Unsharded data parallelism: the summed gradient of every rank (FSDP reduces its own)."""
    if dist.get_world_size() == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def local_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds (its shards only)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole, unsharded weights on CPU (a collective under FSDP: every rank calls it; rank 0
    gets them)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def save_checkpoint(model: Any, optimizer: Any, step: int, target: Path) -> None:
    """Model, optimiser and step with DCP, each rank writing its shards (a collective)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "step": step}, checkpoint_id=target)


def load_checkpoint(model: Any, optimizer: Any, source: Path) -> int:
    """Load a DCP checkpoint into the model and optimiser as they are sharded now (any world
    size); returns its step."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state, "step": 0}
    dcp.load(state, checkpoint_id=source)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return int(state["step"])
