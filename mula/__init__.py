"""Mula: Lightning recipes for pretraining dense and Mixture-of-Experts language models.

Kept light on purpose: importing `mula` imports no torch, Lightning or transformers; `Mula` and
`MulaOutput` (the torch model) load on first use, so that `mula plan` answers without torch.
"""

from typing import Any

from mula.config import MulaConfig

__all__ = ["Mula", "MulaConfig", "MulaOutput"]


def __getattr__(name: str) -> Any:
    if name in ("Mula", "MulaOutput"):
        from mula import model

        return getattr(model, name)
    raise AttributeError(f"module 'mula' has no attribute {name!r}")
