"""The save half of ``FaultTolerantCheckpoint``: one crash-safe save, synchronous or in the background.

``CheckpointSaving`` is a mixin of ``callbacks.FaultTolerantCheckpoint`` (which holds the settings and
the Lightning hooks deciding *when* to save); it owns *how*: rank 0 prepares room, every rank builds
Lightning's checkpoint dict and hands it to the strategy, then the commit
(``_checkpoint_commit.commit``) runs in this thread, or in a background thread after staging
(``_background_save``) with ``async_save``. A failure is agreed on by every rank, then skipped or raised
(``on_save_error``). Metrics of each committed save go to the loggers.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from callbacks import _disk_space, _dist, _peers
from callbacks._background_save import BackgroundSave
from callbacks._checkpoint_commit import SaveRecord, commit, remove_leftovers
from mula.checkpoint import checkpoint_name, fsync_tree, remove_path, sync_filesystem, temp_path
from mula.training.lightning_compat import dump_checkpoint
from mula.training.strategy_contract import mula_strategy

log = logging.getLogger(__name__)

SKIPPABLE = ("periodic", "timer")  # saves that have a later chance; preemption and end saves do not


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (raised on every rank; the partial files are removed)."""


class CheckpointSaving:
    """Writing checkpoints (see the module docstring); ``FaultTolerantCheckpoint`` sets the attributes
    and provides ``resolve_dirpath``."""

    async_save: bool
    on_save_error: str
    checksum: Any
    keep_last: int
    last_saved_path: Path | None
    last_save_metrics: dict[str, float]
    _last_saved_step: int
    _previous_saved_step: int
    _last_save_time: float
    _inflight: BackgroundSave | None
    _writer_group: object | None

    def save(self, trainer: pl.Trainer, reason: str = "periodic") -> Path | None:
        """Write a crash-safe checkpoint of the current step (call on every rank at a step boundary).

        Returns its path, or None when a periodic/timed save was skipped (``on_save_error="skip"``).
        Every save first waits for the one in flight. With ``async_save`` a periodic or timed save
        returns once the state is staged in host memory and is committed in the background.
        """
        step = trainer.global_step
        dirpath = self.resolve_dirpath(trainer)
        final = dirpath / checkpoint_name(step)
        self.wait_for_save(trainer)  # at most one save in flight; a preemption waits for it here
        if step == self._last_saved_step and self.last_saved_path == final:
            return final
        _peers.heartbeat(trainer)
        record = SaveRecord(
            step=step,
            epoch=trainer.current_epoch,
            reason=reason,
            world_size=trainer.world_size,
            checksum=self.checksum,
            keep_last=self.keep_last,
            protected=tuple(_peers.protected_steps(trainer)),
            is_global_zero=trainer.is_global_zero,
            start=time.monotonic(),
        )
        tmp = temp_path(final)
        # Rank 0 makes room and checks the free space; broadcasting its verdict makes the others wait for it.
        problem = _dist.broadcast_object(
            self._prepare(trainer, dirpath, tmp) if record.is_global_zero else None
        )
        if problem is not None:
            return self._abandon(trainer, record, problem)

        checkpoint = dump_checkpoint(trainer)  # collective (RNG gather, optimizer consolidation)
        if self._in_background(trainer, reason):
            return self._start_background(trainer, record, checkpoint, tmp, final)
        problem, is_dir = None, False
        try:
            # The strategy decides whether this is one file (rank 0 writes) or a directory of shards.
            trainer.strategy.save_checkpoint(checkpoint, tmp)
            # Durability before the rename: a renamed checkpoint must never point at unflushed data.
            is_dir = tmp.is_dir()
            if is_dir:
                sync_filesystem(tmp)  # each rank flushes the shards it wrote
            elif record.is_global_zero:
                fsync_tree(tmp)
        except Exception as err:  # noqa: BLE001 (any write error: agreed on below, then skipped or raised)
            problem = _dist.describe_error(err)
        del checkpoint
        problem, nbytes = commit(record, tmp, final, problem, is_dir)
        if problem is not None:
            return self._abandon(trainer, record, problem)
        elapsed = time.monotonic() - record.start
        self._committed(trainer, record, final, nbytes, blocking_s=elapsed, total_s=elapsed)
        self._last_save_time = time.monotonic()
        return final

    def _in_background(self, trainer: pl.Trainer, reason: str) -> bool:
        """Whether this save is written asynchronously: periodic and timed saves with ``async_save``, when the
        strategy can (the last saves of a run, preemption and end, have nothing to overlap with)."""
        return self.async_save and reason in SKIPPABLE and mula_strategy(trainer.strategy) is not None

    def _start_background(
        self, trainer: pl.Trainer, record: SaveRecord, checkpoint: dict, tmp: Path, final: Path
    ) -> Path | None:
        """Stage the checkpoint to host memory and leave its writing and commit to a background thread."""
        problem, write = None, None
        try:
            write = trainer.strategy.save_checkpoint_async(checkpoint, tmp, self._writer_group)
        except Exception as err:  # noqa: BLE001 (agreed on below, then skipped or raised)
            problem = _dist.describe_error(err)
        del checkpoint
        problem = _dist.first_problem(_dist.all_gather_object(problem))
        if problem is not None:
            remove_leftovers(record, [tmp])
            return self._abandon(trainer, record, problem)
        blocking = time.monotonic() - record.start
        self._inflight = BackgroundSave(record, tmp, final, write, self._writer_group, blocking)
        self._previous_saved_step, self._last_saved_step = self._last_saved_step, record.step
        self._last_save_time = time.monotonic()
        return final

    def wait_for_save(self, trainer: pl.Trainer) -> None:
        """Wait for the save in flight, if any, and finish it: skip or raise on a failure as a synchronous
        save would. Every rank calls it at the same step boundary (a failure is raised on all of them)."""
        job, self._inflight = self._inflight, None
        if job is None:
            return
        if not job.done():
            rank_zero_info(f"Waiting for the checkpoint of step {job.step} being written in the background.")
        problem, nbytes = job.result()
        if problem is not None:
            self._last_saved_step = self._previous_saved_step  # the end-of-training save must try again
            self._abandon(trainer, job.record, problem)
            return
        self._committed(trainer, job.record, job.final, nbytes, job.blocking_s, job.total_s or 0.0)

    def _finish_if_done(self, trainer: pl.Trainer) -> None:
        """At a step boundary: finish a background save that has committed (no collective; a failed one
        waits for the next save, the same step on every rank, to be raised)."""
        job = self._inflight
        if job is not None and job.done() and job.result()[0] is None:
            self.wait_for_save(trainer)

    def _committed(
        self,
        trainer: pl.Trainer,
        record: SaveRecord,
        final: Path,
        nbytes: int,
        blocking_s: float,
        total_s: float,
    ) -> None:
        """Bookkeeping and metrics of a committed checkpoint."""
        self._last_saved_step = record.step
        self.last_saved_path = final
        _peers.heartbeat(trainer)
        self.last_save_metrics = {
            "checkpoint/save_blocking_s": blocking_s,
            "checkpoint/save_total_s": total_s,
            "checkpoint/bytes": float(nbytes),
        }
        log_metrics(trainer, self.last_save_metrics, record.step)

    def _prepare(self, trainer: pl.Trainer, dirpath: Path, tmp: Path) -> str | None:
        """Rank 0, before a save: remove a stale temporary; the reason the save cannot fit, or None."""
        try:
            dirpath.mkdir(parents=True, exist_ok=True)
            remove_path(tmp)
            return _disk_space.space_problem(dirpath, self._checkpoint_bytes(trainer, dirpath))
        except OSError as err:
            return _dist.describe_error(err)

    def _abandon(self, trainer: pl.Trainer, record: SaveRecord, problem: str) -> None:
        """Every rank, after agreeing that a save failed (its partial files removed): skip or raise."""
        message = f"Checkpoint of step {record.step} not saved: {problem}."
        if self.on_save_error == "raise" or record.reason not in SKIPPABLE:
            raise CheckpointSaveError(message)
        if trainer.is_global_zero:
            log.error("%s Training continues; the next scheduled save will try again.", message)
        self._last_save_time = time.monotonic()
        _peers.heartbeat(trainer)
        return None

    def _checkpoint_bytes(self, trainer: pl.Trainer, dirpath: Path) -> int:
        """The size of the newest checkpoint in ``dirpath``, else an estimate from the model's state."""
        sizes = _disk_space.checkpoint_sizes(dirpath)
        if sizes:
            return sizes[0]
        return _disk_space.estimate_checkpoint_bytes(trainer.lightning_module, trainer.optimizers)

    def _warn_if_short_of_space(self, trainer: pl.Trainer) -> None:
        """Rank 0 at start: warn when ``keep_last + 1`` checkpoints cannot fit in the directory."""
        dirpath = self.resolve_dirpath(trainer)
        try:
            warning = _disk_space.shortage(dirpath, self.keep_last, self._checkpoint_bytes(trainer, dirpath))
        except OSError as err:
            warning = f"Cannot tell the free space of {dirpath}: {err}"
        if warning is not None:
            log.warning(warning)


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    """Hand checkpoint metrics to the loggers (rank 0): also from hooks where ``pl_module.log`` is not allowed."""
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
