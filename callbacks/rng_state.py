"""Capture and restore every random number generator a training step can draw from.

Python ``random``, NumPy's global generator, torch's CPU generator and the current accelerator's
generator (CUDA, XPU, ... found through ``torch.get_device_module``). States are stored as tensors,
ints and tuples only, so checkpoints stay loadable with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's RNG states; ``device`` selects the accelerator generator (None or CPU: none)."""
    np_state = np.random.get_state(legacy=False)
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        # Mersenne-Twister words are uint32: stored as int32 tensors (compact, and weights_only-safe).
        "python": {"version": version, "internal": _words_to_tensor(internal), "gauss": gauss},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": _words_to_tensor(np_state["state"]["key"]),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if device is not None and device.type != "cpu":
        module = torch.get_device_module(device.type)
        state["accelerator"] = {"type": device.type, "state": module.get_rng_state(device)}
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Set this process's RNG states from :func:`capture_rng_state` output."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(w) for w in _tensor_to_words(py["internal"])), py["gauss"]))
    np_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": np_state["bit_generator"],
            "state": {"key": _tensor_to_words(np_state["key"]), "pos": np_state["pos"]},
            "has_gauss": np_state["has_gauss"],
            "gauss": np_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    accel = state.get("accelerator")
    if accel is not None and device is not None and device.type == accel["type"]:
        torch.get_device_module(device.type).set_rng_state(accel["state"], device)


def _words_to_tensor(words: Any) -> torch.Tensor:
    return torch.from_numpy(np.asarray(words, dtype=np.uint32).view(np.int32).copy())


def _tensor_to_words(tensor: torch.Tensor) -> np.ndarray:
    return tensor.numpy().view(np.uint32).copy()
