"""Checkpoint files: durable writes, manifests, discovery, Mula weights files and sharded directories.

A checkpoint is whatever ``strategy.save_checkpoint`` writes at one path: a single file (DDP and
single-device strategies; a Lightning ``.ckpt``) or a directory of shards (``sharded``: DCP files
plus ``meta.pt``, as the expert-parallel strategy writes).

The completion marker -- one for every kind of checkpoint -- is the manifest
``<checkpoint>.manifest.json`` (``manifest``): it lists every file with its size and checksum and is
written last, atomically, by ``callbacks.FaultTolerantCheckpoint`` after the data is durable and
renamed into place. A checkpoint without a valid manifest is by construction incomplete, and
discovery and auto-resume (``discovery``) only ever pick checkpoints whose manifest verifies.
``meta.pt`` in a sharded directory is only the non-tensor part of the checkpoint, not a marker.
Readers given an explicit path by the user (``load_weights``, ``mula export-hf``, ``init_weights``,
``--ckpt_path``) verify it first (``reading.verify_for_reading``): one with a manifest must match it,
a ``step=N.ckpt`` must have one, and any other checkpoint without one (e.g. from
``trainer.save_checkpoint``) is read with a warning that it cannot be verified.

Modules, one job each: ``atomic`` (the one temp-then-rename-with-fsync write helper, used for every
such write in the repository), ``manifest``, ``discovery``, ``weights`` (Mula weights files and
reading any checkpoint's weights), ``sharded`` (the sharded directory format, consolidation),
``reading`` (verification on every read of a user-named checkpoint), ``lock`` (the run-directory
lock: one training run at a time per run directory).

Torch-free to import: ``atomic``, ``lock`` and ``manifest`` (torch-free themselves) are imported here; the
names of the other modules, which import torch, load their module on first use (``__getattr__``). A process
that only writes files or takes the lock (`mula prepare` and each tokenizer worker process it spawns) then
starts in a fraction of a second instead of importing torch and the model for nothing (~3 s of CPU).
"""

from typing import Any

from mula.checkpoint.atomic import (
    TMP_PREFIX,
    atomic_write,
    atomic_write_text,
    fsync_dir,
    fsync_file,
    fsync_tree,
    remove_path,
    replace_path,
    sync_filesystem,
    temp_path,
)
from mula.checkpoint.lock import RunDirLock, RunDirLocked, lock_run_dir_before_launch
from mula.checkpoint.manifest import (
    CheckpointManifest,
    Checksum,
    FileEntry,
    Verify,
    build_manifest,
    digest_entries,
    list_checkpoint_files,
    manifest_path,
    read_manifest,
    verify_checkpoint,
    write_manifest,
)

# the names of the modules that import torch, by module: imported on first use
_DISCOVERY = {
    "CheckpointEntry",
    "NoValidCheckpoint",
    "auto_resume_ckpt_path",
    "checkpoint_name",
    "find_resume_checkpoint",
    "is_checkpoint_name",
    "iter_valid_checkpoints",
    "list_checkpoints",
}
_READING = {"check_ckpt_path", "verify_for_reading"}
_SHARDED = {"is_sharded_checkpoint", "read_sharded_checkpoint"}
_WEIGHTS = {"load_weights", "model_from_state_dict", "read_checkpoint", "save_weights"}


def __getattr__(name: str) -> Any:
    if name in _DISCOVERY:
        from mula.checkpoint import discovery as module
    elif name in _READING:
        from mula.checkpoint import reading as module
    elif name in _SHARDED:
        from mula.checkpoint import sharded as module
    elif name in _WEIGHTS:
        from mula.checkpoint import weights as module
    elif name == "consolidate_checkpoint":
        from mula.checkpoint import consolidate as module
    else:
        raise AttributeError(f"module 'mula.checkpoint' has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "TMP_PREFIX",
    "CheckpointEntry",
    "CheckpointManifest",
    "Checksum",
    "FileEntry",
    "NoValidCheckpoint",
    "RunDirLock",
    "RunDirLocked",
    "Verify",
    "atomic_write",
    "atomic_write_text",
    "auto_resume_ckpt_path",
    "build_manifest",
    "check_ckpt_path",
    "checkpoint_name",
    "consolidate_checkpoint",
    "digest_entries",
    "find_resume_checkpoint",
    "fsync_dir",
    "fsync_file",
    "fsync_tree",
    "is_checkpoint_name",
    "is_sharded_checkpoint",
    "iter_valid_checkpoints",
    "list_checkpoint_files",
    "list_checkpoints",
    "lock_run_dir_before_launch",
    "load_weights",
    "manifest_path",
    "model_from_state_dict",
    "read_checkpoint",
    "read_manifest",
    "read_sharded_checkpoint",
    "remove_path",
    "replace_path",
    "save_weights",
    "sync_filesystem",
    "temp_path",
    "verify_checkpoint",
    "verify_for_reading",
    "write_manifest",
]
