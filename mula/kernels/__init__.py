"""Expert-computation kernels: grouped GEMM over tokens sorted by expert.

Reference implementation only for now (a loop over experts); the kernels issue adds the
`torch` and `triton` backends behind the same function.
"""

from __future__ import annotations

import torch
from torch import Tensor


def grouped_mm(x: Tensor, w: Tensor, counts: Tensor, backend: str = "auto") -> Tensor:
    """Grouped matmul: rows of `x` sorted by expert; y[rows of e] = x[rows of e] @ w[e].T.

    x: [T, K]; w: [E, N, K] (stored as [out, in], like nn.Linear); counts: [E] int tokens per expert,
    summing to T. Returns [T, N].
    """
    splits = counts.tolist()
    outs = [xe @ w[e].t() for e, xe in enumerate(torch.split(x, splits, dim=0))]
    return torch.cat(outs, dim=0) if outs else x.new_empty(0, w.shape[1])
