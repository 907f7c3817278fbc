"""`triton` backend: grouped GEMM kernels for CUDA and Intel XPU (and CPU via TRITON_INTERPRET=1).

Scheduling without host synchronisation: the number of row tiles of each expert (`cdiv(count, BM)`)
is only known on the device, so we launch an upper bound of `cdiv(T, BM) + E` row tiles and build a
tile -> (expert, first row) table with a handful of vectorised torch ops on the device; tiles past
the real total exit at once. Experts with zero rows own no tile; counts that are not multiples of BM
end in a masked partial tile; all rows on one expert is just a long run of that expert's tiles.

Kernels:
  _gemm_kernel   y = x_e @ B_e with B_e = w[e].T or w[e] (strides decide), fp32 accumulation, and two
                 optional fused epilogues: SwiGLU forward (gate and up tiles in one program, writes the
                 pre-activations h and a = silu(gate) * up) and SwiGLU backward (takes dA, reads h, writes
                 dh = [dgate, dup] and recomputes a for the down-projection weight gradient).
  _wgrad_kernel  dW[e] = dy_e.T @ x_e, one program per (expert, N tile, K tile) looping over the
                 expert's rows; experts without rows write zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MODE_PLAIN, MODE_SWIGLU_FWD, MODE_SWIGLU_BWD = 0, 1, 2


# fmt: off
@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, y_ptr, h_ptr, a_ptr,
    tile_expert_ptr, tile_row_ptr, ends_ptr,
    N, K, I,  # noqa: E741 (I: the experts' intermediate size, as in the formulas)
    stride_xm, stride_xk,
    stride_we, stride_wk, stride_wn,
    stride_ym, stride_yn,
    stride_hm, stride_am,
    MODE: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_m)
    if expert < 0:  # beyond the real number of row tiles
        return
    row0 = tl.load(tile_row_ptr + pid_m)
    row_end = tl.load(ends_ptr + expert)
    rows = row0 + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    row_ok = rows < row_end
    col_ok = cols < N
    # fmt: on
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if MODE == 1:
        # Up-projection columns sit I rows of w further than the gate columns.
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        up_ptrs = w_ptrs + I * stride_wn
    for k0 in range(0, K, BK):
        k_ok = (k0 + ks) < K
        xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
        if MODE == 1:
            ut = tl.load(up_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if DOT_F32:
                ut = ut.to(tl.float32)
            acc_up = tl.dot(xt, ut, acc_up, input_precision=PRECISION)
            up_ptrs += BK * stride_wk
        x_ptrs += BK * stride_xk
        w_ptrs += BK * stride_wk
    out_mask = row_ok[:, None] & col_ok[None, :]
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
    if MODE == 0:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    elif MODE == 1:
        h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hm + cols[None, :]
        gate = acc.to(h_ptr.dtype.element_ty)
        up = acc_up.to(h_ptr.dtype.element_ty)
        tl.store(h_ptrs, gate, mask=out_mask)
        tl.store(h_ptrs + I, up, mask=out_mask)
        # Activation from the rounded pre-activations, as the unfused reference computes it.
        g = gate.to(tl.float32)
        act = g * tl.sigmoid(g) * up.to(tl.float32)
        tl.store(y_ptrs, act.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        # acc holds dA for columns [cols] of the activation; y is dh [T, 2I].
        h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hm + cols[None, :]
        g = tl.load(h_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptrs + I, mask=out_mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        dgate = acc * u * sig * (1.0 + g * (1.0 - sig))
        dup = acc * silu
        tl.store(y_ptrs, dgate.to(y_ptr.dtype.element_ty), mask=out_mask)
        tl.store(y_ptrs + I * stride_yn, dup.to(y_ptr.dtype.element_ty), mask=out_mask)
        a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + cols[None, :]
        tl.store(a_ptrs, (silu * u).to(a_ptr.dtype.element_ty), mask=out_mask)


# fmt: off
@triton.jit
def _wgrad_kernel(
    dy_ptr, x_ptr, dw_ptr, ends_ptr, counts_ptr,
    N, K,
    stride_dym, stride_dyn, stride_xm, stride_xk,
    stride_we, stride_wn, stride_wk,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    # fmt: on
    expert = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    end = tl.load(ends_ptr + expert)
    start = end - tl.load(counts_ptr + expert)
    ns = pid_n * BN + tl.arange(0, BN)
    ks = pid_k * BK + tl.arange(0, BK)
    ms = tl.arange(0, BM)
    n_ok = ns < N
    k_ok = ks < K
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for m0 in range(start, end, BM):
        rows = m0 + ms
        r_ok = rows < end
        dyt = tl.load(
            dy_ptr + rows[:, None].to(tl.int64) * stride_dym + ns[None, :] * stride_dyn,
            mask=r_ok[:, None] & n_ok[None, :], other=0.0,
        )
        xt = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk,
            mask=r_ok[:, None] & k_ok[None, :], other=0.0,
        )
        if DOT_F32:
            dyt = dyt.to(tl.float32)
            xt = xt.to(tl.float32)
        acc = tl.dot(tl.trans(dyt), xt, acc, input_precision=PRECISION)
    dw_ptrs = dw_ptr + expert.to(tl.int64) * stride_we + ns[:, None] * stride_wn + ks[None, :] * stride_wk
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


def _interpreted(t: Tensor) -> bool:
    return t.device.type == "cpu"


def _dot_f32(t: Tensor) -> bool:
    """Triton 3.x's interpreter returns garbage for 16-bit tl.dot, so interpreted tiles are upcast first."""
    return _interpreted(t) and t.dtype != torch.float32


def _precision(dtype: torch.dtype) -> str:
    """fp32 follows torch's TF32 switch (default off -> exact IEEE products); 16-bit inputs ignore it."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _pow2_at_least_16(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(max(n, 1))))


def _gemm_blocks(n: int, k: int, t: Tensor, fused: bool) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages): small tiles in the interpreter, MMA-sized ones on GPUs."""
    if _interpreted(t):
        return 16, _pow2_at_least_16(n, 32), _pow2_at_least_16(k, 32), 1, 1
    bk = 64 if t.element_size() <= 2 else 32
    bn = 64 if fused else 128
    return 64, _pow2_at_least_16(n, bn), _pow2_at_least_16(k, bk), 4, 3


def _tile_map(counts: Tensor, total_rows: int, bm: int) -> tuple[Tensor, Tensor, Tensor]:
    """Device-side tile table: (tile_expert [max_tiles] int32, -1 past the end; tile_row; expert row ends)."""
    num_experts = counts.numel()
    counts = counts.to(torch.int64)
    ends = torch.cumsum(counts, 0)
    tiles = (counts + bm - 1) // bm
    tile_ends = torch.cumsum(tiles, 0)
    max_tiles = triton.cdiv(total_rows, bm) + num_experts  # >= sum(cdiv(count, bm)) for any split
    t = torch.arange(max_tiles, device=counts.device)
    expert = torch.searchsorted(tile_ends, t, right=True)
    valid = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    row = ends[e] - counts[e] + (t - (tile_ends[e] - tiles[e])) * bm
    tile_expert = torch.where(valid, e, -1).to(torch.int32)
    return tile_expert, row.to(torch.int64), ends


def _launch_gemm(
    x: Tensor, w: Tensor, counts: Tensor, transpose_w: bool, mode: int,
    y: Tensor, h: Tensor | None = None, a: Tensor | None = None,
) -> None:
    """y = x_e @ (w[e].T if transpose_w is False else w[e]) with the epilogue `mode`; see module doc."""
    num_rows, k = x.shape
    if num_rows == 0:
        return
    # B_e as a [K, N] matrix through strides; N is the output width (I for the fused modes).
    if transpose_w:  # x [T, N_w] @ w[e] [N_w, K_w]
        stride_wk, stride_wn = w.stride(1), w.stride(2)
        n = w.shape[2]
    else:  # x [T, K_w] @ w[e].T
        stride_wk, stride_wn = w.stride(2), w.stride(1)
        n = w.shape[1]
    inter = 0
    if mode == MODE_SWIGLU_FWD:
        inter = n // 2
        n = inter
    elif mode == MODE_SWIGLU_BWD:
        inter = n
    bm, bn, bk, warps, stages = _gemm_blocks(n, k, x, mode != MODE_PLAIN)
    tile_expert, tile_row, ends = _tile_map(counts, num_rows, bm)
    grid = (tile_expert.numel(), triton.cdiv(n, bn))
    hh = h if h is not None else y
    aa = a if a is not None else y
    # fmt: off
    _gemm_kernel[grid](
        x, w, y, hh, aa, tile_expert, tile_row, ends,
        n, k, inter,
        x.stride(0), x.stride(1),
        w.stride(0), stride_wk, stride_wn,
        y.stride(0), y.stride(1),
        hh.stride(0), aa.stride(0),
        MODE=mode, PRECISION=_precision(x.dtype), DOT_F32=_dot_f32(x), BM=bm, BN=bn, BK=bk,
        num_warps=warps, num_stages=stages,
    )
    # fmt: on


def fwd(x: Tensor, w: Tensor, counts: Tensor, transpose_w: bool) -> Tensor:
    """x_e @ w[e].T ([T,K] -> [T,N]) or, with transpose_w, x_e @ w[e] ([T,N] -> [T,K])."""
    x = x.contiguous()
    n = w.shape[2] if transpose_w else w.shape[1]
    y = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
    _launch_gemm(x, w, counts, transpose_w, MODE_PLAIN, y)
    return y


def swiglu_fwd(x: Tensor, gate_up: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """Fused gate+up GEMM and SwiGLU: returns (h = x_e @ gate_up[e].T [T,2I], a = silu(h_gate) * h_up [T,I])."""
    x = x.contiguous()
    two_i = gate_up.shape[1]
    h = torch.empty(x.shape[0], two_i, device=x.device, dtype=x.dtype)
    a = torch.empty(x.shape[0], two_i // 2, device=x.device, dtype=x.dtype)
    _launch_gemm(x, gate_up, counts, False, MODE_SWIGLU_FWD, a, h=h)
    return h, a


def swiglu_bwd(dy: Tensor, down: Tensor, h: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """dA = dy_e @ down[e] with the SwiGLU backward fused: returns (dh [T,2I], a recomputed [T,I])."""
    dy = dy.contiguous()
    dh = torch.empty_like(h)
    a = torch.empty(h.shape[0], h.shape[1] // 2, device=h.device, dtype=h.dtype)
    _launch_gemm(dy, down, counts, True, MODE_SWIGLU_BWD, dh, h=h, a=a)
    return dh, a


def wgrad(dy: Tensor, x: Tensor, counts: Tensor) -> Tensor:
    """dW[e] = dy_e.T @ x_e: [E, N, K] in the weights' dtype (fp32 accumulation)."""
    num_experts = counts.numel()
    n, k = dy.shape[1], x.shape[1]
    dw = torch.empty(num_experts, n, k, device=x.device, dtype=x.dtype)
    if num_experts == 0:
        return dw
    if _interpreted(x):
        bm, bn, bk, warps, stages = 16, _pow2_at_least_16(n, 32), _pow2_at_least_16(k, 32), 1, 1
    else:
        bm = 64 if x.element_size() <= 2 else 32
        bn, bk, warps, stages = _pow2_at_least_16(n, 64), _pow2_at_least_16(k, 64), 4, 3
    counts64 = counts.to(torch.int64)
    ends = torch.cumsum(counts64, 0)
    grid = (num_experts, triton.cdiv(n, bn), triton.cdiv(k, bk))
    # fmt: off
    _wgrad_kernel[grid](
        dy, x, dw, ends, counts64,
        n, k,
        dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2),
        PRECISION=_precision(x.dtype), DOT_F32=_dot_f32(x), BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages,
    )
    # fmt: on
    return dw
