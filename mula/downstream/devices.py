"""Where an evaluation runs and in which dtype: the device a checkpoint is scored on when none is named,
and the autocast dtype of `--dtype`. Shared by the one-device path (`checkpoint_eval.py`) and the
strategy's path (`trainer_eval.py`), which both import it and not each other for it.
"""

from __future__ import annotations

import torch

from mula.training.devices import bf16_supported

# `--dtype` choices besides "auto": the autocast dtype each means (None: no autocast, fp32 as stored)
EVAL_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def default_device() -> torch.device:
    """The first accelerator present, XPU first, else the CPU."""
    for kind in ("xpu", "cuda"):
        module = getattr(torch, kind, None)
        if module is not None and module.is_available():
            return torch.device(kind)
    return torch.device("cpu")


def autocast_dtype(device: torch.device, dtype: str) -> torch.dtype | None:
    """The autocast dtype for `dtype` on `device`: "auto" is bf16 on an accelerator that has it, else fp32 (None)."""
    if dtype == "auto":
        return torch.bfloat16 if bf16_supported(device) else None
    if dtype not in EVAL_DTYPES:
        raise ValueError(f"dtype must be auto, float32 or bfloat16, got {dtype!r}.")
    return EVAL_DTYPES[dtype]
