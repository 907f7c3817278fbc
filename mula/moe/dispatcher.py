"""Token dispatchers: group the (token, expert) assignments by expert and back.

`LocalDispatcher` is the single-device one; the expert-parallel strategy swaps in an all-to-all
dispatcher with the same two methods, so the MoE layer never knows where its experts live.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from mula.kernels import RoutingPlan, permute, plan_routing, unpermute


@dataclass
class LocalDispatchState:
    """What `combine` needs to undo a `dispatch`."""

    plan: RoutingPlan  # the sort of (token, slot) assignments by expert
    topk_weight: Tensor  # [N, K] combine weights


class LocalDispatcher:
    """Groups assignments by expert with one stable sort (no loop over experts, no host sync).

    A plain object rather than an `nn.Module`: it holds no state, and the strategy can replace
    `MoELayer.dispatcher` with any object that has the same `dispatch`/`combine` methods. The
    gathers run as fused kernels on GPUs and vectorised torch ops elsewhere (`mula.kernels.permute`).
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weight: Tensor) -> tuple[Tensor, Tensor, LocalDispatchState]:
        """x [N,H], topk_idx [N,K], topk_weight [N,K] -> (x_sorted [N*K,H], tokens per expert [E], state).

        Rows of `x_sorted` are grouped by expert in increasing expert id; within an expert they keep
        token order (stable sort), which makes the result deterministic.
        """
        plan = plan_routing(topk_idx, self.num_experts)
        return permute(x, plan), plan.counts, LocalDispatchState(plan, topk_weight)

    def combine(self, y_sorted: Tensor, state: LocalDispatchState) -> Tensor:
        """y_sorted [N*K,H] -> y [N,H] = sum_k weight[n,k] * (output of token n's k-th expert).

        A gather back to (token, slot) order and a weighted sum over the K slots instead of a
        scatter-add: no atomics, so the forward is deterministic on GPUs too.
        """
        return unpermute(y_sorted, state.plan, state.topk_weight)
