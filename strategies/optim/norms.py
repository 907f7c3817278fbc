"""The sum of squares of a long gradient vector, accurate whatever its length.

One fp32 dot product (or `torch.linalg.vector_norm` on CPU) over a shard of 50 million elements is off by
up to 1e-3 of the result, and by more the longer the shard: a paper-scale rank's gradient norm, and so its
clipping, would depend on the shard's length. Here the vector is cut into rows of `CHUNK` elements, each
row's norm is taken in fp32 (a short reduction: ~1e-8 relative), and the rows' squares are summed in fp64:
6e-9 of the exact sum at 50 million elements, with no temporary larger than one value per row.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 4096


def square_sum(t: Tensor) -> Tensor:
    """sum(t ** 2) of a 1-D (or any, flattened) tensor as a 0-dim fp32 tensor on its device."""
    flat = t.detach().reshape(-1).float()
    whole = flat.numel() // CHUNK * CHUNK
    rows = torch.linalg.vector_norm(flat[:whole].view(-1, CHUNK), dim=1).double().square().sum()
    rest = flat[whole:].double()
    return (rows + torch.dot(rest, rest)).float()
