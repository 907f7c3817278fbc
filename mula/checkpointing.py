"""Crash-safe checkpoint files: durability helpers, manifests, verification and discovery.

A checkpoint is whatever ``strategy.save_checkpoint`` writes at one path: a single file (DDP and
single-device strategies) or a directory of shards (``torch.distributed.checkpoint``). Next to it,
a manifest ``<checkpoint>.manifest.json`` lists every file with its size and checksum. The writer
(``callbacks.FaultTolerantCheckpoint``) makes the data durable and renames it into place *before*
writing the manifest, so a checkpoint without a valid manifest is by construction incomplete.

This module holds the generic, Lightning-free part so that the CLI can find the checkpoint to
resume from without importing ``callbacks`` (mula never imports callbacks; see DESIGN.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import logging
import os
import re
import shutil
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

MANIFEST_SUFFIX = ".manifest.json"
MANIFEST_FORMAT = "mula-checkpoint-manifest"
MANIFEST_VERSION = 1
CHECKPOINT_SUFFIX = ".ckpt"
TMP_PREFIX = ".tmp-"
_NAME_RE = re.compile(r"^step=(\d+)\.ckpt$")
_CHUNK = 8 << 20

Checksum = Literal["sha256", "crc32", "none"]
Verify = Literal["checksum", "size"]


def checkpoint_name(step: int) -> str:
    """The file (or directory) name of the checkpoint taken after optimizer step ``step``."""
    return f"step={step:09d}{CHECKPOINT_SUFFIX}"


def manifest_path(checkpoint: str | os.PathLike) -> Path:
    """Where the manifest of ``checkpoint`` lives (a sibling file, for file and directory checkpoints alike)."""
    checkpoint = Path(checkpoint)
    return checkpoint.with_name(checkpoint.name + MANIFEST_SUFFIX)


# --------------------------------------------------------------------------------------------------
# Durability
# --------------------------------------------------------------------------------------------------


def fsync_file(path: str | os.PathLike) -> None:
    """Flush one file's data and metadata to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (needed after creating, renaming or deleting files in it)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # some filesystems do not allow opening directories
        return
    try:
        os.fsync(fd)
    except OSError:  # fsync on a directory is not supported everywhere (EINVAL); nothing more we can do
        pass
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync a file, or every file and directory below a directory (bottom-up)."""
    path = Path(path)
    if path.is_file():
        fsync_file(path)
        return
    for root, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            fsync_file(os.path.join(root, name))
        fsync_dir(root)


_libc: Any = None


def sync_filesystem(path: str | os.PathLike) -> None:
    """Flush everything this node wrote to the filesystem holding ``path`` (``syncfs``), or fsync the tree.

    Used for sharded checkpoints, where each rank wrote files the others cannot name: every rank
    calling ``syncfs`` flushes its own writes without knowing which files they were.
    """
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name, use_errno=True) if name else False
    if _libc and hasattr(_libc, "syncfs"):
        fd = os.open(path, os.O_RDONLY)
        try:
            if _libc.syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    fsync_tree(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see either the old or the complete new content."""
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def remove_path(path: str | os.PathLike) -> None:
    """Delete a file or a directory tree if it exists."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


# --------------------------------------------------------------------------------------------------
# Manifests
# --------------------------------------------------------------------------------------------------


@dataclass
class FileEntry:
    """One file of a checkpoint: path relative to the checkpoint ("" for a single-file checkpoint)."""

    path: str
    size: int
    digest: str = ""


@dataclass
class CheckpointManifest:
    """What was written: enough to tell a complete checkpoint from a truncated or damaged one."""

    step: int
    kind: Literal["file", "dir"]
    checksum: Checksum
    files: list[FileEntry] = field(default_factory=list)
    epoch: int = 0
    reason: str = "periodic"
    created: float = 0.0
    world_size: int = 1
    format: str = MANIFEST_FORMAT
    version: int = MANIFEST_VERSION

    @property
    def total_bytes(self) -> int:
        """Sum of the sizes of all files."""
        return sum(f.size for f in self.files)

    def to_json(self) -> str:
        """Serialise (stable key order, one entry per line for readability)."""
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CheckpointManifest:
        """Parse a manifest; raises ValueError if it is not one of ours."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"not valid JSON ({err.msg})") from None
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise ValueError("not a Mula checkpoint manifest")
        if data.get("version") != MANIFEST_VERSION:
            raise ValueError(f"unsupported manifest version {data.get('version')!r}")
        try:
            files = [FileEntry(**f) for f in data.pop("files")]
            return cls(files=files, **data)
        except (TypeError, KeyError) as err:
            raise ValueError(f"malformed manifest ({err})") from None


def file_digest(path: str | os.PathLike, checksum: Checksum) -> str:
    """Hex digest of a file's content ("" when ``checksum`` is "none")."""
    if checksum == "none":
        return ""
    if checksum == "sha256":
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        return h.hexdigest()
    if checksum == "crc32":
        crc = 0
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
        return f"{crc:08x}"
    raise ValueError(f"Unknown checksum {checksum!r}; expected 'sha256', 'crc32' or 'none'.")


def list_checkpoint_files(checkpoint: str | os.PathLike) -> list[FileEntry]:
    """The files of a checkpoint with their sizes (no digests), in a stable order."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_file():
        return [FileEntry("", checkpoint.stat().st_size)]
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"Checkpoint {checkpoint} does not exist.")
    entries = []
    for root, dirs, files in os.walk(checkpoint):
        dirs.sort()
        for name in sorted(files):
            full = Path(root, name)
            entries.append(FileEntry(full.relative_to(checkpoint).as_posix(), full.stat().st_size))
    return entries


def _resolve(checkpoint: Path, entry: FileEntry) -> Path:
    return checkpoint / entry.path if entry.path else checkpoint


def digest_entries(
    checkpoint: str | os.PathLike, entries: Iterable[FileEntry], checksum: Checksum
) -> list[FileEntry]:
    """Fill in the digests of ``entries`` (a subset of a checkpoint's files)."""
    checkpoint = Path(checkpoint)
    return [FileEntry(e.path, e.size, file_digest(_resolve(checkpoint, e), checksum)) for e in entries]


def build_manifest(
    checkpoint: str | os.PathLike, step: int, checksum: Checksum = "sha256", **meta: Any
) -> CheckpointManifest:
    """Describe an existing checkpoint (single process; the callback distributes the hashing instead)."""
    checkpoint = Path(checkpoint)
    entries = digest_entries(checkpoint, list_checkpoint_files(checkpoint), checksum)
    kind = "dir" if checkpoint.is_dir() else "file"
    return CheckpointManifest(
        step=step, kind=kind, checksum=checksum, files=entries, created=time.time(), **meta
    )


def write_manifest(checkpoint: str | os.PathLike, manifest: CheckpointManifest) -> Path:
    """Atomically write the manifest of ``checkpoint``; it is the commit record, so write it last."""
    path = manifest_path(checkpoint)
    atomic_write_text(path, manifest.to_json())
    return path


def read_manifest(checkpoint: str | os.PathLike) -> CheckpointManifest:
    """Read the manifest of ``checkpoint``; FileNotFoundError if absent, ValueError if unreadable."""
    path = manifest_path(checkpoint)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"Checkpoint {checkpoint} has no manifest {path.name}.") from None
    except UnicodeDecodeError:
        raise ValueError(f"Manifest {path} is not text.") from None
    try:
        return CheckpointManifest.from_json(text)
    except ValueError as err:
        raise ValueError(f"Manifest {path} is invalid: {err}.") from None


def verify_checkpoint(checkpoint: str | os.PathLike, verify: Verify = "checksum") -> str | None:
    """Check a checkpoint against its manifest. Returns None if valid, else why it is not (one sentence).

    ``verify="size"`` checks presence and sizes only (detects incomplete and truncated checkpoints
    without reading them); ``"checksum"`` also re-hashes every file (detects damaged content).
    """
    if verify not in ("checksum", "size"):
        raise ValueError(f"Unknown verify mode {verify!r}; expected 'checksum' or 'size'.")
    checkpoint = Path(checkpoint)
    try:
        manifest = read_manifest(checkpoint)
    except (FileNotFoundError, ValueError) as err:
        return f"{err} (the save did not complete)" if isinstance(err, FileNotFoundError) else str(err)
    if not checkpoint.exists():
        return f"{checkpoint} is listed by its manifest but does not exist"
    if manifest.kind == "file" and not checkpoint.is_file():
        return f"{checkpoint} should be a file"
    if manifest.kind == "dir" and not checkpoint.is_dir():
        return f"{checkpoint} should be a directory"
    for entry in manifest.files:
        path = _resolve(checkpoint, entry)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"{path} is missing"
        if size != entry.size:
            return f"{path} has {size} bytes, the manifest says {entry.size} (truncated or overwritten)"
    if verify == "checksum" and manifest.checksum != "none":
        for entry in manifest.files:
            path = _resolve(checkpoint, entry)
            if file_digest(path, manifest.checksum) != entry.digest:
                return f"{path} does not match its {manifest.checksum} checksum (corrupted)"
    return None


# --------------------------------------------------------------------------------------------------
# Discovery
# --------------------------------------------------------------------------------------------------


@dataclass
class CheckpointEntry:
    """A checkpoint found in a directory (valid or not)."""

    step: int
    path: Path

    @property
    def manifest(self) -> Path:
        """Its manifest path."""
        return manifest_path(self.path)


def list_checkpoints(dirpath: str | os.PathLike) -> list[CheckpointEntry]:
    """All checkpoints named ``step=N.ckpt`` in ``dirpath`` (with or without a manifest), newest first."""
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return []
    found: dict[int, CheckpointEntry] = {}
    for child in dirpath.iterdir():
        name = child.name
        name = name.removesuffix(MANIFEST_SUFFIX)
        match = _NAME_RE.match(name)
        if match:
            step = int(match.group(1))
            found[step] = CheckpointEntry(step, dirpath / name)
    return sorted(found.values(), key=lambda e: e.step, reverse=True)


def iter_valid_checkpoints(
    dirpath: str | os.PathLike, verify: Verify = "checksum", warn: bool = True
) -> Iterator[CheckpointEntry]:
    """Yield the valid checkpoints of ``dirpath``, newest first, warning about each invalid one passed over."""
    for entry in list_checkpoints(dirpath):
        problem = verify_checkpoint(entry.path, verify)
        if problem is None:
            yield entry
        elif warn:
            log.warning("Skipping checkpoint %s: %s.", entry.path, problem)


def find_resume_checkpoint(dirpath: str | os.PathLike, verify: Verify = "checksum") -> Path | None:
    """The newest valid checkpoint in ``dirpath``, or None. Invalid newer ones are skipped with a warning."""
    entries = list_checkpoints(dirpath)
    for i, entry in enumerate(iter_valid_checkpoints(dirpath, verify)):
        if entry.path != entries[0].path:
            log.warning(
                "Resuming from %s: the newer checkpoint(s) in %s are incomplete or corrupted (see above).",
                entry.path,
                dirpath,
            )
        return entry.path
    if entries:
        log.warning(
            "No valid checkpoint in %s (%d invalid ones found); starting from scratch.", dirpath, len(entries)
        )
    return None


def auto_resume_ckpt_path(trainer: Any) -> str | None:
    """The checkpoint a ``fit`` run should resume from when the user passed no ``ckpt_path``.

    Asks the trainer's callbacks that offer ``resume_checkpoint_path(trainer)`` (duck-typed, so that
    mula does not import ``callbacks``); the first non-None answer wins. Returns None for a fresh run.
    """
    for callback in getattr(trainer, "callbacks", []):
        finder = getattr(callback, "resume_checkpoint_path", None)
        if callable(finder):
            path = finder(trainer)
            if path is not None:
                return str(path)
    return None
