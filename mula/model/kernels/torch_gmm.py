"""`torch` backend: the grouped products on `torch._grouped_mm` / `torch.nn.functional.grouped_mm`.

torch's kernel wants every operand's leading stride and base pointer on 16-byte boundaries
("strides should be multiple of 16 bytes") and rejects stride-0 (expanded) gradients. We make
operands contiguous and zero-pad the offending inner dimension instead of falling back to a loop:
zero columns add nothing to the products, and padding costs one copy only for odd shapes.
Group boundaries go in as int32 cumulative offsets computed on the device (no host sync).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from mula.torch_compat import private_grouped_mm, public_grouped_mm

_ALIGN_BYTES = 16


def grouped_mm_fn() -> Callable[..., Tensor] | None:
    """`torch.nn.functional.grouped_mm` (torch >= 2.10) or `torch._grouped_mm` (2.8-2.9), or None."""
    fn = public_grouped_mm()
    return fn if fn is not None else private_grouped_mm()


def _padded_size(size: int, dtype: torch.dtype) -> int:
    """Smallest size >= `size` whose row stride in bytes is a multiple of 16."""
    per = max(1, _ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    return -(-size // per) * per


def _aligned(t: Tensor) -> bool:
    """Unit last stride, every other stride and the base pointer on 16-byte boundaries (views are fine)."""
    size = t.element_size()
    if t.stride(-1) != 1 or t.data_ptr() % _ALIGN_BYTES:
        return False
    return all(s * size % _ALIGN_BYTES == 0 for s in t.stride()[:-1])


def _prep(t: Tensor, pad: tuple[int, ...]) -> Tensor:
    """`t` itself when torch's kernel accepts it, else an aligned copy zero-padded by `pad` (F.pad order)."""
    if any(pad):
        return F.pad(t, pad)
    return t if _aligned(t) else t.clone(memory_format=torch.contiguous_format)


def _offsets(counts: Tensor) -> Tensor:
    return torch.cumsum(counts, 0, dtype=torch.int32)


def fwd(x: Tensor, w: Tensor, counts: Tensor, transpose_w: bool) -> Tensor:
    """Rows of expert e times w[e].T (`transpose_w=False`, x [T,K] -> [T,N]) or times w[e] (x [T,N] -> [T,K])."""
    gmm = grouped_mm_fn()
    n, k = w.shape[1], w.shape[2]
    if not transpose_w:
        kp = _padded_size(k, x.dtype)
        xp = _prep(x, (0, kp - k))
        wp = _prep(w, (0, kp - k))
        return gmm(xp, wp.transpose(-2, -1), offs=_offsets(counts))
    # x [T,N] @ w[e] [N,K]: both x's row stride (N) and w's row stride (K) must be aligned.
    npad, kp = _padded_size(n, x.dtype), _padded_size(k, x.dtype)
    xp = _prep(x, (0, npad - n))
    wp = _prep(w, (0, kp - k, 0, npad - n))
    out = gmm(xp, wp, offs=_offsets(counts))
    return out if kp == k else out[:, :k].contiguous()


def wgrad(dy: Tensor, x: Tensor, counts: Tensor) -> Tensor:
    """dW[e] = dy_e.T @ x_e as one grouped 2D x 2D product over the token dimension: [E,N,K]."""
    gmm = grouped_mm_fn()
    n, k = dy.shape[1], x.shape[1]
    npad, kp = _padded_size(n, x.dtype), _padded_size(k, x.dtype)
    dyp = _prep(dy, (0, npad - n))
    xp = _prep(x, (0, kp - k))
    out = gmm(dyp.t(), xp, offs=_offsets(counts))
    if npad != n or kp != k:
        out = out[:, :n, :k].contiguous()
    return out
