"""What `mula bench` measures inside the training loop: step times, the MoE layers' time, memory.

`BenchProbe` is a Lightning callback:

* step time: the wall clock between the ends of consecutive optimizer steps, the device synchronised
  at each end (everything a training step does counts: data, forward, backward, communication, update);
  the first `warmup` steps are not kept.
* MoE time: each MoE layer's forward (pre to post hook) and backward (full backward pre to post hook),
  timed with device events on an accelerator (no synchronisation inside the step) and with the host
  clock on CPU, summed over the timed steps: its share of their time is "the share of the step in the
  MoE layers" (routing, dispatch and its all-to-all, the experts, combine). Not measured for compiled
  models, whose hooks would break the compiled regions.
* memory, on one more step after the timed ones (its hooks would cost time): the bytes of this rank's
  parameters, gradients at the optimizer step and optimizer state, the most bytes saved for backward
  (`mula.training.memory_meter`), and on CUDA/XPU the allocator's peak over the whole run.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning.pytorch as L
import torch
from torch import Tensor
from typing_extensions import override

from mula.model.moe import iter_moe_layers
from mula.training.devices import device_module
from mula.training.lightning_compat import ends_optimizer_step
from mula.training.memory_meter import SavedTensorMeter, grad_bytes, param_bytes
from mula.training.strategy_contract import OptimizerBytes


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the optimizer's per-element state: the sharded optimizer's own count, else the state
    tensors shaped like their parameter (AdamW's moments; per-parameter scalars such as `step` are left
    out, as the planner leaves them out)."""
    if isinstance(optimizer, OptimizerBytes):
        return int(optimizer.state_bytes())
    total = 0
    for p, state in optimizer.state.items():
        for value in state.values():
            if isinstance(value, Tensor) and value.shape == p.shape and value.numel() > 1:
                total += value.numel() * value.element_size()
    return total


class _Interval:
    """A region's total time: device events on an accelerator, the host clock on CPU."""

    def __init__(self, accelerator: Any, device: torch.device) -> None:
        self.accelerator, self.device = accelerator, device
        self.pairs: list[tuple[Any, Any]] = []
        self.seconds = 0.0
        self._start: Any = None

    def begin(self) -> None:
        self._start = self._mark()

    def end(self) -> None:
        if self._start is not None:
            self.pairs.append((self._start, self._mark()))
            self._start = None

    def _mark(self) -> Any:
        if self.accelerator is None:
            return time.perf_counter()
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def collect(self) -> float:
        """Add the finished pairs' time (call after a device synchronisation) and forget them."""
        for start, stop in self.pairs:
            self.seconds += (stop - start) if self.accelerator is None else start.elapsed_time(stop) / 1e3
        self.pairs.clear()
        return self.seconds


class BenchProbe(L.Callback):
    """Times `steps` optimizer steps after `warmup` and measures memory on the step after them.

    Args:
        warmup: optimizer steps not timed (compilation, allocator growth, caches).
        steps: optimizer steps timed.
        moe_timing: time the MoE layers (False for compiled models).
    """

    def __init__(self, warmup: int, steps: int, moe_timing: bool = True) -> None:
        self.warmup, self.steps, self.moe_timing = warmup, steps, moe_timing
        self.step_ends: list[float] = []
        self.moe_seconds = 0.0
        self.memory: dict[str, int] = {}
        self._moe: _Interval | None = None
        self._timing = False
        self._meter: SavedTensorMeter | None = None
        self._activation_bytes = 0
        self._accelerator: Any = None
        self._device = torch.device("cpu")

    @property
    def step_times(self) -> list[float]:
        """Seconds of each timed optimizer step."""
        ends = self.step_ends[self.warmup : self.warmup + self.steps + 1]
        return [b - a for a, b in zip(ends, ends[1:])]

    def summary(self) -> dict[str, Any]:
        """Step times (each, median, min, max), MoE seconds over the timed steps, memory bytes."""
        times = self.step_times
        return {
            "step_times_s": times,
            "step_time_s": {"median": statistics.median(times), "min": min(times), "max": max(times)},
            "moe_seconds": self.moe_seconds if self._moe is not None else None,
            "memory": dict(self.memory),
        }

    # ----- timing ----------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._device = trainer.strategy.root_device
        self._accelerator = device_module(self._device)
        if self._accelerator is not None:
            self._accelerator.reset_peak_memory_stats(self._device)
        layers = [layer for _, layer in iter_moe_layers(pl_module.model)]
        if self.moe_timing and layers:
            self._moe = _Interval(self._accelerator, self._device)
            for layer in layers:
                layer.register_forward_pre_hook(lambda *_: self._moe_mark(True))
                layer.register_forward_hook(lambda *_: self._moe_mark(False))
                layer.register_full_backward_pre_hook(lambda *_: self._moe_mark(True))
                layer.register_full_backward_hook(lambda *_: self._moe_mark(False))
        self._synchronize()
        self.step_ends = [time.perf_counter()]

    def _moe_mark(self, begin: bool) -> None:
        if self._timing and self._moe is not None:
            self._moe.begin() if begin else self._moe.end()

    def _synchronize(self) -> None:
        if self._accelerator is not None:
            self._accelerator.synchronize(self._device)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step  # optimizer steps done
        self._timing = self.warmup <= step < self.warmup + self.steps
        if step == self.warmup + self.steps:  # the memory step: count what the forward saves
            self._meter = SavedTensorMeter(exclude=pl_module.parameters())
            self._meter.__enter__()

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        if self._meter is not None and self._meter.active:
            self._meter.__exit__(None, None, None)
            self._activation_bytes = max(self._activation_bytes, self._meter.bytes)

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        if trainer.global_step == self.warmup + self.steps:
            self.memory["grads"] = grad_bytes(pl_module, optimizer)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._meter is not None and self._meter.active:  # a forward without a backward
            self._meter.__exit__(None, None, None)
        if not ends_optimizer_step(trainer):
            return
        self._synchronize()
        self.step_ends.append(time.perf_counter())
        if self._moe is not None:
            self.moe_seconds = self._moe.collect()
        if trainer.global_step == self.warmup + self.steps + 1:  # the memory step ended
            optimizer = trainer.optimizers[0] if trainer.optimizers else None
            self.memory.update(
                params=param_bytes(pl_module),
                optimizer=optimizer_state_bytes(optimizer) if optimizer is not None else 0,
                activations=self._activation_bytes,
            )
            if self._accelerator is not None:
                self.memory["peak_allocated"] = int(self._accelerator.max_memory_allocated(self._device))
