"""What a parameter's name says: whether it is an expert weight, whether it is decayed, whether Muon
trains it and as which matrices (and the dtypes Muon's Newton-Schulz runs in, which the planner prices).

Torch-free on purpose: `mula plan` reads the model's parameter names from `MulaConfig.parameter_shapes`
without building a module, and must sort them exactly as the strategy and the optimizer do.
"""

from __future__ import annotations

import fnmatch
import re
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


_BLOCK = re.compile(r"(^|\.)(layers|mtp)\.\d+\.")
# the fused stack of `GroupedExperts`: gate rows then up rows of each expert, two Linear weights in one
_FUSED_ROWS = {"gate_up": 2}


def is_muon_param(name: str, shape: Sequence[int]) -> bool:
    """True when `model.optimizer: muon` trains parameter `name` (of `shape`) with Muon: a weight of the
    transformer blocks (``layers.<i>.``) or of the multi-token prediction modules (``mtp.<k>.``: their
    ``eh_proj``) with two or more dimensions, the router's included (Moonlight's rule gives Muon every
    matrix but the embedding and the LM head); AdamW trains the rest (embedding, LM head, norms)."""
    return len(shape) >= 2 and _BLOCK.search(name) is not None


def muon_matrix_shape(name: str, shape: Sequence[int]) -> tuple[int, int]:
    """(rows, columns) of each matrix Muon orthogonalises in a Muon parameter: the last two dimensions,
    except that an expert stack's fused gate_up [E, 2I, H] holds two matrices per expert (gate and up,
    [I, H] each), as separate Linear weights would."""
    rows, cols = int(shape[-2]), int(shape[-1])
    fused = _FUSED_ROWS.get(name.rsplit(".", 1)[-1], 1) if is_expert_param(name) else 1
    return rows // fused, cols


MUON_NS_DTYPES = {"bfloat16": 2, "float32": 4}  # `model.muon_ns_dtype` -> bytes per element


def check_muon_ns_dtype(ns_dtype: str) -> None:
    """Refuse a Newton-Schulz dtype Muon does not run in, in one sentence."""
    if ns_dtype not in MUON_NS_DTYPES:
        raise ValueError(f"muon_ns_dtype must be one of {', '.join(MUON_NS_DTYPES)}, got {ns_dtype!r}.")
