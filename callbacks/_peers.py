"""What the checkpoint callback asks of the other callbacks, duck-typed so that none imports another.

A callback may offer ``heartbeat()`` (the hang watchdog: slow progress is still progress),
``blocks_checkpoint()`` (the anomaly guard: periodic saves wait while a streak lasts) and
``protected_step()`` (the anomaly guard: the newest checkpoint at or before that step survives pruning).
"""

from __future__ import annotations

import lightning.pytorch as pl


def saves_blocked(trainer: pl.Trainer) -> bool:
    """True if a callback's ``blocks_checkpoint()`` says periodic saves must wait (e.g. an anomaly streak)."""
    for callback in trainer.callbacks:
        blocks = getattr(callback, "blocks_checkpoint", None)
        if callable(blocks) and blocks():
            return True
    return False


def protected_steps(trainer: pl.Trainer) -> list[int]:
    """Steps whose newest checkpoint at or before them must survive pruning (callbacks' ``protected_step()``)."""
    steps = []
    for callback in trainer.callbacks:
        protected = getattr(callback, "protected_step", None)
        step = protected() if callable(protected) else None
        if step is not None:
            steps.append(int(step))
    return steps


def heartbeat(trainer: pl.Trainer) -> None:
    """Tell a hang watchdog (any callback with ``heartbeat()``) that slow progress is still progress."""
    for callback in trainer.callbacks:
        beat = getattr(callback, "heartbeat", None)
        if callable(beat):
            beat()
