"""Autograd for the grouped GEMM and the fused grouped SwiGLU MLP, written once over `GroupedOps`.

Backward products of y = x_e @ W_e.T: dX = dY_e @ W_e (the same grouped GEMM with W untransposed) and
dW_e = dY_e.T @ X_e (one grouped weight-gradient product over the token dimension). The fused MLP
saves only x and the gate/up pre-activations h, and recomputes the activation in the backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from mula.kernels.backends import GroupedOps


def swiglu(h: Tensor) -> Tensor:
    """a = silu(gate) * up for h = [gate | up] along the last dim (gate first)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def swiglu_backward(da: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    """(dh = [dgate | dup], a) from the gradient of a = silu(gate) * up; written straight into dh's halves."""
    gate, up = h.chunk(2, dim=-1)
    dh = torch.empty_like(h)
    dgate, dup = dh.chunk(2, dim=-1)
    silu = F.silu(gate)
    torch.mul(da, silu, out=dup)
    torch.ops.aten.silu_backward.grad_input(da * up, gate, grad_input=dgate)
    return dh, silu.mul_(up)


class GroupedMM(torch.autograd.Function):
    """y = grouped_mm(x, w, counts) with both backward products on the backend's kernels."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, w: Tensor, counts: Tensor, ops: GroupedOps) -> Tensor:
        ctx.save_for_backward(x, w, counts)
        ctx.ops = ops
        return ops.fwd(x, w, counts, False)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, w, counts = ctx.saved_tensors
        ops: GroupedOps = ctx.ops
        dy = dy.contiguous()  # expanded (stride-0) gradients break grouped kernels
        dx = ops.fwd(dy, w, counts, True) if ctx.needs_input_grad[0] else None
        dw = ops.wgrad(dy, x, counts) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


class GroupedSwiGLU(torch.autograd.Function):
    """y = grouped_mm(silu(gate) * up, down) with [gate | up] = grouped_mm(x, gate_up): the expert MLP."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, x: Tensor, gate_up: Tensor, down: Tensor, counts: Tensor, ops: GroupedOps
    ) -> Tensor:
        if ops.swiglu_fwd is not None:
            h, a = ops.swiglu_fwd(x, gate_up, counts)
        else:
            h = ops.fwd(x, gate_up, counts, False)
            a = swiglu(h)
        ctx.save_for_backward(x, gate_up, down, counts, h)
        ctx.ops = ops
        return ops.fwd(a, down, counts, False)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, gate_up, down, counts, h = ctx.saved_tensors
        ops: GroupedOps = ctx.ops
        dy = dy.contiguous()
        if ops.swiglu_bwd is not None:
            dh, a = ops.swiglu_bwd(dy, down, h, counts)
        else:
            dh, a = swiglu_backward(ops.fwd(dy, down, counts, True), h)
        d_down = ops.wgrad(dy, a, counts) if ctx.needs_input_grad[2] else None
        del a
        d_gate_up = ops.wgrad(dh, x, counts) if ctx.needs_input_grad[1] else None
        dx = ops.fwd(dh, gate_up, counts, True) if ctx.needs_input_grad[0] else None
        return dx, d_gate_up, d_down, None, None
