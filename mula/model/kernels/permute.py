"""Token permutation for MoE: gather tokens into expert order and combine weighted expert outputs back.

`plan_routing` sorts the N*K (token, slot) assignments by expert once (stable argsort, counts by
scatter-add: no loop over experts, no host sync) into a `RoutingPlan`. `permute` and `unpermute` are
autograd functions whose forward and backward are gathers on accelerators (never scatter-adds, so
no atomics and deterministic results): the backward of the permutation is a gather-sum over each
token's K rows, and the backward of the weighted combine is a row gather plus one dot product per
assignment for the weight gradient. On CPU the unweighted sums are a serial scatter-add instead
(deterministic there, and no [N,K,H] temporary).

Where the experts' MLP runs on the CPU's bucketed padded layout (`mula.model.kernels.padded`), the plan
puts its rows in that layout (so `permute` writes the experts' input directly, with no pad/unpad
copies) and carries each row's combine weight for the experts to apply; `unpermute` then sums.
Callers see the same plan -> permute -> grouped_swiglu -> unpermute on every device.

Implementations: Triton kernels on CUDA/XPU (one program per row block, fp32 accumulation), and
vectorised torch ops (index_select, index_add, a [N,K,H] view, bmm) everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from mula.model.config import check_backend_name
from mula.model.kernels import padded
from mula.model.kernels.backends import resolve_backend, triton_available
from mula.model.kernels.padded import BucketLayout, sorted_to_padded


@dataclass
class RoutingPlan:
    """Where every (token, slot) assignment goes in the experts' row order; built by `plan_routing`.

    Opaque to callers except `counts`: `permute`, `grouped_swiglu` and `unpermute` read the rest.
    """

    order: Tensor  # [rows] long: expert row -> flat assignment index n*K + k
    unsort: Tensor  # [M] long: flat assignment index -> expert row
    token: Tensor  # [rows] long: expert row -> token n
    counts: Tensor  # [E] long: assignments per expert (sums to M = N*K)
    top_k: int
    # CPU experts: rows are in this padded layout; padding rows have token N and order N*K.
    layout: BucketLayout | None = None
    # [N,K] combine weights `unpermute` applies (None: a plain sum, or the experts apply them).
    combine_weight: Tensor | None = None
    # [rows] combine weights the experts apply before their down projection (padded plans; padding
    # rows 0): they scale [rows, FFN] activations instead of [rows, hidden] outputs.
    row_weight: Tensor | None = None
    # A capacity plan (`mula.model.kernels.capacity`) drops assignments: `unsort` sends each dropped one
    # to row `rows` (one past the last), which every gather reads as a zero row.
    drops: bool = False

    @property
    def num_tokens(self) -> int:
        """N, the tokens the plan routes."""
        return self.unsort.numel() // max(self.top_k, 1)


def plan_routing(
    topk_idx: Tensor,
    num_experts: int,
    topk_weight: Tensor | None = None,
    *,
    backend: str = "auto",
    dtype: torch.dtype | None = None,
) -> RoutingPlan:
    """Sort the assignments of topk_idx [N,K] (expert ids) by expert, keeping token order within an expert.

    topk_weight [N,K]: the combine weights, carried by the plan (`unpermute` applies them). `backend`
    and `dtype` (the expert MLP's, and the dtype of the rows to move) let the plan lay the rows out the
    way that MLP runs fastest: on CPU with the `torch` backend, the bucketed padded layout with the
    combine weights folded into the experts. Without `dtype` the rows are plainly sorted by expert.
    """
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be [tokens, top_k], got shape {tuple(topk_idx.shape)}.")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_idx must hold integer expert ids, got {topk_idx.dtype}.")
    if topk_weight is not None and topk_weight.shape != topk_idx.shape:
        raise ValueError(f"topk_weight must be [tokens, top_k], got {tuple(topk_weight.shape)}.")
    top_k = topk_idx.shape[1]
    flat = topk_idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    plan = RoutingPlan(order, unsort, order // max(top_k, 1), counts, top_k)
    if dtype is not None and experts_run_padded(backend, topk_idx.device, dtype):
        plan = _pad_plan(plan, padded.plan_buckets(counts))
        if topk_weight is not None:
            plan.row_weight = fold_weights(topk_weight, plan)
        return plan
    plan.combine_weight = topk_weight
    return plan


def fold_weights(weight: Tensor, plan: RoutingPlan) -> Tensor:
    """[rows]: the combine weight of each of a padded plan's rows (padding rows 0), from weight [N,K],
    differentiable: what `RoutingPlan.row_weight` holds when the experts apply the weights."""
    return _RowWeights.apply(weight, plan.order, plan.unsort)


def experts_run_padded(backend: str, device: torch.device, dtype: torch.dtype) -> bool:
    """True when `grouped_swiglu` for this backend/device/dtype runs on the bucketed padded layout
    (and `plan_routing` then folds the combine weights into the experts)."""
    return device.type in padded.DEVICES and resolve_backend(backend, device, dtype) == "torch"


def _pad_plan(plan: RoutingPlan, layout: BucketLayout) -> RoutingPlan:
    """The same routing with rows in `layout`'s padded order (zero rows after each expert's tokens)."""
    n = plan.num_tokens
    index = sorted_to_padded(layout)
    token = torch.full((layout.rows,), n, dtype=torch.long).index_copy_(0, index, plan.token)
    order = torch.full((layout.rows,), plan.unsort.numel(), dtype=torch.long).index_copy_(
        0, index, plan.order
    )
    return RoutingPlan(order, index[plan.unsort], token, plan.counts, plan.top_k, layout)


def _with_zero_row(t: Tensor) -> Tensor:
    """t with one zero row (or element) appended: the source of every padding row."""
    return torch.cat((t, t.new_zeros(1, *t.shape[1:])))


def _use_triton(t: Tensor, backend: str) -> bool:
    check_backend_name(backend)
    if backend == "triton":
        if not triton_available(t.device):
            raise ValueError(f"Permutation backend 'triton' cannot run on {t.device.type} here; use 'auto'.")
        return True
    return backend == "auto" and t.device.type in ("cuda", "xpu") and triton_available(t.device)


def _use_triton_for(t: Tensor, plan: RoutingPlan, backend: str) -> bool:
    """Triton's kernels know no padding rows: padded plans (CPU) take the torch path."""
    use = _use_triton(t, backend)
    if use and plan.layout is not None:
        if backend == "triton":
            raise ValueError("Permutation backend 'triton' does not take padded routing plans; use 'auto'.")
        return False
    return use


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, plan: RoutingPlan, use_triton: bool) -> Tensor:
        ctx.plan, ctx.use_triton = plan, use_triton
        if use_triton:
            from mula.model.kernels import triton_permute

            return triton_permute.gather_rows(x, plan.token)
        return (x if plan.layout is None else _with_zero_row(x)).index_select(0, plan.token)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, dxs: Tensor) -> tuple[Tensor | None, ...]:
        plan: RoutingPlan = ctx.plan
        return _gather_sum(dxs.contiguous(), plan, None, ctx.use_triton), None, None


def _gather_sum(ys: Tensor, plan: RoutingPlan, weight: Tensor | None, use_triton: bool) -> Tensor:
    """out[n] = sum_k weight[n,k] * ys[unsort[n*K+k]] (weight None -> plain sum)."""
    if use_triton:
        from mula.model.kernels import triton_permute

        return triton_permute.gather_sum(ys, plan.unsort, weight, plan.top_k)
    if weight is None and ys.device.type == "cpu":
        # CPU: scatter-add into the tokens, no [N,K,H] temporary (serial there, so deterministic;
        # on GPUs it would take atomics). Padding rows (token N) land in a sink row that is dropped.
        n = plan.num_tokens
        sink = int(plan.layout is not None)
        return ys.new_zeros(n + sink, ys.shape[1]).index_add_(0, plan.token, ys)[:n]
    gathered = _gather_slots(ys, plan)
    if weight is None:
        return gathered.sum(1)
    return torch.bmm(weight.to(ys.dtype).unsqueeze(1), gathered).squeeze(1)


def _gather_slots(ys: Tensor, plan: RoutingPlan) -> Tensor:
    """[N, K, H]: the sorted rows of every token's K assignments, in (token, slot) order."""
    n = plan.num_tokens
    rows = _with_zero_row(ys) if plan.drops else ys
    return rows.index_select(0, plan.unsort).view(n, plan.top_k, ys.shape[1])


class _RowWeights(torch.autograd.Function):
    """weight [N,K] -> [rows]: each padded row's combine weight (padding rows 0), differentiable."""

    @staticmethod
    def forward(ctx: FunctionCtx, weight: Tensor, order: Tensor, unsort: Tensor) -> Tensor:
        # the index tensors, not the plan: the plan keeps this function's output (no reference cycle)
        ctx.unsort, ctx.shape = unsort, weight.shape
        return _with_zero_row(weight.reshape(-1)).index_select(0, order)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, d_rows: Tensor) -> tuple[Tensor | None, ...]:
        # the appended zero: a dropped assignment (unsort = rows, see RoutingPlan.drops) gets no gradient
        return _with_zero_row(d_rows).index_select(0, ctx.unsort).view(ctx.shape), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, ys: Tensor, weight: Tensor | None, plan: RoutingPlan, use_triton: bool
    ) -> Tensor:
        ctx.plan, ctx.use_triton = plan, use_triton
        ys = ys.contiguous()
        if use_triton or weight is None:
            ctx.save_for_backward(ys if weight is not None else None, weight)  # ys: for d_weight only
            return _gather_sum(ys, plan, weight, use_triton)
        # torch path: keep the gathered [N,K,H] rows for the weight gradient (no second gather)
        gathered = _gather_slots(ys, plan)
        ctx.save_for_backward(gathered, weight)
        with torch.autocast(ys.device.type, enabled=False):  # in the rows' dtype, as the kernels do
            return torch.bmm(weight.to(ys.dtype).unsqueeze(1), gathered).squeeze(1)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, dy: Tensor) -> tuple[Tensor | None, ...]:
        plan: RoutingPlan = ctx.plan
        saved, weight = ctx.saved_tensors
        dy = dy.contiguous()
        need_ys, need_w = ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]
        d_ys = d_w = None
        if ctx.use_triton:
            from mula.model.kernels import triton_permute

            if need_ys:
                scale = weight.reshape(-1)[plan.order] if weight is not None else None
                d_ys = triton_permute.gather_rows(dy, plan.token, scale)
            if need_w:
                d_w = triton_permute.gather_dot(dy, saved, plan.unsort, plan.top_k).view_as(weight)
        else:
            if need_ys:
                padded = plan.layout is not None
                d_ys = (_with_zero_row(dy) if padded else dy).index_select(0, plan.token)
                if weight is not None:
                    w = weight.reshape(-1).to(dy.dtype)
                    d_ys.mul_((_with_zero_row(w) if padded else w)[plan.order].unsqueeze(1))
            if need_w:
                d_w = torch.linalg.vecdot(saved, dy.unsqueeze(1))
        if d_w is not None:
            d_w = d_w.to(weight.dtype)
        return d_ys, d_w, None, None


def permute(x: Tensor, plan: RoutingPlan, backend: str = "auto") -> Tensor:
    """x [N,H] -> x_sorted [N*K,H]: row r is token plan.token[r] (grouped by expert, ascending ids)."""
    if x.dim() != 2 or x.shape[0] * plan.top_k != plan.unsort.numel():
        raise ValueError(
            f"permute expects x [tokens, hidden] with tokens * top_k = {plan.unsort.numel()}, got {tuple(x.shape)}."
        )
    return _Permute.apply(x, plan, _use_triton_for(x, plan, backend))


def unpermute(
    y_sorted: Tensor, plan: RoutingPlan, weight: Tensor | None = None, backend: str = "auto"
) -> Tensor:
    """y_sorted (the plan's rows) -> y [N,H] = sum_k weight[n,k] * y_sorted[row of (n,k)].

    The weights are the plan's own (`plan_routing`'s topk_weight, unless the experts applied them),
    or `weight` [N,K] for a plan built without them; no weights at all is a plain sum.
    """
    if y_sorted.dim() != 2 or y_sorted.shape[0] != plan.order.numel():
        raise ValueError(
            f"unpermute expects y_sorted [{plan.order.numel()}, hidden], got {tuple(y_sorted.shape)}."
        )
    if weight is None:
        weight = plan.combine_weight
    elif plan.combine_weight is not None or plan.row_weight is not None:
        raise ValueError("unpermute: this plan carries its combine weights; pass no weight.")
    elif tuple(weight.shape) != (plan.num_tokens, plan.top_k):
        raise ValueError(f"unpermute weight must be [tokens, top_k], got {tuple(weight.shape)}.")
    return _Unpermute.apply(y_sorted, weight, plan, _use_triton_for(y_sorted, plan, backend))
