"""CPU expert MLP on a bucketed, padded layout: each projection is a few batched GEMMs (`torch.bmm`).

Why: on CPU, torch's grouped GEMM runs one BLAS call per expert and each call has fixed costs
(packing, a threading fork/join; in 16-bit also a oneDNN call overhead and a per-shape JIT kernel:
oneDNN's kernel cache is bounded, and a grouped GEMM has one shape per expert row count, so a model
with a few MoE layers recompiles on every call). One batched GEMM over experts padded to a common
row count avoids them, but routing is uneven (the fullest expert often has twice the rows of the
emptiest), so one capacity for all experts wastes a large share of the rows.

So experts are sorted by row count and cut into buckets of similar counts; each bucket is padded to
its own largest count and runs as one batched GEMM per product on weights gathered in bucket order.
The waste drops to a few percent, for a handful of GEMM calls per projection instead of one per
expert. Bucket sizes are multiples of the thread count (a batched GEMM splits its batch over the
threads, so a partial last round leaves threads idle). Padding rows are zero, so they add nothing
to any product or gradient. `plan_buckets` picks the cut per call from the host-side counts (free
on CPU) with a small cost model; skewed routing (one expert with all rows) ends up in a bucket of
one expert, i.e. a plain GEMM, so there is no slow case. docs/benchmarks.md (moe_layer) has the
measurements behind these choices. Those host reads are the CPU's alone (a GPU's grouped GEMM takes the
counts on the device): they run under `mula.host_sync.host_syncs_excluded(CPU_EXPERT_KERNEL)`, which the
host-sync meter counts apart from the step's syncs.

The whole MLP (gate, up, SwiGLU, down, and the backward products) runs one bucket at a time. The
routing plan puts the permuted rows straight into the layout (`mula.model.kernels.permute.plan_routing`),
and the combine weights can ride along (`RoutingPlan.row_weight`): the experts scale their
[rows, FFN] activations, and the combine becomes a plain sum, instead of scaling [rows, hidden]
outputs and keeping an [N, K, hidden] copy for the weight gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mula.host_sync import CPU_EXPERT_KERNEL, host_syncs_excluded, to_host

# Cost model, in padded-row units (one row of the three expert GEMMs): every extra bucket costs a
# batched-GEMM call per product (8 per step) and its elementwise ops. Measured, not derived: a broad
# range of values performs alike (docs/benchmarks.md, moe_layer), so the exact value matters little.
CALL_COST_ROWS = 64.0
# Devices whose expert MLP runs on this layout (the torch backend elsewhere uses grouped GEMMs).
DEVICES = ("cpu",)
TOLERANCES = (0.0, 0.03, 0.06, 0.1, 0.15, 0.25, 0.4, 0.7, 1.0)


@dataclass
class BucketLayout:
    """Experts in `order` (sorted by count), cut into buckets; rows of bucket b form [n_b, C_b, D].

    buckets: (first position in `order`, number of experts, capacity C, first row) per bucket.
    expert_row: [E] long, first padded row of each expert (by expert id).
    """

    order: Tensor  # [E] long: bucket position -> expert id
    buckets: list[tuple[int, int, int, int]]
    expert_row: Tensor  # [E] long
    counts: Tensor  # [E] long, real rows per expert (by id)
    rows: int  # total padded rows
    identity: bool  # order is 0..E-1 (no weight gathers)

    @property
    def num_experts(self) -> int:
        return self.order.numel()


def _cut(sorted_counts: list[int], tol: float, step: int) -> list[tuple[int, int]]:
    """Greedy cut of descending counts into buckets of `step`-multiples of experts (the last may be
    shorter): a bucket ends where a count falls below (1-tol) x its capacity. Experts with no rows
    are left out. `step` is the thread count: a batched GEMM splits its batch over the threads, so a
    batch that is not a multiple of them leaves threads idle (a partial round costs a full one)."""
    end = next((i for i, c in enumerate(sorted_counts) if c == 0), len(sorted_counts))
    cuts, start = [], 0
    for i in range(step, end, step):
        if sorted_counts[i] < (1.0 - tol) * sorted_counts[start]:
            cuts.append((start, i))
            start = i
    if end > start:
        cuts.append((start, end))
    return cuts


def plan_buckets(counts: Tensor, single: bool = False) -> BucketLayout:
    """The cheapest bucketed layout for these per-expert row counts ([E] long, on the CPU).

    `single` forces one bucket padded to the largest count in expert-id order (no weight gathers).
    """
    with host_syncs_excluded(CPU_EXPERT_KERNEL):  # CPU only: GPUs run grouped GEMMs on device counts
        host = to_host(counts, CPU_EXPERT_KERNEL).tolist()
    num_experts = len(host)
    cap = max(host, default=0)
    # one bucket over all experts in id order: no sort, no weight gather
    best = (num_experts * cap + CALL_COST_ROWS, None)
    if not single and num_experts > 1:
        order = sorted(range(num_experts), key=lambda e: -host[e])
        desc = [host[e] for e in order]
        step = max(1, torch.get_num_threads())
        for tol in TOLERANCES:
            cuts = _cut(desc, tol, step)
            cost = sum((b - a) * desc[a] for a, b in cuts) + CALL_COST_ROWS * (len(cuts) + 1)  # +1: gathers
            if cost < best[0]:
                best = (cost, (order, cuts, desc))
    if best[1] is None:
        order = list(range(num_experts))
        buckets = [(0, num_experts, cap, 0)] if cap > 0 else []
        identity = True
    else:
        order, cuts, desc = best[1]
        buckets, row = [], 0
        for a, b in cuts:
            buckets.append((a, b - a, desc[a], row))
            row += (b - a) * desc[a]
        identity = order == list(range(num_experts))
    end = sum(n * c for _, n, c, _ in buckets)
    expert_row = [end] * num_experts  # experts outside every bucket have no rows
    for first, n, c, row in buckets:
        for j in range(n):
            expert_row[order[first + j]] = row + j * c
    return BucketLayout(
        torch.tensor(order, dtype=torch.long),
        buckets,
        torch.tensor(expert_row, dtype=torch.long),
        counts.long(),
        end,
        identity,
    )


def sorted_to_padded(layout: BucketLayout) -> Tensor:
    """[T] long: row r of the expert-sorted (id order, no padding) rows -> its padded row."""
    counts = layout.counts
    with host_syncs_excluded(CPU_EXPERT_KERNEL):  # CPU only (the padded layout is the CPU kernel's)
        total = int(counts.sum())
    starts = torch.cumsum(counts, 0) - counts
    shift = layout.expert_row - starts
    return torch.arange(total, dtype=torch.long) + shift.repeat_interleave(counts, output_size=total)


def pad(t: Tensor, index: Tensor, rows: int) -> Tensor:
    """[T, D] expert-sorted rows -> [rows, D] with zeros in the padding rows (`index` from sorted_to_padded)."""
    out = t.new_zeros(rows, t.shape[1])
    return out.index_copy_(0, index, t)


def _in_order(w: Tensor, layout: BucketLayout) -> Tensor:
    return w if layout.identity else w.index_select(0, layout.order)


def _to_ids(layout: BucketLayout, *parts: Tensor) -> Tensor:
    """Weight gradients in bucket order -> expert-id order, the parts concatenated along dim 1 (one
    copy in all: written straight into the halves of the result)."""
    if layout.identity:
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    out = parts[0].new_empty(parts[0].shape[0], sum(p.shape[1] for p in parts), *parts[0].shape[2:])
    start = 0
    for p in parts:
        out[:, start : start + p.shape[1]].index_copy_(0, layout.order, p)
        start += p.shape[1]
    return out


def swiglu_forward(
    x: Tensor, gate_up: Tensor, down: Tensor, row_weight: Tensor | None, layout: BucketLayout
) -> tuple[Tensor, tuple]:
    """y [rows, H] for padded x [rows, H] (rows scaled by `row_weight` before the down projection),
    and the tensors the backward needs.

    The whole MLP runs one bucket at a time, so each bucket's intermediates are still in cache for
    the next product (whole-tensor passes made every product read its input back from memory).
    """
    inter, h = down.shape[2], down.shape[1]
    gate_w, up_w = _in_order(gate_up[:, :inter], layout), _in_order(gate_up[:, inter:], layout)
    down_w = _in_order(down, layout)
    gate, up, y = (
        x.new_empty(layout.rows, inter),
        x.new_empty(layout.rows, inter),
        x.new_empty(layout.rows, h),
    )
    for first, n, c, row in layout.buckets:
        sl, ws = slice(row, row + n * c), slice(first, first + n)
        xb = x[sl].view(n, c, h)
        g = torch.bmm(xb, gate_w[ws].transpose(1, 2), out=gate[sl].view(n, c, inter))
        u = torch.bmm(xb, up_w[ws].transpose(1, 2), out=up[sl].view(n, c, inter))
        a = F.silu(g).mul_(u)
        if row_weight is not None:
            a.mul_(row_weight[sl].view(n, c, 1))
        torch.bmm(a, down_w[ws].transpose(1, 2), out=y[sl].view(n, c, h))
    # the weights in bucket order are kept, so the backward needs no second gather
    return y, (x, gate, up, row_weight, gate_w, up_w, down_w)


def swiglu_backward(
    dy: Tensor, saved: tuple[Tensor, ...], layout: BucketLayout, needs: tuple[bool, ...]
) -> tuple[Tensor | None, ...]:
    """(dx [rows,H], d_gate_up [E,2I,H], d_down [E,H,I], d_row_weight [rows]) for `swiglu_forward`,
    one bucket at a time; `needs` says which of the four are wanted."""
    x, gate, up, row_weight, gate_w, up_w, down_w = saved
    inter, h = down_w.shape[2], down_w.shape[1]
    num_experts = layout.num_experts
    # experts outside every bucket (no rows) keep zero weight gradients
    d_down = x.new_zeros(num_experts, h, inter) if needs[2] else None
    # gate and up gradients apart: a batched GEMM into a strided half would go through a temporary
    d_gate = x.new_zeros(num_experts, inter, h) if needs[1] else None
    d_up = x.new_zeros(num_experts, inter, h) if needs[1] else None
    dx = x.new_empty(layout.rows, h) if needs[0] else None
    d_row = x.new_empty(layout.rows) if row_weight is not None and needs[3] else None
    for first, n, c, row in layout.buckets:
        sl, ws = slice(row, row + n * c), slice(first, first + n)
        dyb, xb = dy[sl].view(n, c, h), x[sl].view(n, c, h)
        g, u = gate[sl].view(n, c, inter), up[sl].view(n, c, inter)
        da = torch.bmm(dyb, down_w[ws])
        # SwiGLU backward; a = silu(gate) * up is recomputed, not saved
        s = F.silu(g)
        a = s * u
        if row_weight is not None:
            wb = row_weight[sl].view(n, c, 1)
            if d_row is not None:
                torch.linalg.vecdot(da, a, out=d_row[sl].view(n, c))
            da.mul_(wb)
            a.mul_(wb)
        dup = da * s
        dgate = torch.ops.aten.silu_backward(da.mul_(u), g)
        if d_down is not None:
            torch.bmm(dyb.transpose(1, 2), a, out=d_down[ws])
        if d_gate is not None:
            torch.bmm(dgate.transpose(1, 2), xb, out=d_gate[ws])
            torch.bmm(dup.transpose(1, 2), xb, out=d_up[ws])
        if dx is not None:
            torch.bmm(dgate, gate_w[ws], out=dx[sl].view(n, c, h)).baddbmm_(dup, up_w[ws])
    d_down = _to_ids(layout, d_down) if d_down is not None else None
    d_gate_up = _to_ids(layout, d_gate, d_up) if d_gate is not None else None
    return dx, d_gate_up, d_down, d_row
