"""Expert-computation kernels: grouped GEMM, fused grouped SwiGLU MLP, token permutation.

Entry points (rows of `x` sorted by expert, `counts` [E] long tokens per expert summing to T):
  grouped_mm(x [T,K], w [E,N,K], counts, backend="auto") -> [T,N]          y_e = x_e @ w[e].T
  grouped_swiglu(x [T,H], gate_up [E,2I,H], down [E,H,I], grouping, backend="auto") -> [T,H]
                                                  y_e = (silu(x_e @ gate.T) * (x_e @ up.T)) @ down[e].T
  plan_routing / permute / unpermute                 see `mula.model.kernels.permute`
The MoE data path is plan_routing -> permute -> grouped_swiglu(x, ..., plan) -> unpermute on every
device: the `RoutingPlan` decides the rows' layout (on CPU the bucketed padded one of
`mula.model.kernels.padded`), and the experts follow it. `grouped_swiglu` also takes plain counts
(an `ExpertGrouping` is either) for rows that arrive already sorted, e.g. from an all-to-all.
Backends: "auto", "triton", "torch", "loop" (reference); see `mula.model.kernels.backends` for the choice.
All are differentiable in x and the weights. Under autocast the products run in the autocast dtype.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from mula.host_sync import CPU_EXPERT_KERNEL, host_syncs_excluded, to_host
from mula.model.config import BACKENDS
from mula.model.kernels import padded
from mula.model.kernels.autograd import GroupedMM, GroupedSwiGLU, PaddedSwiGLU
from mula.model.kernels.backends import grouped_ops, resolve_backend
from mula.model.kernels.permute import RoutingPlan, permute, plan_routing, unpermute

__all__ = [
    "BACKENDS",
    "ExpertGrouping",
    "RoutingPlan",
    "grouped_mm",
    "grouped_swiglu",
    "loop_grouped_mm",
    "permute",
    "plan_routing",
    "resolve_backend",
    "unpermute",
]

# The reason the loop reference backend's host read of the split sizes is counted under (`to_host`).
LOOP_SPLITS = "loop expert backend splits"

# How the experts' input rows are grouped: per-expert row counts [E] (rows sorted by expert), or the
# `RoutingPlan` whose `permute` wrote them (in whatever layout the plan chose).
ExpertGrouping = Tensor | RoutingPlan


def _check(
    x: Tensor, weights: tuple[Tensor, ...], counts: Tensor, what: str, padded_rows: bool = False
) -> None:
    """One clear sentence for each kind of bad input (no host sync on accelerators)."""
    if x.dim() != 2:
        raise ValueError(f"{what}: x must be [tokens, features], got shape {tuple(x.shape)}.")
    for w in weights:
        if w.dim() != 3:
            raise ValueError(
                f"{what}: expert weights must be [experts, out, in], got shape {tuple(w.shape)}."
            )
        if w.shape[0] != counts.numel():
            raise ValueError(f"{what}: {w.shape[0]} experts in the weights but {counts.numel()} counts.")
        if w.device != x.device:
            raise ValueError(f"{what}: x is on {x.device} but the expert weights are on {w.device}.")
        if w.dtype != x.dtype:
            raise ValueError(
                f"{what}: x is {x.dtype} but the expert weights are {w.dtype}; cast one of them."
            )
    if counts.dim() != 1 or counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{what}: counts must be a 1-D integer tensor, got {counts.dtype} {tuple(counts.shape)}."
        )
    if counts.device != x.device:
        raise ValueError(f"{what}: counts are on {counts.device} but x is on {x.device}.")
    # free on CPU, skipped on GPUs (a host sync) and for padded rows (counts then cover fewer rows)
    if x.device.type == "cpu" and not padded_rows:
        with host_syncs_excluded(CPU_EXPERT_KERNEL):
            total = int(counts.sum())
        if total != x.shape[0]:
            raise ValueError(f"{what}: counts sum to {total} but x has {x.shape[0]} rows.")


def _autocast(x: Tensor, *weights: Tensor) -> tuple[Tensor, ...]:
    """Cast inputs to the autocast dtype when autocast is on (our kernels are not autocast ops)."""
    dev = x.device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        return tuple(t.to(dtype) for t in (x, *weights))
    return (x, *weights)


def _no_autocast(x: Tensor) -> contextlib.AbstractContextManager:
    """Run our ops with autocast off (inputs were cast already)."""
    dev = x.device.type
    return (
        torch.autocast(dev, enabled=False)
        if torch.amp.is_autocast_available(dev)
        else contextlib.nullcontext()
    )


def loop_grouped_mm(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """Reference: one matmul per expert, gradients by plain autograd (one host sync for the split sizes)."""
    splits = to_host(counts, LOOP_SPLITS).tolist()
    outs = [xe @ w[e].t() for e, xe in enumerate(torch.split(x, splits, dim=0))]
    return torch.cat(outs, dim=0) if outs else x.new_empty(0, w.shape[1])


def grouped_mm(x: Tensor, w: Tensor, counts: Tensor, backend: str = "auto") -> Tensor:
    """Grouped matmul: rows of `x` sorted by expert; y[rows of e] = x[rows of e] @ w[e].T.

    x: [T, K]; w: [E, N, K] (stored as [out, in], like nn.Linear); counts: [E] int tokens per expert,
    summing to T. Returns [T, N]. `backend` is one of BACKENDS ("auto" picks per device and dtype).
    """
    _check(x, (w,), counts, "grouped_mm")
    if x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_mm: x has {x.shape[1]} features but the weights expect {w.shape[2]}.")
    x, w = _autocast(x, w)
    name = resolve_backend(backend, x.device, x.dtype)
    with _no_autocast(x):
        if name == "loop":
            return loop_grouped_mm(x, w, counts)
        return GroupedMM.apply(x, w, counts, grouped_ops(name))


def _loop_swiglu(
    x: Tensor, gate_up: Tensor, down: Tensor, counts: Tensor, row_weight: Tensor | None
) -> Tensor:
    gate, up = loop_grouped_mm(x, gate_up, counts).chunk(2, dim=-1)
    a = torch.nn.functional.silu(gate) * up
    return loop_grouped_mm(a if row_weight is None else a * row_weight.unsqueeze(1), down, counts)


def grouped_swiglu(
    x: Tensor, gate_up: Tensor, down: Tensor, grouping: ExpertGrouping, backend: str = "auto"
) -> Tensor:
    """The grouped SwiGLU expert MLP on rows grouped by expert.

    x [T,H]; gate_up [E,2I,H] (gate rows first, then up); down [E,H,I]; grouping: counts [E] for rows
    sorted by expert, or the `RoutingPlan` whose `permute` produced x. Returns [T,H], in x's layout.
    A plan that laid the rows out padded (CPU) may also carry the router's combine weights: each row's
    activation is then scaled before the down projection, y = (w * silu(gate) * up) @ down.T.
    The `triton` backend fuses SwiGLU into the gate+up GEMM (forward) and into the down-projection's
    dX GEMM (backward); `torch` runs each projection as a few batched GEMMs over bucketed padded
    experts on CPU (`mula.model.kernels.padded`) and as single grouped GEMMs elsewhere.
    """
    plan = grouping if isinstance(grouping, RoutingPlan) else None
    counts = grouping if plan is None else plan.counts
    layout = None if plan is None else plan.layout
    if layout is not None and (x.dim() != 2 or x.shape[0] != layout.rows):
        raise ValueError(
            f"grouped_swiglu: x must be [{layout.rows}, hidden] in the plan's padded layout, got {tuple(x.shape)}."
        )
    _check(x, (gate_up, down), counts, "grouped_swiglu", padded_rows=layout is not None)
    e, two_i, h = gate_up.shape
    if two_i % 2 or x.shape[1] != h or tuple(down.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"grouped_swiglu: expected gate_up [E,2I,{x.shape[1]}] and down [E,{x.shape[1]},I], "
            f"got {tuple(gate_up.shape)} and {tuple(down.shape)}."
        )
    x, gate_up, down = _autocast(x, gate_up, down)
    name = resolve_backend(backend, x.device, x.dtype)
    with _no_autocast(x):
        if layout is not None:
            row_weight = plan.row_weight
            if row_weight is not None:
                row_weight = row_weight.to(x.dtype)
            if name == "loop":  # reference: back to sorted rows, loop, and into the layout again
                index = padded.sorted_to_padded(layout)
                w = None if row_weight is None else row_weight.index_select(0, index)
                y = _loop_swiglu(x.index_select(0, index), gate_up, down, counts, w)
                return padded.pad(y, index, layout.rows)
            return PaddedSwiGLU.apply(x, gate_up, down, row_weight, layout)
        if name == "loop":
            return _loop_swiglu(x, gate_up, down, counts, None)
        if name == "torch" and x.device.type in padded.DEVICES:
            layout = padded.plan_buckets(counts)
            index = padded.sorted_to_padded(layout)
            y = PaddedSwiGLU.apply(padded.pad(x, index, layout.rows), gate_up, down, None, layout)
            return y.index_select(0, index)
        return GroupedSwiGLU.apply(x, gate_up, down, counts, grouped_ops(name))
