"""Tokens per second and model FLOPs utilisation (MFU), logged every training step.

MFU = achieved model FLOP/s / peak dense bf16 FLOP/s of the devices in use. The model FLOPs come from
the LightningModule's `flops_per_batch` (for Mula: `MulaConfig.flops_per_token`, forward + backward,
no recomputation counted), so MFU compares across hardware and strategies. On CPUs, and on devices
missing from `PEAK_BF16_FLOPS`, only tokens/s is logged unless `peak_flops` is given.
"""

from __future__ import annotations

import time
from collections import deque

import lightning.pytorch as L
import torch
from typing_extensions import Protocol, override, runtime_checkable

from mula.training.devices import device_module, device_name
from mula.training.strategy_contract import mula_strategy

# Dense (no sparsity) bf16 peak FLOP/s of ONE device as torch enumerates it, keyed by a lower-case
# substring of the device name; the first matching key wins, so specific names come first.
PEAK_BF16_FLOPS: dict[str, float] = {
    # NVIDIA datasheets (dense tensor-core bf16)
    "gh200": 989e12,
    "h200": 989e12,
    "h100 pcie": 756e12,
    "h100 nvl": 835e12,
    "h100": 989e12,  # SXM ("NVIDIA H100 80GB HBM3")
    "a100": 312e12,
    # AMD: MI250X is 383 TFLOP/s per package of two GCDs; torch sees each GCD as one device
    "mi250x": 191.5e12,
    "mi250": 181e12,
    "mi300x": 1307.4e12,
    # Intel Data Center GPU Max 1550: 838.9 TFLOP/s bf16 per two-stack card (128 Xe cores x 4096
    # FLOP/clk x 1.6 GHz). Aurora's default FLAT mode exposes each stack (tile) as one device, hence
    # half a card; in COMPOSITE mode pass peak_flops=838.9e12.
    "max 1550": 419.4e12,
}


def peak_bf16_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of `device` from `PEAK_BF16_FLOPS`, or None when unknown (and on CPU)."""
    if device.type == "cpu":
        return None
    name = device_name(device).lower()
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def _synchronize(device: torch.device) -> None:
    """Wait for queued kernels so that wall-clock time measures the step (no-op on CPU)."""
    module = device_module(device)
    if module is not None:
        module.synchronize(device)


@runtime_checkable  # typing_extensions': `isinstance` runs none of the module's properties
class CountsBatches(Protocol):
    """A LightningModule that says what its last micro-batch held (`MulaLightningModule`); any other
    module's tokens are its batch's elements, and its MFU is not logged."""

    @property
    def tokens_per_batch(self) -> int | None:
        """Input tokens of the last micro-batch (None before the first)."""
        ...

    @property
    def flops_per_batch(self) -> float | None:
        """Training FLOPs (forward + backward) of the last micro-batch (None before the first)."""
        ...


class Throughput(L.Callback):
    """Logs `train/tokens_per_sec` (all ranks) and `train/mfu` every micro-batch, shown in the progress bar.

    Rates are measured over the last `window` micro-batches (wall clock between batch ends, so data
    loading and optimizer time count). Tokens per batch come from the module's `tokens_per_batch`
    (falling back to `batch.numel()`) and are multiplied by the world size, assuming equal batches
    on every rank, as data-parallel training has.

    Args:
        window: Number of micro-batches the rates are averaged over.
        peak_flops: Peak FLOP/s of one device; default: looked up in `PEAK_BF16_FLOPS`.
    """

    def __init__(self, window: int = 10, peak_flops: float | None = None) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}.")
        self.window = window
        self.peak_flops = peak_flops
        self._times: deque[float] = deque(maxlen=window + 1)
        self._tokens: deque[int] = deque(maxlen=window)
        self._flops: deque[float] = deque(maxlen=window)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Resolve the device's peak FLOP/s once."""
        if self.peak_flops is None:
            self.peak_flops = peak_bf16_flops(pl_module.device)
        self._times.clear()
        self._tokens.clear()
        self._flops.clear()

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Restart the window so that validation time does not count as training time."""
        self._times.clear()
        self._tokens.clear()
        self._flops.clear()

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int
    ) -> None:
        """Start the clock before the first batch (later batches are timed end to end)."""
        if not self._times:
            _synchronize(pl_module.device)
            self._times.append(time.perf_counter())

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        """Log tokens/s and MFU over the window ending with this batch."""
        _synchronize(pl_module.device)
        self._times.append(time.perf_counter())
        counts = pl_module if isinstance(pl_module, CountsBatches) else None
        tokens = None if counts is None else counts.tokens_per_batch
        if tokens is None:
            tokens = batch.numel() if isinstance(batch, torch.Tensor) else 0
        # data-parallel ranks, not all ranks: pipeline stages of one data-parallel rank share its tokens
        strategy = mula_strategy(trainer.strategy)
        dp_size = strategy.data_parallel_size if strategy is not None else trainer.world_size
        self._tokens.append(tokens * dp_size)
        flops = None if counts is None else counts.flops_per_batch
        self._flops.append(float(flops or 0) * dp_size)
        elapsed = self._times[-1] - self._times[0]
        if elapsed <= 0:
            return
        pl_module.log("train/tokens_per_sec", sum(self._tokens) / elapsed, prog_bar=True, on_step=True)
        if self.peak_flops and flops:
            mfu = sum(self._flops) / elapsed / (self.peak_flops * trainer.world_size)
            pl_module.log("train/mfu", mfu, prog_bar=True, on_step=True)
