"""Triton kernels for token permutation (used on CUDA/XPU, and on CPU through TRITON_INTERPRET=1).

All three are gathers, one program per output row and hidden block, with fp32 accumulation:
  gather_rows  out[r] = scale[r] * src[idx[r]]                       (permute fwd, combine bwd)
  gather_sum   out[n] = sum_k weight[n,k] * src[idx[n*K+k]]           (combine fwd, permute bwd)
  gather_dot   out[j] = <g[j // K], src[idx[j]]>                      (combine weight gradient)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _gather_rows_kernel(src_ptr, idx_ptr, scale_ptr, out_ptr, H, HAS_SCALE: tl.constexpr, BH: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    mask = cols < H
    src_row = tl.load(idx_ptr + row).to(tl.int64)
    v = tl.load(src_ptr + src_row * H + cols, mask=mask, other=0.0)
    if HAS_SCALE:
        v = v.to(tl.float32) * tl.load(scale_ptr + row).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * H + cols, v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_sum_kernel(
    src_ptr, idx_ptr, w_ptr, out_ptr, H, K: tl.constexpr, HAS_WEIGHT: tl.constexpr, BH: tl.constexpr
):
    n = tl.program_id(0)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    mask = cols < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for k in range(K):
        src_row = tl.load(idx_ptr + n * K + k).to(tl.int64)
        v = tl.load(src_ptr + src_row * H + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            v = v * tl.load(w_ptr + n * K + k).to(tl.float32)
        acc += v
    tl.store(out_ptr + n.to(tl.int64) * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_dot_kernel(g_ptr, src_ptr, idx_ptr, out_ptr, H, K: tl.constexpr, BH: tl.constexpr):
    j = tl.program_id(0)
    src_row = tl.load(idx_ptr + j).to(tl.int64)
    g_row = (j // K).to(tl.int64)
    acc = tl.zeros((BH,), dtype=tl.float32)
    for h0 in range(0, H, BH):
        cols = h0 + tl.arange(0, BH)
        mask = cols < H
        g = tl.load(g_ptr + g_row * H + cols, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(src_ptr + src_row * H + cols, mask=mask, other=0.0).to(tl.float32)
        acc += g * v
    tl.store(out_ptr + j, tl.sum(acc, axis=0))


def _block_h(h: int, t: Tensor) -> int:
    cap = 64 if t.device.type == "cpu" else 1024
    return max(16, min(cap, triton.next_power_of_2(max(h, 1))))


def gather_rows(src: Tensor, idx: Tensor, scale: Tensor | None = None) -> Tensor:
    """out[r] = scale[r] * src[idx[r]] for a contiguous src [R,H]."""
    src = src.contiguous()
    h = src.shape[1]
    out = torch.empty(idx.numel(), h, device=src.device, dtype=src.dtype)
    if out.numel() == 0:
        return out
    bh = _block_h(h, src)
    grid = (idx.numel(), triton.cdiv(h, bh))
    _gather_rows_kernel[grid](
        src, idx, scale if scale is not None else idx, out, h, HAS_SCALE=scale is not None, BH=bh
    )
    return out


def gather_sum(src: Tensor, idx: Tensor, weight: Tensor | None, top_k: int) -> Tensor:
    """out[n] = sum_k weight[n,k] * src[idx[n*K+k]] (weight None -> 1)."""
    src = src.contiguous()
    h = src.shape[1]
    n = idx.numel() // max(top_k, 1)
    out = torch.empty(n, h, device=src.device, dtype=src.dtype)
    if out.numel() == 0:
        return out.zero_()
    bh = _block_h(h, src)
    w = weight.contiguous() if weight is not None else idx
    _gather_sum_kernel[(n, triton.cdiv(h, bh))](
        src, idx, w, out, h, K=top_k, HAS_WEIGHT=weight is not None, BH=bh
    )
    return out


def gather_dot(g: Tensor, src: Tensor, idx: Tensor, top_k: int) -> Tensor:
    """out[j] = <g[j // K], src[idx[j]]> in fp32, [N*K]."""
    g, src = g.contiguous(), src.contiguous()
    out = torch.empty(idx.numel(), device=src.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    h = src.shape[1]
    _gather_dot_kernel[(idx.numel(),)](g, src, idx, out, h, K=top_k, BH=_block_h(h, src))
    return out
