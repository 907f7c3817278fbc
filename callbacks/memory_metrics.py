"""Per-rank memory accounting, logged every `log_every_n_steps` optimizer steps (what is measured and
how: `mula.training.memory_meter`).

* `mem/param_bytes`, `mem/grad_bytes`, `mem/activation_bytes` (the most bytes saved for backward during
  the logged step's largest micro-batch, or over its pipeline schedule)
* `mem/peak_allocated_bytes` (CUDA/XPU only): the allocator's peak since the previous logged step.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
from torch import Tensor
from typing_extensions import override

from mula.training.devices import device_module
from mula.training.lightning_compat import ends_optimizer_step, logs_train_step
from mula.training.memory_meter import SavedTensorMeter, grad_bytes, param_bytes


class MemoryMetrics(L.Callback):
    """Logs mem/param_bytes, mem/grad_bytes, mem/activation_bytes and mem/peak_allocated_bytes per rank.

    Every value is logged on the steps Lightning hands to the loggers (`log_every_n_steps`), for this
    rank (no reduction over ranks).
    """

    def __init__(self) -> None:
        self._meter: SavedTensorMeter | None = None
        self._activation_bytes: int | None = None
        self._grad_bytes: int | None = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Start the first peak-memory window."""
        device = device_module(trainer.strategy.root_device)
        if device is not None:
            device.reset_peak_memory_stats(trainer.strategy.root_device)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        """On a logged step, count what this micro-batch's forward saves for backward."""
        if not logs_train_step(trainer):
            return
        # a new meter each time: a strategy may have re-materialised the parameters since
        self._meter = SavedTensorMeter(exclude=pl_module.parameters())
        self._meter.__enter__()

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        """The forward is over: stop counting, keep the step's largest micro-batch."""
        if self._meter is None or not self._meter.active:
            return
        self._meter.__exit__(None, None, None)
        self._activation_bytes = max(self._activation_bytes or 0, self._meter.bytes)

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        """Gradients are complete: note their bytes for a logged step."""
        if logs_train_step(trainer):
            self._grad_bytes = grad_bytes(pl_module, optimizer)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        """After a logged optimizer step: log this rank's memory and start a new peak window."""
        if self._meter is not None and self._meter.active:  # a forward with no backward
            self._meter.__exit__(None, None, None)
        if not (ends_optimizer_step(trainer) and logs_train_step(trainer)):
            return
        values = {"mem/param_bytes": param_bytes(pl_module)}
        if self._grad_bytes is not None:
            values["mem/grad_bytes"] = self._grad_bytes
        if self._activation_bytes is not None:
            values["mem/activation_bytes"] = self._activation_bytes
        device = device_module(trainer.strategy.root_device)
        if device is not None:
            root = trainer.strategy.root_device
            values["mem/peak_allocated_bytes"] = device.max_memory_allocated(root)
            device.reset_peak_memory_stats(root)
        for key, value in values.items():
            pl_module.log(key, float(value), on_step=True, on_epoch=False, sync_dist=False)
        self._activation_bytes = self._grad_bytes = None
