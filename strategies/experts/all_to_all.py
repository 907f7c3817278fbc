"""All-to-all token dispatcher for expert parallelism (dropless with uneven splits, or with an expert
capacity and fixed blocks; autograd-correct).

Implements `mula.model.moe.Dispatcher`, a drop-in for the MoE layer's local dispatcher, on the local path's
permutation plan and kernels (`mula.model.kernels.permute`: Triton on GPUs). Per layer and step:

1. `plan_routing` sorts this rank's (token, k) assignments by global expert, i.e. by destination rank
   (experts are rank-contiguous), and `permute` writes the send buffer (no [N, K, H] temporary);
2. one small all_to_all of the E_total counts, then the layer's only host synchronisation: the rows
   to and from each rank, summed on the device, copied to the host together (the splits
   `all_to_all_single` needs; `mula.host_sync.to_host`, reason `A2A_SPLITS`). `combine` and both
   backward exchanges reuse them: one read per layer and forward (a recomputed forward reads again);
3. `all_to_all_single` the token rows with those uneven splits;
4. a second plan over the received rows' local expert ids (a stable sort keeps the source-rank order
   within each expert) lays them out the way the local experts' backend runs them, as the local path
   does; where that layout folds the combine weights into the experts (the CPU padded layout), the
   weights travel with the rows (one fp32 per row);
5. `combine` runs the same steps backwards: `unpermute` of the expert plan, the reverse all_to_all,
   and `unpermute` of the send plan, which forms each token's sum of its K (weighted) expert outputs.

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

from mula.host_sync import to_host
from mula.layout.rules import check_degrees, check_experts
from mula.model.kernels import RoutingPlan, permute, plan_routing, unpermute
from mula.model.kernels.capacity import Capacity, fixed_layout, plan_capacity
from mula.model.kernels.permute import experts_run_padded
from mula.model.moe import LocalDispatcher

# The reason `mula.host_sync.to_host` counts the split sizes' read under (one per MoE layer and forward).
A2A_SPLITS = "expert all-to-all splits"


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

    send_plan: RoutingPlan  # this rank's assignments by global expert (its combine weights, unless folded)
    expert_plan: RoutingPlan  # received rows -> the local experts' layout
    wire_dtype: torch.dtype  # dtype the token rows travel in
    out_dtype: torch.dtype  # dtype of dispatch's input, which combine returns
    send_splits: list[int]
    recv_splits: list[int]


@dataclass
class _FixedState:
    """What `combine` needs to undo a capacity dispatch (fixed blocks, `AllToAllDispatcher`)."""

    send_plan: RoutingPlan  # this rank's choices in [E, C] slots (combine weights folded into the experts)
    wire_dtype: torch.dtype
    out_dtype: torch.dtype
    splits: list[int]  # E_local * C rows to and from every EP rank


class AllToAllDispatcher:
    """Dispatcher that sends each token to the EP rank holding its expert and brings the results back.

    A plain object like every `mula.model.moe.Dispatcher` (no parameters or buffers), so installing it
    leaves the model's modules and state-dict keys as they were.

    num_experts: experts in the whole model (E_total); ep_size/ep_rank/ep_group: this rank's expert-
    parallel group; backend: the experts' kernel backend (the plans lay rows out for it). Local expert
    j on EP rank p is global expert p * (E_total / ep_size) + j. `bytes_sent` accumulates the bytes
    this rank sent to other ranks (forward and backward: token rows, combine weights, counts) until
    someone resets it (the MoE metrics callback does, once per optimizer step).

    With a `capacity` (`mula.model.kernels.capacity`, over the E_total experts, so every rank drops what
    one process running its micro-batch drops), the exchange moves fixed blocks instead: the send buffer
    is the capacity plan's [E_total, C] slots (zero rows where an expert has fewer choices), rank p's
    block is its experts' E_local * C rows, every split is that size (known from shapes: no count
    exchange and no host read), and the combine weights travel with the rows (one fp32 each). The
    received [ep, E_local, C] rows are regrouped to [E_local, ep * C], one batched GEMM per projection.
    """

    def __init__(
        self,
        num_experts: int,
        ep_size: int,
        ep_rank: int,
        ep_group: Any = None,
        backend: str = "auto",
        capacity: Capacity | None = None,
    ) -> None:
        check_degrees(ep_size, 1)
        check_experts(num_experts, ep_size)
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.ep_group = ep_group
        self.backend = backend
        self.num_local_experts = num_experts // ep_size
        self.capacity = capacity
        self.bytes_sent = 0
        self._local = LocalDispatcher(num_experts, backend, capacity)  # ep_size 1: nothing to exchange

    def __repr__(self) -> str:
        extra = "" if self.capacity is None else f", capacity={self.capacity}"
        return (
            f"AllToAllDispatcher(num_experts={self.num_experts}, ep_size={self.ep_size}, "
            f"ep_rank={self.ep_rank}, backend={self.backend!r}{extra})"
        )

    def dispatch(
        self, x: Tensor, topk_idx: Tensor, topk_weight: Tensor
    ) -> tuple[Tensor, RoutingPlan, _DispatchState | RoutingPlan]:
        """Send rows of x [N, H] to their top-k experts' ranks.

        Returns (x_grouped: the received rows in the local experts' layout, the `RoutingPlan` of that
        layout (`plan.counts`: rows per local expert), state).
        """
        if self.ep_size == 1:
            return self._local.dispatch(x, topk_idx, topk_weight)
        if self.capacity is not None:
            return self._dispatch_fixed(x, topk_idx, topk_weight)
        wire = wire_dtype(x)
        fold = experts_run_padded(self.backend, x.device, x.dtype)  # the same answer on every rank
        send_plan = plan_routing(topk_idx, self.num_experts, None if fold else topk_weight)
        x_send = permute(x.to(wire), send_plan)

        # counts.view(ep, E_local)[p] goes to EP rank p: rows of recv_counts are source ranks.
        recv_counts = torch.empty_like(send_plan.counts)
        dist.all_to_all_single(recv_counts, send_plan.counts, group=self.ep_group)
        self.bytes_sent += (self.ep_size - 1) * self.num_local_experts * recv_counts.element_size()
        # rows to and from each EP rank, summed on the device; the layer's one host read (the splits)
        splits = torch.stack((send_plan.counts, recv_counts)).view(2, self.ep_size, -1).sum(2)
        send_splits, recv_splits = to_host(splits, A2A_SPLITS).tolist()

        # Back in the layer's dtype: the experts get what they would get without expert parallelism
        # (under autocast they cast to bf16 again, exactly, since the values are bf16 already).
        x_recv = _AllToAll.apply(x_send, recv_splits, send_splits, self.ep_group, self).to(x.dtype)
        local_ids = torch.arange(self.num_local_experts, device=x.device).repeat(self.ep_size)
        local_ids = torch.repeat_interleave(local_ids, recv_counts, output_size=sum(recv_splits))
        w_recv = None
        if fold:
            w_send = topk_weight.reshape(-1)[send_plan.order].float()
            w_recv = _AllToAll.apply(w_send, recv_splits, send_splits, self.ep_group, self).unsqueeze(1)
        expert_plan = plan_routing(
            local_ids.unsqueeze(1), self.num_local_experts, w_recv, backend=self.backend, dtype=x.dtype
        )
        state = _DispatchState(send_plan, expert_plan, wire, x.dtype, send_splits, recv_splits)
        return permute(x_recv, expert_plan), expert_plan, state

    def _dispatch_fixed(
        self, x: Tensor, topk_idx: Tensor, topk_weight: Tensor
    ) -> tuple[Tensor, RoutingPlan, _FixedState]:
        """The capacity dispatch (class docstring): fixed blocks, static splits."""
        wire = wire_dtype(x)
        send_plan = plan_capacity(topk_idx, topk_weight, self.num_experts, self.capacity)
        slots = send_plan.layout.rows // self.num_experts
        splits = [self.num_local_experts * slots] * self.ep_size
        x_recv = _AllToAll.apply(permute(x.to(wire), send_plan), splits, splits, self.ep_group, self)
        w_recv = _AllToAll.apply(send_plan.row_weight.float(), splits, splits, self.ep_group, self)
        # [ep, E_local, C] (source rank major) -> [E_local, ep * C]: each local expert's rows together
        x_rows = self._by_expert(x_recv.to(x.dtype), slots)
        rows = x_rows.shape[0]
        ids = torch.arange(rows, device=x.device)
        layout = fixed_layout(self.num_local_experts, self.ep_size * slots, x.device)
        # the received rows are already in the layout: an identity plan that carries their weights
        expert_plan = RoutingPlan(ids, ids, ids, layout.counts, 1, layout)
        expert_plan.row_weight = self._by_expert(w_recv.unsqueeze(1), slots).squeeze(1)
        return x_rows, expert_plan, _FixedState(send_plan, wire, x.dtype, splits)

    def _by_expert(self, rows: Tensor, slots: int) -> Tensor:
        """[ep * E_local * C, D] rows by source rank -> [E_local * ep * C, D] by local expert."""
        d = rows.shape[1]
        return rows.view(self.ep_size, self.num_local_experts, slots, d).transpose(0, 1).reshape(-1, d)

    def _by_source(self, rows: Tensor, slots: int) -> Tensor:
        """The inverse of `_by_expert`."""
        d = rows.shape[1]
        return rows.view(self.num_local_experts, self.ep_size, slots, d).transpose(0, 1).reshape(-1, d)

    def combine(self, y_grouped: Tensor, state: _DispatchState | _FixedState | RoutingPlan) -> Tensor:
        """Bring expert outputs back to their tokens and return the weighted sum y [N, H]."""
        if isinstance(state, RoutingPlan):
            return self._local.combine(y_grouped, state)
        if isinstance(state, _FixedState):
            slots = state.send_plan.layout.rows // self.num_experts
            y_recv = self._by_source(y_grouped, slots).to(state.wire_dtype)
            y_send = _AllToAll.apply(y_recv, state.splits, state.splits, self.ep_group, self)
            return unpermute(y_send.to(state.out_dtype), state.send_plan)
        y_recv = unpermute(y_grouped, state.expert_plan).to(state.wire_dtype)
        y_send = _AllToAll.apply(y_recv, state.send_splits, state.recv_splits, self.ep_group, self)
        return unpermute(y_send.to(state.out_dtype), state.send_plan)


def wire_dtype(x: Tensor) -> torch.dtype:
    """The dtype token rows of ``x`` are sent in: the autocast dtype when autocast is on for x's
    device and x is floating point, else x's own dtype."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype
