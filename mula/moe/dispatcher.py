"""Token dispatchers: group the (token, expert) assignments by expert and back.

`LocalDispatcher` is the single-device one; the expert-parallel strategy swaps in an all-to-all
dispatcher with the same two methods, so the MoE layer never knows where its experts live.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import Tensor

from mula.kernels import (
    BucketLayout,
    RoutingPlan,
    pad_plan,
    padded_layout_for,
    permute,
    plan_routing,
    row_weights,
    unpermute,
)
from mula.kernels.padded import plan_buckets


@dataclass
class LocalDispatchState:
    """What `combine` needs to undo a `dispatch`."""

    plan: RoutingPlan  # the sort of (token, slot) assignments by expert
    topk_weight: Tensor | None  # [N, K] combine weights; None when the experts applied them


class LocalDispatcher:
    """Groups assignments by expert with one stable sort (no loop over experts, no host sync).

    A plain object rather than an `nn.Module`: it holds no state, and the strategy can replace
    `MoELayer.dispatcher` with any object that has the same `dispatch`/`combine` methods. The
    gathers run as fused kernels on GPUs and vectorised torch ops elsewhere (`mula.kernels.permute`).
    Where the experts' backend runs on the bucketed padded layout (CPU), the gather writes that
    layout directly and `dispatch` returns its `BucketLayout` in place of the counts, carrying the
    combine weights per row: the experts scale their activations by them (a 64-wide product instead
    of a hidden-wide one, and no [N,K,H] temporaries), and `combine` is a plain sum.
    """

    def __init__(self, num_experts: int, backend: str = "auto") -> None:
        self.num_experts = num_experts
        self.backend = backend

    def dispatch(
        self, x: Tensor, topk_idx: Tensor, topk_weight: Tensor
    ) -> tuple[Tensor, Tensor | BucketLayout, LocalDispatchState]:
        """x [N,H], topk_idx [N,K], topk_weight [N,K] -> (x_sorted, tokens per expert [E] or layout, state).

        Rows of `x_sorted` are grouped by expert in increasing expert id ([N*K, H]), or in the
        bucketed padded layout ([layout.rows, H]); within an expert they keep token order (stable
        sort), which makes the result deterministic.
        """
        plan = plan_routing(topk_idx, self.num_experts)
        if padded_layout_for(self.backend, x.device, x.dtype):
            plan = pad_plan(plan, plan_buckets(plan.counts))
            layout = dataclasses.replace(plan.layout, row_weight=row_weights(topk_weight, plan))
            return permute(x, plan), layout, LocalDispatchState(plan, None)
        return permute(x, plan), plan.counts, LocalDispatchState(plan, topk_weight)

    def combine(self, y_sorted: Tensor, state: LocalDispatchState) -> Tensor:
        """y_sorted (in dispatch's layout) -> y [N,H] = sum_k weight[n,k] * (output of token n's k-th expert).

        On accelerators a gather back to (token, slot) order and a weighted sum over the K slots
        instead of a scatter-add: no atomics, so the forward is deterministic on GPUs too. On CPU
        the experts already applied the weights (padded layout) and this is a serial scatter-add.
        """
        return unpermute(y_sorted, state.plan, state.topk_weight)
