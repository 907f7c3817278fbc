"""Data: readers, tokenizers, `mula prepare` and the streaming MulaDataModule.

``MulaDataModule`` is imported lazily so that tokenizer / prepare worker processes do not import Lightning.
"""

import os
from typing import Any

# litdata may ask PyPI for a newer version when a dataset is opened; never phone home (offline clusters).
os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")

# `prepare` is the submodule mula.data.prepare; its function is mula.data.prepare.prepare.
__all__ = ["MulaDataModule", "PrepareSpec", "SourceSpec", "TokenizerTrainSpec", "train_tokenizer"]


def __getattr__(name: str) -> Any:
    if name in ("MulaDataModule", "PrepareSpec", "TokenizerTrainSpec"):
        from mula.data import datamodule

        return getattr(datamodule, name)
    if name == "SourceSpec":
        from mula.data.prepare_summary import SourceSpec

        return SourceSpec
    if name == "train_tokenizer":
        from mula.data.tokenizer import train_tokenizer

        return train_tokenizer
    raise AttributeError(f"module 'mula.data' has no attribute {name!r}")
