"""Context parallelism: each sequence's positions split over the `cp` ranks of a group.

The rows of a micro-batch (packed or padded) are cut into `cp` contiguous column chunks; rank
r runs the model on chunk r only, with its true positions (for the rotary embedding). Attention
is exact by all-gathering keys and values: every decoder block gathers the K and V of all
chunks over the CP group (an autograd all-gather: its backward sums each chunk's key/value
gradients back onto the rank that computed them) and applies the row's mask restricted to this
rank's queries, so a query sees exactly the keys it would see unsplit (causal, and within its
own sample when rows are packed). Memory for activations shrinks by cp; K/V are whole for the
length of one block's attention. A ring of K/V blocks would keep them split too; on CPU and
for the lengths trained here the all-gather is the simpler exact choice.

A row that holds one sample alone (a long one) needs no mask: each rank's queries attend to
the keys up to their own with a causal bias aligned to the lower right (keys [0, hi) for
queries [lo, hi)), which kernels compute without materialising it.

Labels are shifted before the cut: the token each column predicts is taken from the whole row,
so chunk boundaries lose nothing. Each rank computes log-probabilities for its own columns and
they are gathered into the whole row on every rank, where the unchanged loss code runs. That
loss is the same on every rank of the group, so the gather's backward hands each rank the
gradient of its own columns (no sum: the group's ranks computed identical losses), and the
parameter gradients of the group's ranks add up to the unsplit ones in FSDP's reduction.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from rl.trainer import head
from rl.trainer.packing import next_token_logprobs, next_tokens

ATTENTION = "relay_cp"


def cp_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of this rank's queries over the keys and values of the whole CP group
    (query/key/value as [batch, heads, local length, head dim]). Called without `cp_mesh`
    (a forward of whole sequences, e.g. the KL reference) it is plain SDPA attention."""
    mesh = kwargs.get("cp_mesh")
    if mesh is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # One gather for K and V: two would run their backward collectives in an order autograd
    # may choose differently on different ranks.
    keys, values = _Gather.apply(torch.stack((key, value)), 3, True, mesh)
    mask = kwargs["cp_mask"]
    if mask is None:  # one sample a row: this rank's queries see every key up to their own
        end = (mesh.get_local_rank() + 1) * query.shape[2]
        keys, values = keys[:, :, :end], values[:, :, :end]
        mask = causal_lower_right(query.shape[2], end)
    out = F.scaled_dot_product_attention(
        query,
        keys,
        values,
        attn_mask=mask,
        scale=scaling,
        enable_gqa=query.shape[1] != keys.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, cp_attention)
# Whole-sequence forwards build the usual SDPA mask; the CP forward passes its own.
AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


class _Gather(torch.autograd.Function):
    """All-gather the chunks of a CP group along `dim`. Backward, with `summed`, adds the
    gradients every rank computed for this rank's chunk (keys and values: each rank's queries
    used them); without, it keeps this rank's part of its own gradient (log-probabilities:
    every rank computed the same loss from them). The sum is an all-reduce, which every
    backend has (gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, chunk: torch.Tensor, dim: int, summed: bool, mesh: DeviceMesh) -> Any:
        ctx.dim, ctx.summed, ctx.group = dim, summed, mesh.get_group()
        ctx.rank, ctx.width = mesh.get_local_rank(), chunk.shape[dim]
        parts = [torch.empty_like(chunk) for _ in range(mesh.size())]
        dist.all_gather(parts, chunk.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.summed:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
        mine = grad.narrow(ctx.dim, ctx.rank * ctx.width, ctx.width).contiguous()
        return mine, None, None, None


class ContextParallel:
    """Forwards of rows split over the `cp` dimension of the trainer's mesh."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()

    @staticmethod
    def enable(model: Any) -> None:
        """Route the model's attention through `cp_attention`."""
        model.config._attn_implementation = ATTENTION

    def next_token_logprobs(
        self, model: Any, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For rows `ids` [R, W] with positions and a [R, W, W] boolean attention mask (None:
        one sample a row, plain causal attention): the log-probability of each column's next
        token and the entropy of the distribution predicting it, [R, W] each (the last column
        predicts nothing: 0)."""
        rows, width = ids.shape
        chunk = -(-width // self.size)
        padded = chunk * self.size
        if padded > width:  # extra columns: token 0, attending to themselves only
            extra = padded - width
            ids = F.pad(ids, (0, extra))
            positions = F.pad(positions, (0, extra))
            if mask is not None:
                mask = F.pad(mask, (0, extra, 0, extra)) | torch.eye(
                    padded, dtype=torch.bool, device=ids.device
                )
        targets = next_tokens(ids)  # shifted before the cut
        lo, hi = self.rank * chunk, (self.rank + 1) * chunk
        inputs = {
            "input_ids": ids[:, lo:hi],
            "position_ids": positions[:, lo:hi],
            "cp_mask": None if mask is None else mask[:, None, lo:hi, :],
            "cp_mesh": self.mesh,
        }
        if head.enabled(model):
            at = torch.arange(rows * chunk, device=ids.device)
            local = targets[:, lo:hi].reshape(-1)
            picked, entropy = head.pair_logprobs(model, at // chunk, at % chunk, local, **inputs)
            picked, entropy = picked.view(rows, chunk), entropy.view(rows, chunk)
        else:
            picked, entropy = next_token_logprobs(model(**inputs).logits, targets[:, lo:hi])
        with torch.no_grad():
            whole_entropy = _Gather.apply(entropy, 1, False, self.mesh)
        whole = _Gather.apply(picked, 1, False, self.mesh)
        return whole[:, :width], whole_entropy[:, :width]
