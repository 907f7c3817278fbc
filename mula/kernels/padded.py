"""CPU expert MLP on a padded [E, C, D] layout, so each projection is one batched GEMM (`torch.bmm`).

Why: on CPU, torch's grouped GEMM runs one oneDNN call per expert. In bf16 each call costs ~15 us
of fixed overhead and the calls parallelise poorly over cores, so with 64 small experts a single
batched call over experts padded to the largest count C is up to ~2x faster even after the
wasted rows. The padding rows are zero, so they add nothing to any product or gradient.

A second reason in 16-bit: oneDNN JIT-compiles a kernel per GEMM shape and keeps 1024 of them; a
grouped GEMM has one shape per expert (its row count), so a model with a few MoE layers needs more
than the cache holds and recompiles on every call (measured: a 4-layer, 64-expert model spent
~45 ms per layer in expert GEMMs instead of ~7 ms). The padded path has a handful of shapes.

`plan_padding` decides per call from the real counts (free to read on CPU). 16-bit: padded while the
padding wastes at most MAX_WASTE_16BIT of the rows. fp32 (MKL, no per-shape JIT, ~5x less fixed
cost per call): padded while the wasted rows cost less than the per-expert calls they save,
waste <= BREAK_EVEN_FP32 / (mean rows per expert * hidden * ffn), calibrated on a 2-core
AVX-512 CPU. Anything else (GPUs, skewed routing such as all tokens on one expert) keeps the
grouped path, so there is no slow case.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

MAX_WASTE_16BIT = 1.0
MAX_WASTE_FP32 = 0.6
BREAK_EVEN_FP32 = 0.5e6  # rows*hidden*ffn per expert at which 100% padding waste pays off in fp32


@dataclass
class PaddedLayout:
    """Row r of the expert-sorted input lives at row `index[r]` of the [E*C, D] padded tensor."""

    num_experts: int
    capacity: int
    index: Tensor  # [T] long


def plan_padding(counts: Tensor, dtype: torch.dtype, hidden: int, ffn: int) -> PaddedLayout | None:
    """A padded layout when it pays on this CPU call, else None (use the grouped GEMM path)."""
    if counts.device.type != "cpu" or counts.numel() == 0 or not dtype.is_floating_point:
        return None
    host = counts.tolist()
    total, cap, num_experts = sum(host), max(host), len(host)
    if total == 0:
        return None
    if torch.empty((), dtype=dtype).element_size() <= 2:
        limit = MAX_WASTE_16BIT
    else:
        limit = min(MAX_WASTE_FP32, BREAK_EVEN_FP32 * num_experts / (total * hidden * ffn))
    if num_experts * cap > (1.0 + limit) * total:
        return None
    counts = counts.long()
    starts = torch.cumsum(counts, 0) - counts
    shift = torch.arange(num_experts, dtype=torch.long) * cap - starts
    index = torch.arange(total, dtype=torch.long) + shift.repeat_interleave(counts, output_size=total)
    return PaddedLayout(num_experts, cap, index)


def pad(t: Tensor, layout: PaddedLayout) -> Tensor:
    """[T, D] rows sorted by expert -> [E, C, D] with zero rows after each expert's tokens."""
    out = t.new_zeros(layout.num_experts * layout.capacity, t.shape[1])
    out.index_copy_(0, layout.index, t)
    return out.view(layout.num_experts, layout.capacity, t.shape[1])


def unpad(tp: Tensor, layout: PaddedLayout) -> Tensor:
    """Inverse of `pad`: [E, C, D] -> [T, D]."""
    return tp.reshape(-1, tp.shape[-1]).index_select(0, layout.index)


def swiglu_forward(
    x: Tensor, gate_up: Tensor, down: Tensor, layout: PaddedLayout
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """y [T,H] and the tensors the backward needs (padded x, gate, up)."""
    inter = down.shape[2]
    xp = pad(x, layout)
    gate = torch.bmm(xp, gate_up[:, :inter].transpose(1, 2))
    up = torch.bmm(xp, gate_up[:, inter:].transpose(1, 2))
    a = F.silu(gate).mul_(up)
    return unpad(torch.bmm(a, down.transpose(1, 2)), layout), (xp, gate, up)


def swiglu_backward(
    dy: Tensor,
    gate_up: Tensor,
    down: Tensor,
    saved: tuple[Tensor, Tensor, Tensor],
    layout: PaddedLayout,
    needs: tuple[bool, bool, bool],
    swiglu_grad,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(dx, d_gate_up, d_down) for `swiglu_forward`; `swiglu_grad(da, gate, up) -> (dh, a)`."""
    xp, gate, up = saved
    dyp = pad(dy, layout)
    dh, a = swiglu_grad(torch.bmm(dyp, down), gate, up)
    d_down = torch.bmm(dyp.transpose(1, 2), a) if needs[2] else None
    del a, dyp
    d_gate_up = torch.bmm(dh.transpose(1, 2), xp) if needs[1] else None
    dx = unpad(torch.bmm(dh, gate_up), layout) if needs[0] else None
    return dx, d_gate_up, d_down
