"""Mula: Lightning recipes for pretraining dense and Mixture-of-Experts language models.

Kept light on purpose: importing `mula` imports no torch, Lightning or transformers; `Mula` and
`MulaOutput` (the torch model) load on first use, so that `mula plan` answers without torch.

The package is grouped into rooms (docs/architecture.md): `model/`, `hf/`, `layout/`, `training/`,
`commands/`, `data/`, `checkpoint/`, `plan/`, `calibrate/`, `bench/`, `downstream/`. The module paths
of before that grouping still import, with a warning, for one release (`moved_paths.py`).
"""

from typing import Any

from mula import moved_paths  # noqa: F401  (installs the old paths, once)
from mula.model.config import MulaConfig

__all__ = ["Mula", "MulaConfig", "MulaOutput"]


def __getattr__(name: str) -> Any:
    if name in ("Mula", "MulaOutput"):
        from mula.model import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module 'mula' has no attribute {name!r}")
