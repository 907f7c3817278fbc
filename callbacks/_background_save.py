"""An asynchronous checkpoint save in flight: the strategy's background write, then the commit.

``FaultTolerantCheckpoint(async_save=True)`` stages the checkpoint into host memory at the step
boundary (``strategy.save_checkpoint_async``) and hands the rest to a ``BackgroundSave``: a daemon
thread waits for this rank's files, flushes them, and runs the commit (``_checkpoint_commit.commit``)
over the writer's own gloo group, so the manifest -- the completion marker -- is written only after
every rank's background write finished. The training thread never runs a collective for it; it asks
``done()`` at step boundaries and waits with ``result()`` before the next save, a rollback, a
preemption exit or the end of training (at most one save in flight).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch.distributed as dist

from callbacks import _dist
from callbacks._checkpoint_commit import SaveRecord, commit
from mula.checkpoint import sync_filesystem


def writer_group() -> object | None:
    """A gloo group over every rank for the background writer (a collective; None without a process group).

    DCP's asynchronous save runs its collectives from another thread, which must never interleave
    with the training step's collectives on one group; gloo, because it stages on the host (also for
    a one-rank NCCL group, which DCP's asynchronous save refuses).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")


class BackgroundSave:
    """One save whose files are being written in the background, committed by the same thread."""

    def __init__(
        self, record: SaveRecord, tmp: Path, final: Path, write: Future, group: object, blocking_s: float
    ) -> None:
        self.record, self.tmp, self.final = record, tmp, final
        self.blocking_s = blocking_s  # how long the training thread was stopped (staging included)
        self.total_s: float | None = None
        self._write, self._group = write, group
        self._outcome: Future = Future()
        # A daemon: a process that exits (a crash on another rank) must not hang joining it.
        self._thread = threading.Thread(target=self._run, name=f"mula-checkpoint-{record.step}", daemon=True)
        self._thread.start()

    @property
    def step(self) -> int:
        """The optimizer step being saved."""
        return self.record.step

    def _run(self) -> None:
        problem = None
        try:
            self._write.result()
            sync_filesystem(self.tmp)  # durability before the rename, as in a synchronous save
        except Exception as err:  # noqa: BLE001 (agreed on by every rank in commit)
            problem = _dist.describe_error(err)
        try:
            outcome = commit(self.record, self.tmp, self.final, problem, True, self._group)
        except Exception as err:  # noqa: BLE001 (a failed collective: reported where result() is asked)
            outcome = (_dist.describe_error(err), 0)
        self.total_s = time.monotonic() - self.record.start
        self._outcome.set_result(outcome)

    def done(self) -> bool:
        """True once this rank's part of the save (write and commit) has finished."""
        return self._outcome.done()

    def result(self) -> tuple[str | None, int]:
        """Wait for the save: (the problem every rank agreed on, or None; the checkpoint's bytes)."""
        return self._outcome.result()
