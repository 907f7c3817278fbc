"""All-to-all token dispatcher for expert parallelism (dropless, uneven splits, autograd-correct).

Implements `mula.moe.Dispatcher`, a drop-in for the MoE layer's local dispatcher. Per layer and step:

1. sort this rank's (token, k) assignments by global expert;
2. exchange per-expert token counts over the EP group (one small all_to_all of E_total integers);
3. `all_to_all_single` the token rows with the resulting uneven splits;
4. regroup the received rows from (source rank, local expert) order into (local expert, source rank)
   order, which is what the grouped experts want;
5. `combine` runs the same steps backwards and forms each token's weighted sum of its K expert outputs.

Token rows travel in the compute dtype: the autocast dtype when autocast is on for the tokens'
device (under bf16-mixed the residual stream reaching the MoE layer is fp32, but the experts compute
in bf16 anyway, so sending fp32 would double the traffic for nothing), else the tokens' own dtype
(bf16 under bf16-true). Received rows are cast back to the dtype `dispatch` was given, which is
also the dtype `combine` returns, so the layer sees the dtypes it would see without parallelism.

The backward of every exchange is the reverse exchange (see `_AllToAll`). A rank that receives no
tokens gets empty tensors and still takes part in every collective, so nothing hangs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 whose backward is the reverse all_to_all (splits swapped)."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any, meter: Any
    ) -> Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group, ctx.meter = out_splits, in_splits, group, meter
        return _exchange(x, out_splits, in_splits, group, meter)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        back = _exchange(grad, ctx.in_splits, ctx.out_splits, ctx.group, ctx.meter)
        return back, None, None, None, None


def _exchange(x: Tensor, out_splits: list[int], in_splits: list[int], group: Any, meter: Any) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    if meter is not None:
        # Bytes that leave this rank: everything except the slice it sends to itself.
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        meter.bytes_sent += (sum(in_splits) - in_splits[meter.ep_rank]) * row_bytes
    return out


@dataclass
class _DispatchState:
    """What `combine` needs to undo `dispatch` for one call."""

    inv_order: Tensor  # [N*K] position of each (token, k) pair in the expert-sorted send buffer
    wire_dtype: torch.dtype  # dtype the token rows travel in
    out_dtype: torch.dtype  # dtype of dispatch's input, which combine returns
    regroup: Tensor | None  # [M] received-row index of each expert-ordered row (None: identity)
    send_splits: list[int]
    recv_splits: list[int]
    topk_weight: Tensor  # [N, K]
    num_tokens: int
    top_k: int


class AllToAllDispatcher:
    """Dispatcher that sends each token to the EP rank holding its expert and brings the results back.

    A plain object like every `mula.moe.Dispatcher` (no parameters or buffers), so installing it
    leaves the model's modules and state-dict keys as they were.

    num_experts: experts in the whole model (E_total); ep_size/ep_rank/ep_group: this rank's expert-
    parallel group. Local expert j on EP rank p is global expert p * (E_total / ep_size) + j.
    `bytes_sent` accumulates the bytes this rank sent to other ranks (forward and backward, token rows
    and counts) until someone resets it (the MoE metrics callback does, once per optimizer step).
    """

    def __init__(self, num_experts: int, ep_size: int, ep_rank: int, ep_group: Any = None) -> None:
        if ep_size < 1 or num_experts % ep_size != 0:
            raise ValueError(
                f"The model has {num_experts} experts, which is not divisible by expert_parallel_size={ep_size}."
            )
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.ep_group = ep_group
        self.num_local_experts = num_experts // ep_size
        self.bytes_sent = 0

    def __repr__(self) -> str:
        return (
            f"AllToAllDispatcher(num_experts={self.num_experts}, ep_size={self.ep_size}, "
            f"ep_rank={self.ep_rank})"
        )

    def dispatch(
        self, x: Tensor, topk_idx: Tensor, topk_weight: Tensor
    ) -> tuple[Tensor, Tensor, _DispatchState]:
        """Send rows of x [N, H] to their top-k experts' ranks.

        Returns (x_sorted [M, H] grouped by local expert, tokens_per_local_expert [E_local] long, state).
        """
        num_tokens, top_k = topk_idx.shape
        flat_idx = topk_idx.reshape(-1)
        # Stable sort keeps token order inside each expert, like the single-process dispatcher.
        order = torch.argsort(flat_idx, stable=True)
        inv_order = torch.empty_like(order)
        inv_order[order] = torch.arange(order.numel(), device=order.device)
        x_send = x.index_select(0, order // top_k)
        counts = torch.bincount(flat_idx, minlength=self.num_experts)

        if self.ep_size == 1:
            state = _DispatchState(inv_order, x.dtype, x.dtype, None, [], [], topk_weight, num_tokens, top_k)
            return x_send, counts, state
        wire = wire_dtype(x)
        x_send = x_send.to(wire)

        # counts.view(ep, E_local)[p] goes to EP rank p: rows of recv_counts are source ranks.
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)
        self.bytes_sent += (self.ep_size - 1) * self.num_local_experts * counts.element_size()
        send_splits = counts.view(self.ep_size, self.num_local_experts).sum(1).tolist()
        recv_table = recv_counts.view(self.ep_size, self.num_local_experts).cpu()
        recv_splits = recv_table.sum(1).tolist()

        # Back in the layer's dtype: the experts get what they would get without expert parallelism
        # (under autocast they cast to bf16 again, exactly, since the values are bf16 already).
        x_recv = _AllToAll.apply(x_send, recv_splits, send_splits, self.ep_group, self).to(x.dtype)
        regroup = _regroup_index(recv_table).to(x.device)
        x_sorted = x_recv.index_select(0, regroup)
        tokens_per_local_expert = recv_table.sum(0).to(device=x.device, dtype=torch.long)
        state = _DispatchState(
            inv_order, wire, x.dtype, regroup, send_splits, recv_splits, topk_weight, num_tokens, top_k
        )
        return x_sorted, tokens_per_local_expert, state

    def combine(self, y_sorted: Tensor, state: _DispatchState) -> Tensor:
        """Bring expert outputs back to their tokens and return the weighted sum y [N, H]."""
        if state.regroup is not None:
            # Undo the regrouping: the row at received position regroup[i] is y_sorted[i].
            inv_regroup = torch.empty_like(state.regroup)
            inv_regroup[state.regroup] = torch.arange(state.regroup.numel(), device=state.regroup.device)
            y_recv = y_sorted.index_select(0, inv_regroup).to(state.wire_dtype)
            y_send = _AllToAll.apply(y_recv, state.send_splits, state.recv_splits, self.ep_group, self)
            y_send = y_send.to(state.out_dtype)
        else:
            y_send = y_sorted
        y_pairs = y_send.index_select(0, state.inv_order).view(
            state.num_tokens, state.top_k, y_send.shape[-1]
        )
        weights = state.topk_weight.to(y_pairs.dtype).unsqueeze(-1)
        return (y_pairs * weights).sum(dim=1)


def wire_dtype(x: Tensor) -> torch.dtype:
    """The dtype token rows of ``x`` are sent in: the autocast dtype when autocast is on for x's
    device and x is floating point, else x's own dtype."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _regroup_index(recv_table: Tensor) -> Tensor:
    """Index that reorders received rows from (source, local expert) blocks to (local expert, source).

    recv_table [ep, E_local] holds the row count of each block in arrival order (source-major).
    """
    sizes = recv_table.reshape(-1)
    starts = (torch.cumsum(sizes, 0) - sizes).view_as(recv_table)
    # Visit blocks expert-major; each block contributes its consecutive received rows.
    block_starts = starts.t().reshape(-1)
    block_sizes = recv_table.t().reshape(-1)
    out_starts = torch.cumsum(block_sizes, 0) - block_sizes
    total = int(block_sizes.sum())
    shift = torch.repeat_interleave(block_starts - out_starts, block_sizes, output_size=total)
    return torch.arange(total, dtype=torch.long) + shift
