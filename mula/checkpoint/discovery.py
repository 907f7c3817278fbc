"""Finding checkpoints: the ``step=N.ckpt`` naming, listing, and the newest valid one to resume from.

Validity is decided by the manifest alone (``mula.checkpoint.manifest.verify_checkpoint``): a
checkpoint without one did not finish saving. Lightning-free, so that the CLI can find the
checkpoint to resume from without importing ``callbacks`` (mula never imports callbacks).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from mula.checkpoint.group_verify import defer
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
    dirpath: str | os.PathLike,
    verify: Verify = "checksum",
    warn: bool = True,
    verifier: Callable[[Path, Verify], str | None] = verify_checkpoint,
) -> Iterator[CheckpointEntry]:
    """Yield the valid checkpoints of ``dirpath``, newest first, warning about each invalid one passed over
    (``verifier``: ``group_verify.verify_on_ranks`` to divide the reading among the ranks, a collective)."""
    for entry in list_checkpoints(dirpath):
        problem = verifier(entry.path, verify)
        if problem is None:
            yield entry
        elif warn:
            log.warning("Skipping checkpoint %s: %s.", entry.path, problem)


class NoValidCheckpoint(ValueError):
    """A run directory has committed checkpoints and none verifies (a ValueError: `mula` prints one line, exit 2)."""

    def __init__(self, message: str, summary: str) -> None:
        super().__init__(message)
        self.summary = summary  # what is wrong, without the advice

    def __str__(self) -> str:
        return str(self.args[0])


def find_resume_checkpoint(
    dirpath: str | os.PathLike, verify: Verify = "checksum", defer_sharded: bool = False
) -> Path | None:
    """The newest valid checkpoint in ``dirpath``, or None when it holds no committed checkpoint.

    Invalid newer ones are skipped with a warning. Raises :class:`NoValidCheckpoint` when checkpoints
    were committed (have a manifest) and none verifies: silently training from step 0 would throw the
    run away, so that takes an explicit choice (``auto_resume_ckpt_path(..., restart_from_scratch=True)``).
    Checkpoints without a manifest never finished saving (a crash in the very first save): nothing
    was committed, and the run starts from scratch with a warning.

    ``defer_sharded`` (before a process group exists, in every process of a multi-rank launch): a
    sharded checkpoint is picked by its manifest and sizes alone and its checksums are left pending
    for the ranks to verify together when the strategy loads it (``settle.settle``, which falls
    back to the older ones on a mismatch), instead of every process reading all of it here.
    """
    entries = list_checkpoints(dirpath)
    problems: dict[Path, str] = {}
    for i, entry in enumerate(entries):
        deferred = defer_sharded and verify == "checksum" and entry.path.is_dir()
        problem = verify_checkpoint(entry.path, "size" if deferred else verify)
        if problem is not None:
            log.warning("Skipping checkpoint %s: %s.", entry.path, problem)
            problems[entry.path] = problem
            continue
        if i:
            log.warning(
                "Resuming from %s: the newer checkpoint(s) in %s are incomplete or corrupted (see above).",
                entry.path,
                dirpath,
            )
        if deferred:
            older = tuple(e.path for e in entries[i + 1 :] if verify_checkpoint(e.path, "size") is None)
            defer(entry.path, "resume", older)
        return entry.path
    if any(e.manifest.exists() for e in entries):
        raise no_valid_checkpoint(dirpath, lambda p: problems.get(p) or verify_checkpoint(p, verify))
    if entries:
        log.warning(
            "No complete checkpoint in %s (%d unfinished save(s)); starting from scratch.",
            dirpath,
            len(entries),
        )
    return None


def no_valid_checkpoint(
    dirpath: str | os.PathLike, problem_of: Callable[[Path], str | None]
) -> NoValidCheckpoint:
    """The error for a directory whose committed checkpoints all failed (``problem_of``: why one failed)."""
    committed = [e for e in list_checkpoints(dirpath) if e.manifest.exists()]
    summary = (
        f"{dirpath} has {len(committed)} committed checkpoint(s) and none is valid"
        f" (newest: {problem_of(committed[0].path)})"
    )
    return NoValidCheckpoint(
        f"{summary}; nothing was deleted: fix or move them away, or start again from step 0 with"
        " --restart_from_scratch=true.",
        summary,
    )


@runtime_checkable
class ResumeFinder(Protocol):
    """A callback that knows the checkpoint a run resumes from (`callbacks.FaultTolerantCheckpoint`)."""

    def resume_checkpoint_path(self, trainer: Any) -> Path | str | None:
        """The newest valid checkpoint of the run directory, or None (NoValidCheckpoint: none is valid)."""
        ...


def auto_resume_ckpt_path(trainer: Any, restart_from_scratch: bool = False) -> str | None:
    """The checkpoint a ``fit`` run should resume from when the user passed no ``ckpt_path``.

    Asks the trainer's callbacks that are a :class:`ResumeFinder` (a protocol, so that mula does not
    import ``callbacks``); the first non-None answer wins. Returns None for a fresh run.
    A run directory whose checkpoints are all invalid raises :class:`NoValidCheckpoint`, unless
    ``restart_from_scratch``: then the run starts from step 0 (the invalid checkpoints stay until the
    new run's saves replace or prune them). A valid checkpoint is resumed from either way, so that
    re-running a command that carries the flag (a requeue) continues the run.
    """
    for callback in trainer.callbacks:
        if isinstance(callback, ResumeFinder):
            try:
                path = callback.resume_checkpoint_path(trainer)
            except NoValidCheckpoint as err:
                if not restart_from_scratch:
                    raise
                log.warning("%s; training from step 0, as --restart_from_scratch=true asks.", err.summary)
                continue
            if path is not None:
                return str(path)
    return None
