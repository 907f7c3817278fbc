"""Crash-safe periodic checkpoints with a manifest, keep-last-K pruning, RNG capture and auto-resume.

Protocol for one save after optimizer step N (every rank takes part):

0. rank 0 removes a stale ``.tmp-step=N.ckpt`` and checks that a checkpoint the size of the last one fits;
1. every rank: Lightning's checkpoint dict goes to ``strategy.save_checkpoint(".tmp-step=N.ckpt")`` --
   the strategy decides whether this is one file (written by rank 0) or a directory of shards
   (written by all ranks);
2. the data is made durable: rank 0 fsyncs a file; for a directory every rank ``syncfs``-es its own
   writes;
3. rank 0 renames the temporary name to ``step=N.ckpt`` (atomic on POSIX) and fsyncs the directory;
4. the files are hashed (spread over the ranks for a directory) and rank 0 writes
   ``step=N.ckpt.manifest.json`` atomically -- the commit record, written last;
5. rank 0 points the symlink ``last.ckpt`` at it and prunes to the newest ``keep_last`` valid checkpoints
   (plus protected ones, below).

A crash at any point leaves either no new checkpoint, or one without a manifest, which discovery
(``mula.checkpoint.find_resume_checkpoint``) skips with a warning, falling back to the previous.
An error (a full disk) is agreed on by all ranks after each phase, so that no rank waits forever in
a collective the failed one never reaches; rank 0 then removes the partial files and every rank
skips the save or raises ``CheckpointSaveError`` (``on_save_error``). Before writing, rank 0 checks
that the directory has room for a checkpoint the size of the last one. Steps 2-5 are
``callbacks._checkpoint_commit.commit``.

Asynchronous saves (``async_save=True``, with a strategy offering ``save_checkpoint_async``:
``XPUMoEStrategy``): step 1 stages the state into host memory and returns; a background thread
writes the files and runs steps 2-5 over a gloo group of its own (``callbacks._background_save``),
so the manifest is still written last, after every rank's write finished. At most one save is in
flight: the next save, a rollback, a preemption and the end of training wait for it first.
Preemption and end-of-training saves are synchronous.

Anomaly streaks: callbacks offering ``blocks_checkpoint()`` (true while periodic saves must wait,
e.g. ``AnomalyGuard`` inside a streak of skipped steps) defer periodic saves to the first step
boundary where none blocks; callbacks offering ``protected_step()`` (a step or None) keep the
newest checkpoint at or before that step from being pruned. Both are duck-typed, like ``heartbeat()``.

One run at a time: global rank 0 holds the run-directory lock (``mula.checkpoint.lock``) from
``setup`` (or earlier, ``mula fit``) to the end of the run; a second run on the same directory stops
in ``setup`` on every rank, before it removes or writes anything in the checkpoint directory.

Exact resume: the checkpoint also carries every rank's RNG states. They are re-applied at the first
training batch after the save, both in the resumed run and in the run that saved ("RNG fence"), so
anything that draws random numbers between two steps (validation, iterator creation) cannot make
the two runs diverge.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from callbacks import _dist, _peers
from callbacks._background_save import BackgroundSave, writer_group
from callbacks._checkpoint_save import CheckpointSaveError, CheckpointSaving, log_metrics
from callbacks.rng_state import capture_rng_state, restore_rng_state
from mula.checkpoint import (
    TMP_PREFIX,
    Checksum,
    RunDirLock,
    RunDirLocked,
    Verify,
    find_resume_checkpoint,
    iter_valid_checkpoints,
    remove_path,
)
from mula.checkpoint.group_verify import add_verify_time, verify_on_ranks, verify_time
from mula.training.step_boundary import StepBoundary
from mula.training.strategy_contract import mula_strategy

log = logging.getLogger(__name__)

RNG_KEY = "mula_rng_states"
OnSaveError = Literal["skip", "raise"]


class FaultTolerantCheckpoint(CheckpointSaving, Checkpoint):
    """Crash-safe checkpoints every N optimizer steps and/or T minutes, plus auto-resume support.

    Args:
        dirpath: where checkpoints go; default ``<trainer.default_root_dir>/checkpoints`` (stable
            across restarts, unlike a logger's version directory).
        every_n_steps: save after every N-th optimizer step (None: never by step count).
        every_n_minutes: save at the first step boundary T minutes after the previous save (None: never).
        keep_last: how many valid checkpoints to keep.
        checksum: per-file checksum in the manifest: "sha256", "crc32" (faster) or "none" (sizes only).
        verify: what auto-resume and rollback check: "checksum" (re-hash every file) or "size"
            (manifest complete and sizes match; cheap for very large sharded checkpoints).
        save_on_train_end: also save when training finishes.
        on_save_error: what a periodic or timed save that cannot be written (not enough free space, a
            write error) does: "skip" (default) logs an error on rank 0 and training continues until
            the next scheduled save; "raise" stops the run with ``CheckpointSaveError``. Preemption and
            end-of-training saves always raise: they have no later chance.
        lock_stale_after_s: the run-directory lock of a run whose heartbeat is older than this is taken
            over (the holder refreshes it every ``lock_stale_after_s / 10`` s, at most every 30 s).
        async_save: write periodic and timed saves in the background (staged to host memory first:
            the host needs room for one copy of each rank's checkpoint state, which ``mula plan``
            counts in its host bytes); needs a strategy that writes sharded checkpoints
            (``XPUMoEStrategy``), others save synchronously with a warning.

    Metrics (rank 0, at the step of each committed save): ``checkpoint/save_blocking_s`` (how long
    training stopped), ``checkpoint/save_total_s`` (until committed), ``checkpoint/bytes``; at the
    start of a resumed run ``checkpoint/verify_s``, the time spent verifying the checkpoint.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_steps: int | None = 1000,
        every_n_minutes: float | None = None,
        keep_last: int = 3,
        checksum: Checksum = "sha256",
        verify: Verify = "checksum",
        save_on_train_end: bool = True,
        on_save_error: OnSaveError = "skip",
        lock_stale_after_s: float = 300.0,
        async_save: bool = False,
    ) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 or None, got {every_n_steps}.")
        if every_n_minutes is not None and every_n_minutes <= 0:
            raise ValueError(f"every_n_minutes must be > 0 or None, got {every_n_minutes}.")
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}.")
        if checksum not in ("sha256", "crc32", "none"):
            raise ValueError(f"checksum must be 'sha256', 'crc32' or 'none', got {checksum!r}.")
        if verify not in ("checksum", "size"):
            raise ValueError(f"verify must be 'checksum' or 'size', got {verify!r}.")
        if on_save_error not in ("skip", "raise"):
            raise ValueError(f"on_save_error must be 'skip' or 'raise', got {on_save_error!r}.")
        if lock_stale_after_s <= 0:
            raise ValueError(f"lock_stale_after_s must be > 0, got {lock_stale_after_s}.")
        self.dirpath = dirpath
        self.every_n_steps = every_n_steps
        self.every_n_minutes = every_n_minutes
        self.keep_last = keep_last
        self.checksum: Checksum = checksum
        self.verify: Verify = verify
        self.save_on_train_end = save_on_train_end
        self.on_save_error: OnSaveError = on_save_error
        self.lock_stale_after_s = lock_stale_after_s
        self.async_save = bool(async_save)
        self._writer_group: object | None = None  # the background writer's gloo group (setup)
        self._inflight: BackgroundSave | None = None
        self._previous_saved_step = -1
        self.last_save_metrics: dict[str, float] = {}
        self._lock: RunDirLock | None = None
        self.last_saved_path: Path | None = None
        self._last_saved_step = -1
        self._steps = StepBoundary()
        self._last_save_time = time.monotonic()
        self._pending_rng: dict[str, Any] | None = None
        self._deferred: str | None = None  # reason of a save that was due while a callback blocked saves

    # ------------------------------------------------------------------ paths and discovery

    def resolve_dirpath(self, trainer: pl.Trainer) -> Path:
        """The checkpoint directory for ``trainer``."""
        if self.dirpath is not None:
            return Path(self.dirpath)
        return Path(trainer.default_root_dir) / "checkpoints"

    def resume_checkpoint_path(self, trainer: pl.Trainer) -> Path | None:
        """The newest valid checkpoint to auto-resume from (called by ``mula fit`` before training).

        Runs in every process before the process group exists; the choice is deterministic on a
        shared filesystem, and :meth:`on_train_start` verifies that all ranks agreed. With several
        ranks, a sharded checkpoint is chosen by its manifest and sizes, and its checksums are verified
        by one reader per file when the strategy loads it (``mula.checkpoint.group_verify``).
        """
        defer = trainer.world_size > 1
        start = time.monotonic()
        path = find_resume_checkpoint(self.resolve_dirpath(trainer), self.verify, defer_sharded=defer)
        add_verify_time(time.monotonic() - start)
        if path is not None:
            rank_zero_info(f"Auto-resuming from {path}.")
        return path

    def latest_valid_checkpoint(self, trainer: pl.Trainer, at_or_before: int | None = None) -> Path | None:
        """The newest valid checkpoint (of a step ``<= at_or_before`` if given), chosen by rank 0 and
        agreed by all ranks (a collective)."""
        self.wait_for_save(trainer)  # the newest checkpoint may still be committing in the background
        dirpath = _dist.broadcast_object(str(self.resolve_dirpath(trainer)))
        # every rank verifies, each file read by one of them (a collective per candidate)
        candidates = iter_valid_checkpoints(
            dirpath, self.verify, warn=trainer.is_global_zero, verifier=verify_on_ranks
        )
        found = next((e for e in candidates if at_or_before is None or e.step <= at_or_before), None)
        return found.path if found is not None else None

    # ------------------------------------------------------------------ Lightning hooks

    def lock_run_dir(self, trainer: pl.Trainer) -> None:
        """Take the run-directory lock (global rank 0; idempotent); raises ``RunDirLocked`` if another run has it."""
        if self._lock is None or not self._lock.held:
            stale = self.lock_stale_after_s
            self._lock = RunDirLock(
                trainer.default_root_dir, stale_after_s=stale, heartbeat_s=min(30.0, stale / 10)
            )
        self._lock.acquire()

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Lock the run directory (rank 0; every rank stops if it is taken), then remove crashed saves' temporaries.

        The lock comes first: the temporaries may be a live run's save in progress.
        """
        if stage != "fit":
            return
        refusal = None
        if trainer.is_global_zero:
            try:
                self.lock_run_dir(trainer)
            except RunDirLocked as err:
                refusal = str(err)
        refusal = _dist.broadcast_object(refusal)  # the other ranks stop too, instead of waiting for rank 0
        if refusal is not None:
            raise RunDirLocked(refusal)
        dirpath = self.resolve_dirpath(trainer)
        if trainer.is_global_zero and dirpath.is_dir():
            for child in dirpath.iterdir():
                if child.name.startswith(TMP_PREFIX):
                    log.info("Removing %s left by an interrupted save.", child)
                    remove_path(child)
        trainer.strategy.barrier("FaultTolerantCheckpoint.setup")
        if self.async_save:
            if mula_strategy(trainer.strategy) is not None:  # it saves asynchronously (save_checkpoint_async)
                self._writer_group = writer_group()  # a collective: every rank is here
            else:
                rank_zero_warn(
                    f"async_save: {type(trainer.strategy).__name__} has no asynchronous save"
                    " (XPUMoEStrategy's sharded checkpoints do); its checkpoints are written synchronously."
                )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Release the run-directory lock at the end of the run."""
        if stage == "fit":
            self._release_lock()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Release the run-directory lock when the run ends by an exception (a crash, preemption's exit 75)."""
        self._release_lock()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check that every rank resumed from the same checkpoint; start the save clock."""
        paths = _dist.all_gather_object(str(trainer.ckpt_path) if trainer.ckpt_path else None)
        if len(set(paths)) > 1:
            raise RuntimeError(
                "Ranks resumed from different checkpoints ("
                + ", ".join(f"rank {i}: {p}" for i, p in enumerate(paths))
                + "); is the checkpoint directory on a filesystem shared by all nodes?"
            )
        self._steps.start(trainer)
        self._last_save_time = time.monotonic()
        if trainer.is_global_zero:
            self._warn_if_short_of_space(trainer)
        if paths[0] is not None:  # how long the restart spent verifying (the slowest rank's time)
            seconds = _dist.all_reduce([verify_time()], "max", trainer.strategy.root_device)[0]
            rank_zero_info(f"Verified the checkpoint to resume from in {seconds:.2f}s.")
            log_metrics(trainer, {"checkpoint/verify_s": seconds}, trainer.global_step)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """RNG fence: re-apply the RNG states recorded at the last save/load before the next step."""
        if self._pending_rng is not None:
            restore_rng_state(self._pending_rng, trainer.strategy.root_device)
            self._pending_rng = None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Save when a step boundary is due (by step count, or by time agreed across ranks)."""
        if not self._steps.crossed(trainer):  # inside a gradient-accumulation window: no optimizer step yet
            return
        step = trainer.global_step
        self._finish_if_done(trainer)
        due_steps = self.every_n_steps is not None and step % self.every_n_steps == 0
        due_time = False
        if self.every_n_minutes is not None:
            elapsed = time.monotonic() - self._last_save_time
            # Clocks differ between ranks: any rank being due makes every rank save (one tiny all-reduce).
            due_time = _dist.any_rank(elapsed >= 60.0 * self.every_n_minutes, trainer.strategy.root_device)
        if due_steps or due_time:
            reason = "periodic" if due_steps else "timer"
        elif self._deferred is not None:
            reason = self._deferred
        else:
            return
        if _dist.any_rank(_peers.saves_blocked(trainer), trainer.strategy.root_device):
            if self._deferred is None:
                rank_zero_info(
                    f"Checkpoint of step {step} deferred: inside a streak of anomalous steps, saved at the"
                    " first step boundary after it."
                )
            self._deferred = reason
            return
        self._deferred = None
        self.save(trainer, reason=reason)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Final checkpoint (after the save in flight, if any, committed)."""
        self.wait_for_save(trainer)
        if (
            self.save_on_train_end
            and trainer.global_step != self._last_saved_step
            and trainer.global_step > 0
        ):
            self.save(trainer, reason="end")

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict
    ) -> None:
        """Add every rank's RNG states (gathered to rank 0, which writes the metadata) and arm the fence."""
        local = capture_rng_state(trainer.strategy.root_device)
        self._pending_rng = local
        states = _dist.gather_to_zero(local)
        if states is not None:
            checkpoint[RNG_KEY] = states

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict
    ) -> None:
        """Arm the fence with this rank's saved RNG states."""
        self.apply_rng_from(checkpoint, trainer)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The step of the newest save (informational; discovery relies on the manifests)."""
        return {"last_saved_step": self._last_saved_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self._last_saved_step = int(state_dict.get("last_saved_step", -1))

    # ------------------------------------------------------------------ saving

    def apply_rng_from(self, checkpoint: dict, trainer: pl.Trainer) -> None:
        """Arm the RNG fence with this rank's states from a loaded checkpoint dict."""
        states = checkpoint.get(RNG_KEY)
        rank = trainer.global_rank
        if not states:
            log.warning(
                "Checkpoint has no RNG states; the resumed run will not reproduce the original exactly."
            )
        elif rank >= len(states):
            log.warning(
                "Checkpoint holds RNG states for %d ranks, this is rank %d: its RNG keeps the seeded state.",
                len(states),
                rank,
            )
        else:
            self._pending_rng = states[rank]


__all__ = ["RNG_KEY", "CheckpointSaveError", "FaultTolerantCheckpoint"]
