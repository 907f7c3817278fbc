"""Straggler detection: every N steps, compare the ranks' rank-local step times.

What is timed is the rank-local part of a step: waiting for data plus the forward pass of every
micro-batch. Backward and the optimizer step end in gradient collectives, which make every rank as
slow as the slowest and would hide who the straggler is. Only one step in ``every_n_steps`` is
timed, with device synchronisation around it (asynchronous GPU work would otherwise be missed), so
the overhead elsewhere is nil. Logs ``ft/straggler_ratio`` = slowest / median and
``ft/slowest_rank``; above ``threshold`` it warns with the slowest rank and its host.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from callbacks import _dist
from mula.training.step_boundary import StepBoundary


class StragglerDetector(Callback):
    """Gather per-rank step times every ``every_n_steps`` steps; report the slowest/median ratio.

    Args:
        every_n_steps: time one optimizer step in this many and compare ranks.
        threshold: warn (naming the slowest rank and host) when slowest / median exceeds this...
        min_excess_s: ...and the slowest rank is at least this many seconds slower than the median
            (ratios of millisecond timings are noise).
        synchronize: synchronise the accelerator around the timed regions (needed for GPU timings).
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        threshold: float = 1.5,
        min_excess_s: float = 0.05,
        synchronize: bool = True,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}.")
        if threshold <= 1.0:
            raise ValueError(f"threshold must be > 1 (a ratio to the median), got {threshold}.")
        self.every_n_steps = every_n_steps
        self.threshold = threshold
        self.min_excess_s = min_excess_s
        self.synchronize = synchronize
        self.hosts: list[str] = []
        self.last_report: dict[str, Any] | None = None
        self._measuring = False
        self._elapsed = 0.0
        self._t_prev_end = 0.0
        self._t_start = 0.0
        self._steps = StepBoundary()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Learn every rank's host name once."""
        if stage == "fit":
            self.hosts = _dist.all_gather_object(socket.gethostname())

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start the clock; decide whether the first step is timed."""
        self._steps.start(trainer)
        self._measuring = (trainer.global_step + 1) % self.every_n_steps == 0
        self._elapsed = 0.0
        self._t_prev_end = self._now(trainer)

    def _now(self, trainer: pl.Trainer) -> float:
        device = trainer.strategy.root_device
        if self.synchronize and device.type != "cpu":
            torch.get_device_module(device.type).synchronize(device)
        return time.perf_counter()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Data wait of this micro-batch ends here; its forward starts."""
        if self._measuring:
            now = self._now(trainer)
            self._elapsed += now - self._t_prev_end
            self._t_start = now

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        """Forward of this micro-batch ends here."""
        if self._measuring:
            self._elapsed += self._now(trainer) - self._t_start

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """At a timed step's boundary: gather, compare, log, warn."""
        if self._steps.crossed(trainer):
            step = trainer.global_step
            if self._measuring:
                self._report(trainer, pl_module, step)
            self._measuring = (step + 1) % self.every_n_steps == 0
            self._elapsed = 0.0
        if self._measuring:
            self._t_prev_end = self._now(trainer)

    def _report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        device = trainer.strategy.root_device
        local = torch.tensor([self._elapsed], dtype=torch.float32, device=device)
        if _dist.is_distributed():
            parts = [torch.empty_like(local) for _ in range(_dist.world_size())]
            dist.all_gather(parts, local)
            gathered = torch.cat(parts)
        else:
            gathered = local
        times = gathered.tolist()
        median = statistics.median(times)
        slowest = max(range(len(times)), key=times.__getitem__)
        ratio = times[slowest] / median if median > 0 else 1.0
        host = self.hosts[slowest] if slowest < len(self.hosts) else "?"
        self.last_report = {
            "step": step,
            "times": times,
            "ratio": ratio,
            "slowest_rank": slowest,
            "host": host,
        }
        pl_module.log("ft/straggler_ratio", ratio, on_step=True, on_epoch=False, sync_dist=False)
        pl_module.log("ft/slowest_rank", float(slowest), on_step=True, on_epoch=False, sync_dist=False)
        if ratio > self.threshold and times[slowest] - median >= self.min_excess_s:
            rank_zero_warn(
                f"Straggler at step {step}: rank {slowest} on host {host} took {times[slowest]:.3f}s for its"
                f" rank-local work (data + forward), {ratio:.2f}x the median {median:.3f}s."
            )
