"""Whether an optimizer step completed since a callback last looked: `trainer.global_step` moved.

A callback that acts once per optimizer step from `on_train_batch_end` (a checkpoint, a preemption exit,
an evaluation, a straggler report, the hang watchdog's step count) asks this question, not
`lightning_compat.ends_optimizer_step`. That one says where the micro-batch being run stands in its
gradient-accumulation window, a question about the step in progress (valid from `training_step` on).
This one asks what happened since the observer's previous look: Lightning's `global_step` counts the
optimizer steps it ran, a skipped update included (AnomalyGuard's veto, a non-finite gradient: the step
is counted, the LR schedule moves), it stays put inside an accumulation window, and a resumed run
starts at its checkpoint's step, which `StepBoundary.start` marks as seen so that it is not taken for a
new one. Each observer keeps its own `StepBoundary`: looking is what consumes a step.
"""

from __future__ import annotations

from typing import Any


class StepBoundary:
    """One observer's view of the optimizer steps: `crossed` is true at the first look after each step."""

    def __init__(self) -> None:
        # the global step at the last look; -1 before any, so that the first look reports a step
        self.seen = -1

    def start(self, trainer: Any) -> None:
        """Take the trainer's current step as seen (from `on_train_start`: a resumed run's checkpointed
        step is not a new step)."""
        self.seen = trainer.global_step

    def crossed(self, trainer: Any) -> bool:
        """Whether `trainer.global_step` moved since the last look (or this is the first look), which
        this look records: true once per optimizer step, false on the window's other micro-batches."""
        step = trainer.global_step
        if step == self.seen:
            return False
        self.seen = step
        return True
