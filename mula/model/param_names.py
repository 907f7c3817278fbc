"""What a parameter's name says: whether it is an expert weight, whether it is decayed.

Torch-free on purpose: `mula plan` reads the model's parameter names from `MulaConfig.parameter_shapes`
without building a module, and must sort them exactly as the strategy and the optimizer do.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

EXPERTS_MODULE = "experts"  # the attribute of `MoELayer` that holds the stacked expert weights


def is_expert_param(name: str) -> bool:
    """True for a parameter (or state-dict entry) that belongs to an MoE layer's stacked experts.

    Expert tensors are the ones below a module named ``experts`` (``layers.3.mlp.experts.gate_up``),
    whatever prefix a wrapper adds (``model.``, ``_orig_mod.``, an optimizer-state key). They are split
    over the expert-parallel group; every other parameter is replicated.
    """
    return EXPERTS_MODULE in name.split(".")[:-1]


def is_no_decay(name: str, patterns: Sequence[str]) -> bool:
    """True when `name` matches one of the `no_decay` glob patterns (trained with weight decay 0)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
