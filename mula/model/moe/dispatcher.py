"""Token dispatchers: group the (token, expert) assignments by expert and back.

`Dispatcher` is the contract between `MoELayer` and whoever moves its tokens: `LocalDispatcher` on
one device, the expert-parallel strategy's all-to-all dispatcher (`strategies.experts.all_to_all`) across
ranks. The layer only calls the two methods, so it never knows where its experts live.
"""

from __future__ import annotations

from typing import Protocol, TypeVar, runtime_checkable

from torch import Tensor

from mula.model.kernels import ExpertGrouping, RoutingPlan, permute, plan_routing, unpermute
from mula.model.kernels.capacity import Capacity, plan_capacity

StateT = TypeVar("StateT")


@runtime_checkable
class Dispatcher(Protocol[StateT]):
    """What an MoE layer's dispatcher does: a plain object (no parameters, no buffers), kept by
    `MoELayer.dispatcher` outside the module tree, so swapping it changes no state-dict key.

    dispatch(x [N,H], topk_idx [N,K], topk_weight [N,K]) -> (x_grouped, grouping, state):
        x_grouped holds the rows for this rank's experts, grouped by expert; grouping tells
        `mula.model.kernels.grouped_swiglu` how (per-expert counts, or the `RoutingPlan` that wrote them);
        state is whatever `combine` needs, opaque to the layer.
    combine(y_grouped, state) -> y [N,H]: y_n = sum_k topk_weight[n,k] * (expert output for (n,k)).
    """

    def dispatch(
        self, x: Tensor, topk_idx: Tensor, topk_weight: Tensor
    ) -> tuple[Tensor, ExpertGrouping, StateT]:
        """Group the rows of x by the experts of their top-k assignments."""
        ...

    def combine(self, y_grouped: Tensor, state: StateT) -> Tensor:
        """The expert outputs back in token order, weighted-summed over each token's K experts."""
        ...


@runtime_checkable
class MeteredDispatcher(Protocol):
    """A dispatcher that counts the bytes this rank sends in its exchanges (the all-to-all dispatcher):
    `callbacks.MoEMetrics` logs `bytes_sent` once per step as `moe/a2a_bytes` and sets it back to 0."""

    bytes_sent: int


class LocalDispatcher:
    """Groups assignments by expert with one stable sort (no loop over experts, no host sync).

    plan_routing -> permute, and unpermute to combine, on every device (`mula.model.kernels.permute`): the
    routing plan lays the rows out the way the experts' backend runs them and carries the combine
    weights, so this class makes no device-specific choice itself. The plan is also the state.
    With a `capacity` (`mula.model.kernels.capacity`) the plan caps every expert's rows and drops the rest.
    """

    def __init__(self, num_experts: int, backend: str = "auto", capacity: Capacity | None = None) -> None:
        self.num_experts = num_experts
        self.backend = backend
        self.capacity = capacity

    def __repr__(self) -> str:
        extra = "" if self.capacity is None else f", capacity={self.capacity}"
        return f"LocalDispatcher(num_experts={self.num_experts}, backend={self.backend!r}{extra})"

    def dispatch(
        self, x: Tensor, topk_idx: Tensor, topk_weight: Tensor
    ) -> tuple[Tensor, RoutingPlan, RoutingPlan]:
        """x [N,H], topk_idx [N,K], topk_weight [N,K] -> (x_grouped, plan, plan).

        Rows of `x_grouped` are grouped by expert in increasing expert id; within an expert they keep
        token order (stable sort), which makes the result deterministic. `plan.counts` holds the
        rows per expert; the plan may pad each expert's rows (CPU), so use it, not the counts, to
        run the experts. With a capacity, the rows are the capacity plan's [E, C] slots.
        """
        if self.capacity is not None:
            plan = plan_capacity(topk_idx, topk_weight, self.num_experts, self.capacity)
            return permute(x, plan), plan, plan
        plan = plan_routing(topk_idx, self.num_experts, topk_weight, backend=self.backend, dtype=x.dtype)
        return permute(x, plan), plan, plan

    def combine(self, y_grouped: Tensor, state: RoutingPlan) -> Tensor:
        """y_grouped (in dispatch's layout) -> y [N,H] = sum_k weight[n,k] * (output of token n's k-th expert).

        On accelerators a gather back to (token, slot) order and a weighted sum over the K slots
        instead of a scatter-add: no atomics, so the forward is deterministic on GPUs too.
        """
        return unpermute(y_grouped, state)
