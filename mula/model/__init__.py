"""The model, top to bottom: its config (`config.py`, with its rules and the named presets),
the transformer (`transformer.py`: `Mula`), its layers and attention (`layers.py`, `mla.py`), the MoE
layer (`moe/`), the expert kernels (`kernels/`), the parameter-name rules, activation checkpointing
and `torch.compile` regions.

Torch-free to import: the planner reads `mula.model.config`; `Mula` and `MulaOutput` load on first
use (`from mula.model import Mula`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Mula", "MulaOutput"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mula.model import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module 'mula.model' has no attribute {name!r}")
