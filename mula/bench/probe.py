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
* host syncs (`HostSyncSteps`), on steps after the timed ones (its dispatch mode costs time): the
  `mula.host_sync.HostSyncMeter` count of each chosen step, from the end of the step before it to its own
  end (the window of a step time), logging steps left out.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from typing import Any

import lightning.pytorch as L
import torch
from torch import Tensor
from typing_extensions import override

from mula.host_sync import HostSyncMeter, logging_step, optimizer_host_tensors
from mula.model.moe import iter_moe_layers
from mula.training.devices import device_module
from mula.training.lightning_compat import ends_optimizer_step, logs_train_step
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


def steady_steps(first: int, count: int, log_every_n_steps: int) -> list[int]:
    """The first `count` optimizer steps (1-based) from `first` on whose host-sync window holds no part of
    a logging step: neither the step nor the one before it logs (a logging step hands its metrics to the
    loggers after its last hook, in the next step's window). None when every window holds a logging step
    (`log_every_n_steps` 1 or 2)."""
    if log_every_n_steps in (1, 2):
        return []
    steps, step = [], max(first, 2)
    while len(steps) < count:
        if not logging_step(step, log_every_n_steps) and not logging_step(step - 1, log_every_n_steps):
            steps.append(step)
        step += 1
    return steps


class HostSyncSteps(L.Callback):
    """Counts the host syncs of chosen optimizer steps with a `HostSyncMeter` (mula.host_sync).

    Step n's window runs from the end of step n - 1 (its last micro-batch's `on_train_batch_end`) to the
    end of step n: everything the loop does for it (Lightning's per-batch work, data, every micro-batch's
    forward and backward, the optimizer step). A window that holds part of a logging step (the step
    itself, or the one before it handing over its metrics) is dropped and its step kept in
    `logging_steps`: logging steps may read their metrics on the host.

    Args:
        steps: optimizer step numbers (1-based, from 2) to count.

    `counts`: step -> `HostSyncMeter.counts()` plus "total", for the counted steps.
    """

    def __init__(self, steps: Iterable[int]) -> None:
        self.steps = set(steps)
        self.counts: dict[int, dict[str, Any]] = {}
        self.logging_steps: list[int] = []
        self._meter: HostSyncMeter | None = None
        self._previous_logged = False

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not ends_optimizer_step(trainer):
            return
        step = trainer.global_step  # the step that just ended
        logged = logs_train_step(trainer)
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            if logged or self._previous_logged:
                self.logging_steps.append(step)
            else:
                self.counts[step] = {**self._meter.counts(), "total": self._meter.total}
            self._meter = None
        self._previous_logged = logged
        if step + 1 in self.steps:
            hosted = optimizer_host_tensors(trainer.optimizers)
            self._meter = HostSyncMeter(trainer.strategy.root_device, hosted)
            self._meter.__enter__()

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._meter is not None:  # training ended before the window's step did
            self._meter.__exit__(None, None, None)
            self._meter = None

    def per_step(self) -> float | None:
        """The mean total over the counted steps (None when none was counted)."""
        totals = [c["total"] for c in self.counts.values()]
        return sum(totals) / len(totals) if totals else None

    def breakdown(self) -> dict[str, dict[str, float]]:
        """Mean per counted step of each op, read reason and excluded mark."""
        out: dict[str, dict[str, float]] = {"ops": {}, "reads": {}, "excluded": {}}
        for counts in self.counts.values():
            for kind in out:
                for key, n in counts[kind].items():
                    out[kind][key] = out[kind].get(key, 0) + n / len(self.counts)
        return {kind: dict(sorted(values.items())) for kind, values in out.items()}
