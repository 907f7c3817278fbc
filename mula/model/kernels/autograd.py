"""Autograd for the grouped GEMM and the fused grouped SwiGLU MLP, written once over `GroupedOps`.

Backward products of y = x_e @ W_e.T: dX = dY_e @ W_e (the same grouped GEMM with W untransposed) and
dW_e = dY_e.T @ X_e (one grouped weight-gradient product over the token dimension). The fused MLP
saves only x and the gate/up pre-activations, and recomputes the activation in the backward.
`PaddedSwiGLU` is the same MLP on the CPU's bucketed padded layout (`mula.model.kernels.padded`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from mula.model.kernels import padded
from mula.model.kernels.backends import GroupedOps

# Devices whose elementwise kernels are slow on strided halves of a [T,2I] tensor (see swiglu_backward):
# there the gate and up projections run as two GEMMs producing contiguous outputs.
SPLIT_GATE_UP_DEVICES = ("cpu",)


def swiglu_backward(da: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """(dh = [dgate | dup] [T,2I], a = silu(gate) * up) from the gradient da of a.

    gate and up are separate contiguous tensors: elementwise kernels that read strided halves of a
    [T,2I] tensor are several times slower on CPU (no vectorised path), while writing the results
    into dh's halves costs little and lets the next products run as single [T,2I] GEMMs.
    """
    dh = torch.empty(*gate.shape[:-1], 2 * gate.shape[-1], dtype=gate.dtype, device=gate.device)
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


class PaddedSwiGLU(torch.autograd.Function):
    """The expert MLP on a bucketed padded layout (`mula.model.kernels.padded`): batched GEMMs per bucket."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: Tensor,
        gate_up: Tensor,
        down: Tensor,
        row_weight: Tensor | None,
        layout: padded.BucketLayout,
    ) -> Tensor:
        ctx.layout = layout
        y, saved = padded.swiglu_forward(x, gate_up, down, row_weight, layout)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, dy: Tensor) -> tuple[Tensor | None, ...]:
        grads = padded.swiglu_backward(
            dy.contiguous(), ctx.saved_tensors, ctx.layout, ctx.needs_input_grad[:4]
        )
        return (*grads, None)


class GroupedSwiGLU(torch.autograd.Function):
    """y = grouped_mm(silu(gate) * up, down) with [gate | up] = grouped_mm(x, gate_up): the expert MLP."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, x: Tensor, gate_up: Tensor, down: Tensor, counts: Tensor, ops: GroupedOps
    ) -> Tensor:
        ctx.ops = ops
        if ops.swiglu_fwd is not None:
            h, a = ops.swiglu_fwd(x, gate_up, counts)
            pre = (h,)
        elif x.device.type in SPLIT_GATE_UP_DEVICES:
            # Two GEMMs on the gate and up halves of the weights (views, no copy) give contiguous
            # pre-activations; see swiglu_backward for why that matters on CPU.
            inter = gate_up.shape[1] // 2
            gate = ops.fwd(x, gate_up[:, :inter], counts, False)
            up = ops.fwd(x, gate_up[:, inter:], counts, False)
            a = F.silu(gate).mul_(up)
            pre = (gate, up)
        else:  # accelerators read strided halves at full speed: one larger GEMM, fewer launches
            gate, up = ops.fwd(x, gate_up, counts, False).chunk(2, dim=-1)
            a = F.silu(gate).mul_(up)
            pre = (gate, up)
        ctx.save_for_backward(gate_up, down, counts, x, *pre)
        return ops.fwd(a, down, counts, False)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, dy: Tensor) -> tuple[Tensor | None, ...]:
        gate_up, down, counts, *saved = ctx.saved_tensors
        ops: GroupedOps = ctx.ops
        dy = dy.contiguous()
        needs = ctx.needs_input_grad[:3]
        x, *pre = saved
        if ops.swiglu_bwd is not None:
            dh, a = ops.swiglu_bwd(dy, down, pre[0], counts)
        else:
            dh, a = swiglu_backward(ops.fwd(dy, down, counts, True), *pre)
        d_down = ops.wgrad(dy, a, counts) if needs[2] else None
        del a
        d_gate_up = ops.wgrad(dh, x, counts) if needs[1] else None
        dx = ops.fwd(dh, gate_up, counts, True) if needs[0] else None
        return dx, d_gate_up, d_down, None, None
