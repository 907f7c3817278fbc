"""The learning-rate schedule of `MulaLightningModule`: a linear warmup from `min_lr` to `lr`, then a
half cosine back down to `min_lr` (`warmup_cosine`), and its factor form for `LambdaLR` (`lr_factor`)."""

from __future__ import annotations

import math
from typing import Any


def warmup_cosine(step: int, *, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Learning rate after `step` optimizer steps.

    Linear warmup from `min_lr` (step 0) to `lr` (step `warmup_steps`), then a half cosine from `lr`
    down to `min_lr` at step `decay_steps`, and `min_lr` after that.
    """
    if step < warmup_steps:
        return min_lr + (lr - min_lr) * step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_factor(step: int, **kwargs: Any) -> float:
    """`warmup_cosine` as a multiple of the base lr (what `LambdaLR` wants). A module-level function, so
    that a `functools.partial` of it pickles and `LambdaLR` checkpoints no state for it."""
    return warmup_cosine(step, **kwargs) / kwargs["lr"]
