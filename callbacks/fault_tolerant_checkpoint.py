"""Crash-safe periodic checkpoints with a manifest, keep-last-K pruning, RNG capture and auto-resume.

Protocol for one save after optimizer step N (every rank takes part):

1. every rank: ``trainer.save_checkpoint(".tmp-step=N.ckpt")`` -- the strategy decides whether this is
   one file (written by rank 0) or a directory of shards (written by all ranks);
2. the data is made durable: rank 0 fsyncs a file; for a directory every rank ``syncfs``-es its own
   writes;
3. rank 0 renames the temporary name to ``step=N.ckpt`` (atomic on POSIX) and fsyncs the directory;
4. the files are hashed (spread over the ranks for a directory) and rank 0 writes
   ``step=N.ckpt.manifest.json`` atomically -- the commit record, written last;
5. rank 0 points the symlink ``last.ckpt`` at it and prunes to the newest ``keep_last`` valid checkpoints.

A crash at any point leaves either no new checkpoint, or one without a manifest, which discovery
(``mula.checkpoint.find_resume_checkpoint``) skips with a warning, falling back to the previous.

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
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from callbacks import _dist
from callbacks.rng_state import capture_rng_state, restore_rng_state
from mula.checkpoint import (
    TMP_PREFIX,
    CheckpointManifest,
    Checksum,
    RunDirLock,
    RunDirLocked,
    Verify,
    atomic_write,
    checkpoint_name,
    digest_entries,
    find_resume_checkpoint,
    fsync_dir,
    fsync_tree,
    iter_valid_checkpoints,
    list_checkpoint_files,
    list_checkpoints,
    manifest_path,
    remove_path,
    replace_path,
    sync_filesystem,
    temp_path,
    verify_checkpoint,
    write_manifest,
)

log = logging.getLogger(__name__)

RNG_KEY = "mula_rng_states"
LAST_LINK = "last.ckpt"  # symlink to the newest checkpoint, for humans and `mula export-hf`


class FaultTolerantCheckpoint(Checkpoint):
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
        lock_stale_after_s: the run-directory lock of a run whose heartbeat is older than this is taken
            over (the holder refreshes it every ``lock_stale_after_s / 10`` s, at most every 30 s).
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
        lock_stale_after_s: float = 300.0,
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
        if lock_stale_after_s <= 0:
            raise ValueError(f"lock_stale_after_s must be > 0, got {lock_stale_after_s}.")
        self.dirpath = dirpath
        self.every_n_steps = every_n_steps
        self.every_n_minutes = every_n_minutes
        self.keep_last = keep_last
        self.checksum: Checksum = checksum
        self.verify: Verify = verify
        self.save_on_train_end = save_on_train_end
        self.lock_stale_after_s = lock_stale_after_s
        self._lock: RunDirLock | None = None
        self.last_saved_path: Path | None = None
        self._last_saved_step = -1
        self._last_step_seen = -1
        self._last_save_time = time.monotonic()
        self._pending_rng: dict[str, Any] | None = None

    # ------------------------------------------------------------------ paths and discovery

    def resolve_dirpath(self, trainer: pl.Trainer) -> Path:
        """The checkpoint directory for ``trainer``."""
        if self.dirpath is not None:
            return Path(self.dirpath)
        return Path(trainer.default_root_dir) / "checkpoints"

    def resume_checkpoint_path(self, trainer: pl.Trainer) -> Path | None:
        """The newest valid checkpoint to auto-resume from (called by ``mula fit`` before training).

        Runs in every process before the process group exists; the choice is deterministic on a
        shared filesystem, and :meth:`on_train_start` verifies that all ranks agreed.
        """
        path = find_resume_checkpoint(self.resolve_dirpath(trainer), self.verify)
        if path is not None:
            rank_zero_info(f"Auto-resuming from {path}.")
        return path

    def latest_valid_checkpoint(self, trainer: pl.Trainer) -> Path | None:
        """The newest valid checkpoint, chosen by rank 0 and agreed by all ranks (a collective)."""
        path = None
        if trainer.is_global_zero:
            path = next(iter(iter_valid_checkpoints(self.resolve_dirpath(trainer), self.verify)), None)
        path = _dist.broadcast_object(str(path.path) if path is not None else None)
        return Path(path) if path is not None else None

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

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Release the run-directory lock at the end of the run."""
        if stage == "fit":
            self._release_lock()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Release the run-directory lock when the run ends by an exception (a crash, preemption's exit 75)."""
        self._release_lock()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check that every rank resumed from the same checkpoint; start the save clock."""
        paths = _dist.all_gather_object(str(trainer.ckpt_path) if trainer.ckpt_path else None)
        if len(set(paths)) > 1:
            raise RuntimeError(
                "Ranks resumed from different checkpoints ("
                + ", ".join(f"rank {i}: {p}" for i, p in enumerate(paths))
                + "); is the checkpoint directory on a filesystem shared by all nodes?"
            )
        self._last_step_seen = trainer.global_step
        self._last_save_time = time.monotonic()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """RNG fence: re-apply the RNG states recorded at the last save/load before the next step."""
        if self._pending_rng is not None:
            restore_rng_state(self._pending_rng, trainer.strategy.root_device)
            self._pending_rng = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Save when a step boundary is due (by step count, or by time agreed across ranks)."""
        step = trainer.global_step
        if step == self._last_step_seen:  # inside a gradient-accumulation window: no optimizer step yet
            return
        self._last_step_seen = step
        due_steps = self.every_n_steps is not None and step % self.every_n_steps == 0
        due_time = False
        if self.every_n_minutes is not None:
            elapsed = time.monotonic() - self._last_save_time
            # Clocks differ between ranks: any rank being due makes every rank save (one tiny all-reduce).
            due_time = _dist.any_rank(elapsed >= 60.0 * self.every_n_minutes, trainer.strategy.root_device)
        if due_steps or due_time:
            self.save(trainer, reason="periodic" if due_steps else "timer")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Final checkpoint."""
        if (
            self.save_on_train_end
            and trainer.global_step != self._last_saved_step
            and trainer.global_step > 0
        ):
            self.save(trainer, reason="end")

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict
    ) -> None:
        """Add every rank's RNG states (gathered to rank 0, which writes the metadata) and arm the fence."""
        local = capture_rng_state(trainer.strategy.root_device)
        self._pending_rng = local
        states = _gather_to_zero(local)
        if states is not None:
            checkpoint[RNG_KEY] = states

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict
    ) -> None:
        """Arm the fence with this rank's saved RNG states."""
        self.apply_rng_from(checkpoint, trainer)

    def state_dict(self) -> dict[str, Any]:
        """The step of the newest save (informational; discovery relies on the manifests)."""
        return {"last_saved_step": self._last_saved_step}

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

    def save(self, trainer: pl.Trainer, reason: str = "periodic") -> Path:
        """Write a crash-safe checkpoint of the current step (call on every rank at a step boundary)."""
        step = trainer.global_step
        dirpath = self.resolve_dirpath(trainer)
        final = dirpath / checkpoint_name(step)
        if step == self._last_saved_step and self.last_saved_path == final:
            return final
        _heartbeat(trainer)
        start = time.monotonic()
        tmp = temp_path(final)
        zero = trainer.is_global_zero
        if zero:
            dirpath.mkdir(parents=True, exist_ok=True)
            remove_path(tmp)
        trainer.strategy.barrier("FaultTolerantCheckpoint.pre_save")

        trainer.save_checkpoint(
            tmp, weights_only=False
        )  # every rank; the strategy decides file vs. sharded directory

        # Durability before the rename: a renamed checkpoint must never point at unflushed data.
        is_dir = _dist.broadcast_object(tmp.is_dir() if zero else None)
        if is_dir:
            sync_filesystem(tmp)  # each rank flushes the shards it wrote
        elif zero:
            fsync_tree(tmp)
        trainer.strategy.barrier("FaultTolerantCheckpoint.synced")

        if zero:
            if final.exists() or manifest_path(final).exists():  # a stale one from an abandoned timeline
                remove_path(manifest_path(final))
                remove_path(final)
            replace_path(tmp, final, sync=False)  # flushed above, by every rank for its own shards
        entries = _dist.broadcast_object(list_checkpoint_files(final) if zero else None)
        if is_dir:  # spread the hashing of a sharded checkpoint over the ranks
            mine = digest_entries(final, entries[_dist.rank() :: _dist.world_size()], self.checksum)
            gathered = _gather_to_zero(mine)
            digested = sorted((e for part in gathered for e in part), key=lambda e: e.path) if zero else []
        else:
            digested = digest_entries(final, entries, self.checksum) if zero else []
        if zero:
            manifest = CheckpointManifest(
                step=step,
                kind="dir" if is_dir else "file",
                checksum=self.checksum,
                files=digested,
                epoch=trainer.current_epoch,
                reason=reason,
                created=time.time(),
                world_size=trainer.world_size,
            )
            write_manifest(final, manifest)
            _point_last_at(dirpath, final)
            self._prune(dirpath, step)
            rank_zero_info(
                f"Saved checkpoint {final} ({manifest.total_bytes / 2**20:.1f} MiB, {reason},"
                f" {time.monotonic() - start:.1f}s)."
            )
        trainer.strategy.barrier("FaultTolerantCheckpoint.saved")
        self._last_saved_step = step
        self.last_saved_path = final
        self._last_save_time = time.monotonic()
        _heartbeat(trainer)
        return final

    def _prune(self, dirpath: Path, step: int) -> None:
        """Keep the newest ``keep_last`` valid checkpoints at or before ``step``; drop older and failed ones.

        Checkpoints after ``step`` belong to another timeline (the run was resumed from an older one)
        and are left alone; a save at the same step replaces them.
        """
        kept = 0
        for entry in list_checkpoints(dirpath):
            if entry.step > step:
                continue
            valid = verify_checkpoint(entry.path, "size") is None
            if valid and kept < self.keep_last:
                kept += 1
                continue
            # The manifest goes first, so that a partly deleted checkpoint never looks valid.
            remove_path(entry.manifest)
            fsync_dir(dirpath)
            remove_path(entry.path)


def _point_last_at(dirpath: Path, final: Path) -> None:
    """Atomically (re)point the convenience symlink ``last.ckpt`` at the newest checkpoint."""
    link = dirpath / LAST_LINK
    try:
        with atomic_write(link) as tmp:
            os.symlink(final.name, tmp)
    except OSError as err:  # a filesystem without symlinks: the manifests are what matter
        log.debug("Could not update %s: %s", link, err)


def _gather_to_zero(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere)."""
    import torch.distributed as dist

    if not _dist.is_distributed():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _heartbeat(trainer: pl.Trainer) -> None:
    """Tell a hang watchdog (any callback with ``heartbeat()``) that slow progress is still progress."""
    for callback in trainer.callbacks:
        beat = getattr(callback, "heartbeat", None)
        if callable(beat):
            beat()


__all__ = ["RNG_KEY", "FaultTolerantCheckpoint"]
