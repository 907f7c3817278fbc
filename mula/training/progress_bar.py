"""The training progress bar of `mula fit`: optimizer steps against `trainer.max_steps`.

Lightning's tqdm bar counts micro-batches (`batch_idx + 1`) but, when `max_steps` is set, takes the
remaining optimizer steps as its total, so with gradient accumulation it reads `600/300`. This bar
counts what the total counts: optimizer steps (`trainer.global_step`), over the whole run when
`max_steps` is set (a resumed run starts at its checkpoint's step), per epoch otherwise.

Its numbers change on the steps whose metrics go to the loggers (`log_every_n_steps`), where they are read
on the host, `train/loss` with them (the module logs its step losses for the loggers, not as progress-bar
metrics, which Lightning would read on the host after every micro-batch); other steps only move the count,
reading nothing from the device.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

from mula.training.lightning_compat import logs_train_step


def step_range(trainer: L.Trainer) -> tuple[int, int | None]:
    """(first, total) optimizer steps of the bar at the start of an epoch: (step now, max_steps) when
    `max_steps` is set, else (0, the epoch's steps) -- None for an epoch of unknown length."""
    if trainer.max_steps > 0:
        return trainer.global_step, trainer.max_steps
    batches = trainer.num_training_batches
    if math.isinf(batches) or math.isnan(batches):
        return 0, None
    # Lightning steps after every `accumulate_grad_batches` micro-batches and on an epoch's last one
    return 0, math.ceil(batches / trainer.accumulate_grad_batches)


class StepProgressBar(TQDMProgressBar):
    """`TQDMProgressBar` whose training bar counts optimizer steps against `max_steps` (or the epoch's
    steps without it); the validation and test bars are Lightning's. `refresh_rate` counts steps."""

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self._offset = 0  # the global step the bar's count starts from (the epoch's first, without max_steps)

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        """Lightning's bar with the step range as its count and total."""
        super().on_train_epoch_start(trainer, *args)
        first, total = step_range(trainer)
        self._offset = 0 if trainer.max_steps > 0 else trainer.global_step
        bar = self.train_progress_bar
        bar.total = total
        bar.initial = bar.n = first  # tqdm's rate counts from `initial`: steps of this run only
        bar.refresh()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Move the bar when an optimizer step has been taken (every `refresh_rate` steps, and the last)."""
        bar = self.train_progress_bar
        n = trainer.global_step - self._offset
        if bar is None or bar.disable or n == bar.n:
            return
        if n % self.refresh_rate == 0 or n == bar.total:
            bar.n = n
            if logs_train_step(trainer):
                bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar
            else:
                bar.refresh()

    @override
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """Lightning's progress-bar metrics and the last logged `train/loss` (read on the host: the bar asks
        on logging steps, at the end of an epoch and after validation)."""
        metrics = dict(super().get_metrics(trainer, pl_module))
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None:
            metrics["train/loss"] = f"{float(loss):.3f}"
        return metrics
