"""Finding checkpoints: the ``step=N.ckpt`` naming, listing, and the newest valid one to resume from.

Validity is decided by the manifest alone (``mula.checkpoint.manifest.verify_checkpoint``): a
checkpoint without one did not finish saving. Lightning-free, so that the CLI can find the
checkpoint to resume from without importing ``callbacks`` (mula never imports callbacks).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mula.checkpoint.manifest import MANIFEST_SUFFIX, Verify, manifest_path, verify_checkpoint

log = logging.getLogger(__name__)

CHECKPOINT_SUFFIX = ".ckpt"
_NAME_RE = re.compile(r"^step=(\d+)\.ckpt$")


def checkpoint_name(step: int) -> str:
    """The file (or directory) name of the checkpoint taken after optimizer step ``step``."""
    return f"step={step:09d}{CHECKPOINT_SUFFIX}"


def is_checkpoint_name(name: str) -> bool:
    """True for a ``step=N.ckpt`` name: a checkpoint of a run directory, complete only with its manifest."""
    return _NAME_RE.match(name) is not None


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
    for entry in iter_valid_checkpoints(dirpath, verify):
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
