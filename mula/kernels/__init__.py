"""Expert-computation kernels: grouped GEMM, fused grouped SwiGLU MLP, token permutation.

Entry points (rows of `x` sorted by expert, `counts` [E] long tokens per expert summing to T):
  grouped_mm(x [T,K], w [E,N,K], counts, backend="auto") -> [T,N]          y_e = x_e @ w[e].T
  grouped_swiglu(x [T,H], gate_up [E,2I,H], down [E,H,I], counts, backend="auto") -> [T,H]
                                                  y_e = (silu(x_e @ gate.T) * (x_e @ up.T)) @ down[e].T
  plan_routing / permute / unpermute                 see `mula.kernels.permute`
Backends: "auto", "triton", "torch", "loop" (reference); see `mula.kernels.backends` for the choice.
All are differentiable in x and the weights. Under autocast the products run in the autocast dtype.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from mula.kernels.autograd import GroupedMM, GroupedSwiGLU
from mula.kernels.backends import BACKENDS, grouped_ops, resolve_backend
from mula.kernels.permute import RoutingPlan, permute, plan_routing, unpermute

__all__ = [
    "BACKENDS",
    "RoutingPlan",
    "grouped_mm",
    "grouped_swiglu",
    "loop_grouped_mm",
    "permute",
    "plan_routing",
    "resolve_backend",
    "unpermute",
]


def _check(x: Tensor, weights: tuple[Tensor, ...], counts: Tensor, what: str) -> None:
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
    if x.device.type == "cpu" and int(counts.sum()) != x.shape[0]:  # free on CPU; skipped on GPUs (sync)
        raise ValueError(f"{what}: counts sum to {int(counts.sum())} but x has {x.shape[0]} rows.")


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
    outs = [xe @ w[e].t() for e, xe in enumerate(torch.split(x, counts.tolist(), dim=0))]
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


def grouped_swiglu(x: Tensor, gate_up: Tensor, down: Tensor, counts: Tensor, backend: str = "auto") -> Tensor:
    """The grouped SwiGLU expert MLP on rows sorted by expert.

    x [T,H]; gate_up [E,2I,H] (gate rows first, then up); down [E,H,I]; counts [E]. Returns [T,H].
    The `triton` backend fuses SwiGLU into the gate+up GEMM (forward) and into the down-projection's
    dX GEMM (backward); `torch` runs both projections as single grouped GEMMs with one saved tensor.
    """
    _check(x, (gate_up, down), counts, "grouped_swiglu")
    e, two_i, h = gate_up.shape
    if two_i % 2 or x.shape[1] != h or tuple(down.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"grouped_swiglu: expected gate_up [E,2I,{x.shape[1]}] and down [E,{x.shape[1]},I], "
            f"got {tuple(gate_up.shape)} and {tuple(down.shape)}."
        )
    x, gate_up, down = _autocast(x, gate_up, down)
    name = resolve_backend(backend, x.device, x.dtype)
    with _no_autocast(x):
        if name == "loop":
            gate, up = loop_grouped_mm(x, gate_up, counts).chunk(2, dim=-1)
            return loop_grouped_mm(torch.nn.functional.silu(gate) * up, down, counts)
        return GroupedSwiGLU.apply(x, gate_up, down, counts, grouped_ops(name))
