"""The commit half of a checkpoint save: from written files to a committed checkpoint, on every rank.

After the strategy wrote ``.tmp-step=N.ckpt`` (and each rank flushed its part), ``commit`` runs
steps 2-5 of ``FaultTolerantCheckpoint``'s protocol: the ranks agree on any write error, rank 0
renames the temporary into place, the files are hashed (a directory's spread over the ranks), rank 0
writes the manifest -- the commit record, last --, points ``last.ckpt`` at it and prunes. A failure
at any step is agreed on by every rank and rank 0 removes the partial files.

It runs in the training thread for a synchronous save, and in the checkpoint writer's background
thread for an asynchronous one: hence everything it needs is captured in a ``SaveRecord`` at the
step boundary (the trainer moves on meanwhile), and every collective goes over ``group`` (the
writer's own gloo group in the background, the default group otherwise).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from callbacks import _disk_space, _dist
from mula.checkpoint import (
    CheckpointManifest,
    Checksum,
    FileEntry,
    atomic_write,
    digest_entries,
    fsync_dir,
    list_checkpoint_files,
    list_checkpoints,
    manifest_path,
    remove_path,
    replace_path,
    verify_checkpoint,
    write_manifest,
)

log = logging.getLogger(__name__)

LAST_LINK = "last.ckpt"  # symlink to the newest checkpoint, for humans and `mula export-hf`


@dataclass(frozen=True)
class SaveRecord:
    """What committing the save of one step needs, taken from the trainer at the step boundary."""

    step: int
    epoch: int
    reason: str
    world_size: int
    checksum: Checksum
    keep_last: int
    protected: tuple[int, ...]  # steps whose newest checkpoint at or before them pruning keeps
    is_global_zero: bool
    start: float  # time.monotonic() when the save began


def remove_leftovers(record: SaveRecord, leftovers: Iterable[Path]) -> None:
    """Rank 0, after the ranks agreed that a save failed: remove its partial files."""
    if not record.is_global_zero:
        return
    for path in leftovers:
        try:
            remove_path(path)
        except OSError as err:
            log.error("Could not remove %s of the failed save: %s", path, _dist.describe_error(err))


def commit(
    record: SaveRecord, tmp: Path, final: Path, problem: str | None, is_dir: bool, group: object = None
) -> tuple[str | None, int]:
    """Every rank, after writing (``problem``: this rank's write error): agree, rename, hash, write the
    manifest. Returns (the problem every rank agreed on, or None; the checkpoint's bytes)."""
    zero = record.is_global_zero
    reports = _dist.all_gather_object((problem, is_dir), group)
    problem, is_dir = _dist.first_problem([r[0] for r in reports]), reports[0][1]  # rank 0 wrote a file
    if problem is not None:
        remove_leftovers(record, [tmp])
        return problem, 0

    # Rank 0 renames into place and lists the files; every rank gets the list (or rank 0's error).
    entries = _dist.broadcast_object(
        _dist.attempt(lambda: commit_rename(tmp, final)) if zero else None, group=group
    )
    if isinstance(entries, str):
        remove_leftovers(record, [tmp, manifest_path(final), final])
        return entries, 0
    if is_dir:  # spread the hashing of a sharded checkpoint over the ranks
        share = entries[_dist.rank() :: _dist.world_size()]
        mine = _dist.attempt(lambda: digest_entries(final, share, record.checksum))
        gathered = _dist.gather_to_zero(mine, group)
    else:
        gathered = [_dist.attempt(lambda: digest_entries(final, entries, record.checksum))] if zero else None
    outcome: tuple[str | None, int] = (None, 0)
    if zero:
        failed = _dist.first_problem([g for g in gathered if isinstance(g, str)])
        if failed is not None:
            outcome = (failed, 0)
        else:
            digested = sorted((e for part in gathered for e in part), key=lambda e: e.path)
            written = _dist.attempt(lambda: write_commit_record(record, final, digested, is_dir))
            outcome = (written, 0) if isinstance(written, str) else (None, written)
    problem, nbytes = _dist.broadcast_object(outcome, group=group)
    if problem is not None:
        remove_leftovers(record, [manifest_path(final), final])
    return problem, nbytes


def commit_rename(tmp: Path, final: Path) -> list[FileEntry]:
    """Rank 0: move the flushed temporary to its final name; its files (for the manifest)."""
    if final.exists() or manifest_path(final).exists():  # a stale one from an abandoned timeline
        remove_path(manifest_path(final))
        remove_path(final)
    replace_path(tmp, final, sync=False)  # flushed before, by every rank for its own shards
    return list_checkpoint_files(final)


def write_commit_record(record: SaveRecord, final: Path, digested: list[FileEntry], is_dir: bool) -> int:
    """Rank 0: write the manifest, point ``last.ckpt`` at it, prune; the checkpoint's bytes."""
    manifest = CheckpointManifest(
        step=record.step,
        kind="dir" if is_dir else "file",
        checksum=record.checksum,
        files=digested,
        epoch=record.epoch,
        reason=record.reason,
        created=time.time(),
        world_size=record.world_size,
    )
    write_manifest(final, manifest)
    dirpath = final.parent
    point_last_at(dirpath, final)
    try:
        prune(dirpath, record.step, record.keep_last, record.protected)
    except OSError as err:  # the checkpoint is committed; an old one left behind is no reason to fail
        log.warning("Could not prune old checkpoints in %s: %s", dirpath, _dist.describe_error(err))
    rank_zero_info(
        f"Saved checkpoint {final} ({_disk_space.mib(manifest.total_bytes)}, {record.reason},"
        f" {time.monotonic() - record.start:.1f}s)."
    )
    return manifest.total_bytes


def prune(dirpath: Path, step: int, keep_last: int, protected: Iterable[int] = ()) -> None:
    """Keep the newest ``keep_last`` valid checkpoints at or before ``step``, and for each step in
    ``protected`` the newest valid checkpoint at or before it; drop older and failed ones.

    Checkpoints after ``step`` belong to another timeline (the run was resumed from an older one)
    and are left alone; a save at the same step replaces them.
    """
    entries = [e for e in list_checkpoints(dirpath) if e.step <= step]
    valid = [e.step for e in entries if verify_checkpoint(e.path, "size") is None]  # newest first
    keep = set(valid[:keep_last])
    for bound in protected:
        keep.update(next(([s] for s in valid if s <= bound), []))
    for entry in entries:
        if entry.step in keep:
            continue
        # The manifest goes first, so that a partly deleted checkpoint never looks valid.
        remove_path(entry.manifest)
        fsync_dir(dirpath)
        remove_path(entry.path)


def point_last_at(dirpath: Path, final: Path) -> None:
    """Atomically (re)point the convenience symlink ``last.ckpt`` at the newest checkpoint."""
    link = dirpath / LAST_LINK
    try:
        with atomic_write(link) as tmp:
            os.symlink(final.name, tmp)
    except OSError as err:  # a filesystem without symlinks: the manifests are what matter
        log.debug("Could not update %s: %s", link, err)
