"""Checkpoint manifests: what a save wrote, file by file, so that a reader can tell complete from damaged.

The manifest ``<checkpoint>.manifest.json`` is the commit record of a checkpoint (see
``mula.checkpoint``): written last, atomically, after the data is durable and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from mula.checkpoint.atomic import atomic_write_text

MANIFEST_SUFFIX = ".manifest.json"
MANIFEST_FORMAT = "mula-checkpoint-manifest"
MANIFEST_VERSION = 1
WEIGHTS_REASON = "weights"  # the `reason` of a Mula weights file's manifest (`save_weights`)
_CHUNK = 8 << 20

Checksum = Literal["sha256", "crc32", "none"]
Verify = Literal["checksum", "size"]


def manifest_path(checkpoint: str | os.PathLike) -> Path:
    """Where the manifest of ``checkpoint`` lives (a sibling file, for file and directory checkpoints alike)."""
    checkpoint = Path(checkpoint)
    return checkpoint.with_name(checkpoint.name + MANIFEST_SUFFIX)


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


def first_mismatch(checkpoint: Path, manifest: CheckpointManifest) -> FileEntry | None:
    """The first file of ``manifest`` (in its order) whose content does not match its checksum, or None.

    Reads every file once, in this process; ``mula.checkpoint.group_verify.first_mismatch_on_ranks``
    divides the files among the ranks of a process group instead.
    """
    for entry in manifest.files:
        if file_digest(_resolve(checkpoint, entry), manifest.checksum) != entry.digest:
            return entry
    return None


def check_sizes(checkpoint: Path) -> tuple[CheckpointManifest | None, str | None]:
    """(manifest, None) when ``checkpoint``'s manifest is readable and every file it lists is present with
    its size, else (None, why not): the cheap part of verification, reading only metadata."""
    try:
        manifest = read_manifest(checkpoint)
    except (FileNotFoundError, ValueError) as err:
        return None, f"{err} (the save did not complete)" if isinstance(err, FileNotFoundError) else str(err)
    if not checkpoint.exists():
        return None, f"{checkpoint} is listed by its manifest but does not exist"
    if manifest.kind == "file" and not checkpoint.is_file():
        return None, f"{checkpoint} should be a file"
    if manifest.kind == "dir" and not checkpoint.is_dir():
        return None, f"{checkpoint} should be a directory"
    for entry in manifest.files:
        path = _resolve(checkpoint, entry)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return None, f"{path} is missing"
        if size != entry.size:
            return None, f"{path} has {size} bytes, the manifest says {entry.size} (truncated or overwritten)"
    return manifest, None


def verify_checkpoint(
    checkpoint: str | os.PathLike,
    verify: Verify = "checksum",
    mismatch: Callable[[Path, CheckpointManifest], FileEntry | None] = first_mismatch,
) -> str | None:
    """Check a checkpoint against its manifest. Returns None if valid, else why it is not (one sentence).

    ``verify="size"`` checks presence and sizes only (detects incomplete and truncated checkpoints
    without reading them); ``"checksum"`` also re-hashes every file (detects damaged content), with
    ``mismatch`` (default: every file in this process; ``group_verify.first_mismatch_on_ranks``: each
    file by one rank of the process group, a collective).
    """
    if verify not in ("checksum", "size"):
        raise ValueError(f"Unknown verify mode {verify!r}; expected 'checksum' or 'size'.")
    checkpoint = Path(checkpoint)
    manifest, problem = check_sizes(checkpoint)
    if manifest is None:
        return problem
    if verify == "checksum" and manifest.checksum != "none":
        bad = mismatch(checkpoint, manifest)
        if bad is not None:
            return f"{_resolve(checkpoint, bad)} does not match its {manifest.checksum} checksum (corrupted)"
    return None
