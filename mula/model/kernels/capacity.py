"""Expert capacity and token dropping: a routing plan in which every expert takes at most C rows.

The rule (`MulaConfig.capacity_factor`, `drop_policy`), as Megatron-Core states it for its token dropping:

* C = ceil(N * K / E * capacity_factor) (at most N) for the N tokens one call routes (a micro-batch on one
  data-parallel rank) with top-K over E experts. E is the model's experts, not a rank's share, so a rank
  holding E / ep of them under expert parallelism computes the same C and drops the same choices as one
  process running the same micro-batch.
* An expert chosen more than C times keeps C of those choices: `probs` keeps its C highest combine
  weights (Megatron-Core's default), ties to the earlier position; `position` keeps its first C in
  token order. Position is the flat index n * K + k of token n's k-th choice.
* A dropped choice contributes nothing to its token's output and gets no gradient; the kept choices'
  weights are not renormalised, so a token that lost a choice has a smaller routed sum (its residual
  stream carries it on).

The plan lays the rows out as [E, C] (expert e's slot c is row e * C + c: its kept choices in the
policy's order, then zero rows), one bucket of `mula.model.kernels.padded`, which the experts run as one
batched GEMM per projection on every device. Every size follows from shapes alone and the plan is built
by sorts and gathers: no host read and no data-dependent size (so an all-to-all of it moves fixed-size
blocks, `strategies.experts.all_to_all`). The combine weights are folded into the experts
(`RoutingPlan.row_weight`), so they travel with the rows; combining is a plain sum that reads a zero row
for a dropped choice (`RoutingPlan.drops`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mula.model.kernels.padded import BucketLayout
from mula.model.kernels.permute import RoutingPlan, fold_weights
from mula.model.moe_capacity import Capacity

__all__ = ["Capacity", "dropped_choices", "fixed_layout", "keep_order", "plan_capacity"]


def fixed_layout(num_experts: int, slots: int, device: torch.device) -> BucketLayout:
    """The [num_experts, slots] layout: one bucket of every expert in id order, `slots` rows each."""
    ids = torch.arange(num_experts, device=device)
    buckets = [(0, num_experts, slots, 0)] if num_experts and slots else []
    rows = num_experts * slots
    return BucketLayout(ids, buckets, ids * slots, torch.full_like(ids, slots), rows, True)


def keep_order(topk_idx: Tensor, topk_weight: Tensor, num_experts: int, policy: str) -> Tensor:
    """[N*K] long: the flat assignments sorted by expert, each expert's in the order it keeps them
    (`policy`; stable sorts, so ties keep position order)."""
    flat = topk_idx.reshape(-1).long()
    if policy == "position":
        return torch.argsort(flat, stable=True)
    by_weight = torch.argsort(topk_weight.detach().reshape(-1), descending=True, stable=True)
    return by_weight.index_select(0, torch.argsort(flat.index_select(0, by_weight), stable=True))


def plan_capacity(topk_idx: Tensor, topk_weight: Tensor, num_experts: int, capacity: Capacity) -> RoutingPlan:
    """The routing of topk_idx [N,K] with each expert capped at `capacity.slots` rows (module docstring).

    `permute` of the plan gives [E * C, H] rows (zero rows in the empty slots), `grouped_swiglu` runs them
    with the combine weights `topk_weight` [N,K] folded in, and `unpermute` sums each token's kept rows.
    """
    n, k = topk_idx.shape
    device = topk_idx.device
    slots = capacity.slots(n, k, num_experts)
    flat = topk_idx.reshape(-1).long()
    m = flat.numel()
    order = keep_order(topk_idx, topk_weight, num_experts, capacity.policy)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    starts = torch.cumsum(counts, 0) - counts
    # each assignment's place among its expert's choices, in keeping order
    place = torch.arange(m, device=device) - starts.index_select(0, flat.index_select(0, order))
    place = torch.empty_like(place).scatter_(0, order, place)
    rows = num_experts * slots
    unsort = torch.where(place < slots, flat * slots + place, rows)  # a dropped one: the sink row
    # row e*C + c holds expert e's c-th kept assignment, or none (m: the zero row) -- gathers only
    row = torch.arange(rows, device=device)
    expert, slot = row // max(slots, 1), row % max(slots, 1)
    filled = slot < counts.index_select(0, expert)
    source = torch.where(filled, starts.index_select(0, expert) + slot, m)
    row_order = torch.cat((order, order.new_full((1,), m))).index_select(0, source)
    layout = fixed_layout(num_experts, slots, device)
    plan = RoutingPlan(row_order, unsort, row_order // k, layout.counts, k, layout, drops=True)
    plan.row_weight = fold_weights(topk_weight, plan)
    return plan


def dropped_choices(counts: Tensor, slots: int) -> Tensor:
    """How many of the choices counted per expert (`counts` [E]) a capacity of `slots` drops (a 0-d long
    tensor, on the device: no host read)."""
    return (counts - slots).clamp(min=0).sum()
