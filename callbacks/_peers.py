"""What the callbacks ask of each other, declared as protocols so that none imports another.

A callback may be a `Heartbeat` (the hang watchdog: slow progress is still progress), a
`CheckpointGate` (the anomaly guard: periodic saves wait while a streak lasts, and the newest checkpoint
at or before its protected step survives pruning), or the run's `Checkpointer` (the fault-tolerant
checkpoint, which the anomaly guard rolls back to and the preemption handler saves with).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl


@runtime_checkable
class Heartbeat(Protocol):
    """A callback told that slow progress is still progress (`callbacks.HangWatchdog`)."""

    def heartbeat(self) -> None:
        """Progress was made (a checkpoint save, an evaluation): restart the hang timer."""
        ...


@runtime_checkable
class CheckpointGate(Protocol):
    """A callback that holds periodic saves back and protects a checkpoint from pruning (`AnomalyGuard`)."""

    def blocks_checkpoint(self) -> bool:
        """Whether periodic saves must wait now (e.g. an anomaly streak)."""
        ...

    def protected_step(self) -> int | None:
        """The step whose newest checkpoint at or before it must survive pruning, or None."""
        ...


@runtime_checkable
class Checkpointer(Protocol):
    """The run's checkpoint callback (`callbacks.FaultTolerantCheckpoint`)."""

    def save(self, trainer: pl.Trainer, reason: str = "periodic") -> Path | None:
        """Save a checkpoint now (every rank takes part); the path, or None when nothing was written."""
        ...

    def resolve_dirpath(self, trainer: pl.Trainer) -> Path:
        """The directory its checkpoints are written to."""
        ...

    def latest_valid_checkpoint(self, trainer: pl.Trainer, at_or_before: int | None = None) -> Path | None:
        """The newest checkpoint that verifies (at or before a step), or None."""
        ...

    def apply_rng_from(self, checkpoint: dict[str, Any], trainer: pl.Trainer) -> None:
        """Restore the RNG states a loaded checkpoint recorded."""
        ...


def saves_blocked(trainer: pl.Trainer) -> bool:
    """True if a `CheckpointGate` says periodic saves must wait (e.g. an anomaly streak)."""
    return any(isinstance(c, CheckpointGate) and c.blocks_checkpoint() for c in trainer.callbacks)


def protected_steps(trainer: pl.Trainer) -> list[int]:
    """Steps whose newest checkpoint at or before them must survive pruning (`CheckpointGate`s')."""
    steps = []
    for callback in trainer.callbacks:
        step = callback.protected_step() if isinstance(callback, CheckpointGate) else None
        if step is not None:
            steps.append(int(step))
    return steps


def heartbeat(trainer: pl.Trainer) -> None:
    """Tell a hang watchdog (any `Heartbeat` callback) that slow progress is still progress."""
    for callback in trainer.callbacks:
        if isinstance(callback, Heartbeat):
            callback.heartbeat()


def checkpointer(trainer: pl.Trainer) -> Checkpointer | None:
    """The run's `Checkpointer` callback, or None."""
    return next((c for c in trainer.callbacks if isinstance(c, Checkpointer)), None)
