"""`ShardingOptions` (torch-free, `mula.layout.sharding_options`) and its dtype as a torch dtype."""

from __future__ import annotations

import torch

from mula.layout.sharding_options import ShardingOptions, dtype_name

__all__ = ["ShardingOptions", "torch_dtype"]


def torch_dtype(dtype: object) -> torch.dtype:
    """The torch dtype of a `ShardingOptions.reduce_dtype` (or a recipe's "bf16", "fp32", ...)."""
    return getattr(torch, dtype_name(dtype))
