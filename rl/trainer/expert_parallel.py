"""Expert parallelism: the routed experts of a MoE block split over the `ep` mesh dimension,
tokens sent to the rank holding their expert and back with all-to-all.

Qwen3-MoE, GlmMoeDsa (GLM-5) and MiniMax-M2 all route through one kind of module in
transformers, `*Experts.forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`, with
the weights of all experts stacked as `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`.
`ExpertParallel` replaces that module, keeping the parameter names, so checkpoints and the HF
export keep their layout. Its weights are DTensors sharded on dim 0 (the expert) over `ep`:
rank j of an EP group holds experts [j E/ep, (j+1) E/ep). FSDP then shards them further over
the data-parallel ranks that hold the same experts, and DCP sees the whole [E, ...] tensor.

One forward, per MoE layer:
1. every (token, slot) pair is sorted by expert, which groups them by destination rank;
2. counts per expert go to every rank (a plain all-to-all), then the token rows (an autograd
   all-to-all, whose backward sends the gradients back the same way);
3. each local expert runs on its rows (SwiGLU: act(x Wg) * (x Wu), then Wd);
4. the outputs return by the reverse all-to-all, are scaled by the routing weights and summed
   into their tokens.
The router and the shared experts stay as they are: replicated weights, sharded by FSDP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


def expert_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) for every stacked-experts module of an HF MoE model."""
    found = []
    for parent in model.modules():
        for attr, child in parent.named_children():
            weights = (getattr(child, "gate_up_proj", None), getattr(child, "down_proj", None))
            if type(child).__name__.endswith("Experts") and all(
                isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights
            ):
                found.append((parent, attr, child))
    return found


class ExpertParallel(nn.Module):
    """A stacked-experts module whose experts live on the ranks of an `ep` mesh dimension."""

    def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh) -> None:
        super().__init__()
        self.num_experts = experts.gate_up_proj.shape[0]
        self.ep = ep_mesh.size()
        if self.num_experts % self.ep:
            raise ValueError(
                f"parallel.trainer.ep={self.ep} must divide the model's {self.num_experts} "
                "experts per layer"
            )
        self.local_experts = self.num_experts // self.ep
        self.group = ep_mesh.get_group()
        self.act_fn = experts.act_fn
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name)
            whole = weight.detach()
            start = ep_mesh.get_local_rank() * self.local_experts
            local = whole[start : start + self.local_experts].clone()
            shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            # Frozen experts (a LoRA run adapts only the attention) stay frozen.
            self.register_parameter(name, nn.Parameter(shard, requires_grad=weight.requires_grad))

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, k = top_k_index.shape
        flat_expert = top_k_index.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)  # grouped by expert, hence by rank
        token_of = order // k
        sent_per_expert = torch.bincount(flat_expert, minlength=self.num_experts)
        received_per_expert = torch.empty_like(sent_per_expert)
        dist.all_to_all_single(received_per_expert, sent_per_expert, group=self.group)
        send = sent_per_expert.view(self.ep, self.local_experts).sum(1).tolist()
        # received_per_expert[s * L + e]: rows rank s sends to this rank's local expert e.
        per_source = received_per_expert.view(self.ep, self.local_experts)
        receive = per_source.sum(1).tolist()
        rows = hidden[token_of]
        arrived = _AllToAll.apply(rows, send, receive, self.group)
        out = self.run_local_experts(arrived, per_source)
        back = _AllToAll.apply(out, receive, send, self.group)
        weighted = back * top_k_weights.reshape(-1)[order, None].to(back.dtype)
        return torch.zeros_like(hidden).index_add(0, token_of, weighted.to(hidden.dtype))

    def run_local_experts(self, rows: torch.Tensor, per_source: torch.Tensor) -> torch.Tensor:
        """Each local expert on its rows; rows arrive grouped by source rank, then expert."""
        expert_of = torch.arange(self.local_experts).repeat(self.ep)
        expert_of = expert_of.repeat_interleave(per_source.reshape(-1).cpu()).to(rows.device)
        by_expert = torch.argsort(expert_of, stable=True)
        counts = per_source.sum(0).tolist()
        gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
        outputs = []
        for e, chunk in enumerate(torch.split(rows[by_expert], counts)):
            gate, up = nn.functional.linear(chunk, gate_up[e]).chunk(2, dim=-1)
            outputs.append(nn.functional.linear(self.act_fn(gate) * up, down[e]))
        out = torch.cat(outputs) if outputs else rows[:0]
        return torch.empty_like(out).index_copy(0, by_expert, out)


class _AllToAll(torch.autograd.Function):
    """Rows [n, H] sent in `send[j]`-row pieces to rank j of `group`, `receive[j]` rows
    arriving from each; backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], receive: list[int], group: Any):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return back, None, None, None


def _local(weight: Any) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[ExpertParallel]:
    """Replace every stacked-experts module with its expert-parallel form; returns them."""
    found = expert_modules(model)
    if not found:
        raise ValueError(
            f"parallel.trainer.ep={ep_mesh.size()}: {type(model).__name__} has no MoE experts "
            "(expert parallelism needs a Qwen3-MoE, GlmMoeDsa or MiniMax-M2 family model)"
        )
    replaced = []
    for parent, attr, experts in found:
        module = ExpertParallel(experts, ep_mesh)
        setattr(parent, attr, module)
        replaced.append(module)
    return replaced
