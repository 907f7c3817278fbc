"""Token dispatchers: group the (token, expert) assignments by expert and back.

`LocalDispatcher` is the single-device one; the expert-parallel strategy swaps in an all-to-all
dispatcher with the same two methods, so the MoE layer never knows where its experts live.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mula.moe.router import expert_counts


@dataclass
class LocalDispatchState:
    """What `combine` needs to undo a `dispatch`."""

    unsort: Tensor  # [N*K] position in the sorted rows of each (token, slot) assignment
    topk_weight: Tensor  # [N, K] combine weights


class LocalDispatcher:
    """Sorts assignments by expert with one stable argsort (no loop over experts, no host sync).

    A plain object rather than an `nn.Module`: it holds no state, and the strategy can replace
    `MoELayer.dispatcher` with any object that has the same `dispatch`/`combine` methods.
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(
        self, x: Tensor, topk_idx: Tensor, topk_weight: Tensor
    ) -> tuple[Tensor, Tensor, LocalDispatchState]:
        """x [N,H], topk_idx [N,K], topk_weight [N,K] -> (x_sorted [N*K,H], tokens per expert [E], state).

        Rows of `x_sorted` are grouped by expert in increasing expert id; within an expert they keep
        token order (stable sort), which makes the result deterministic.
        """
        k = topk_idx.shape[1]
        order = torch.argsort(topk_idx.reshape(-1), stable=True)  # [M] sorted row -> (token, slot)
        x_sorted = x.index_select(0, order // k)
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(order.numel(), device=order.device)
        counts = expert_counts(topk_idx, self.num_experts)
        return x_sorted, counts, LocalDispatchState(unsort, topk_weight)

    def combine(self, y_sorted: Tensor, state: LocalDispatchState) -> Tensor:
        """y_sorted [N*K,H] -> y [N,H] = sum_k weight[n,k] * (output of token n's k-th expert).

        A gather back to (token, slot) order plus a batched [1,K]x[K,H] product, instead of a
        scatter-add: no atomics, so the forward is deterministic on GPUs too.
        """
        n, k = state.topk_weight.shape
        y = y_sorted.index_select(0, state.unsort).view(n, k, -1)
        w = state.topk_weight.to(y.dtype).unsqueeze(1)  # [N,1,K]
        return torch.bmm(w, y).squeeze(1)
