"""Settling what verification left pending (``group_verify.defer``) once the process group exists: the
checksums of the checkpoint about to be loaded, one reader per file (``group_verify.verify_on_ranks``).
Above the readers that defer (``discovery``, ``reading``), whose refusals and fallbacks it reuses.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from mula.checkpoint.discovery import no_valid_checkpoint
from mula.checkpoint.group_verify import Pending, add_verify_time, group_size, take_pending, verify_on_ranks
from mula.checkpoint.manifest import verify_checkpoint
from mula.checkpoint.reading import refusal, verify_for_reading

log = logging.getLogger(__name__)


def settle(path: str | os.PathLike, group: object | None = None) -> Path:
    """Verify a pending checkpoint's checksums by one reader per file (a collective) and return the path
    to load: ``path`` itself when it verifies or was never pending; for an auto-resume candidate that
    fails, the newest older one that verifies (each skipped one warned about as discovery does).

    Raises ValueError with verification's sentence when a user-named checkpoint fails, and
    ``discovery.NoValidCheckpoint`` when no auto-resume candidate verifies.
    """
    pending = take_pending(path)
    path = Path(path)
    if pending is None:
        return path
    start = time.monotonic()
    try:
        return _settle(path, pending, group)
    finally:
        add_verify_time(time.monotonic() - start)


def settle_for_reading(path: str | os.PathLike, verify: bool = True, group: object | None = None) -> None:
    """``reading.verify_for_reading`` of a user-named checkpoint once the process group exists (a
    collective): with several ranks every rank takes part, one reader per file, whatever it left
    pending (the first process of Lightning's own launcher verified in full before it started the
    others, which deferred); in one process only what was left pending is verified."""
    pending = take_pending(path)
    if not verify or (group_size(group) == 1 and pending is None):
        return
    start = time.monotonic()
    try:
        verify_for_reading(path, verifier=lambda c, v: verify_on_ranks(c, v, group))
    finally:
        add_verify_time(time.monotonic() - start)


def _settle(path: Path, pending: Pending, group: object | None) -> Path:
    if pending.kind == "named":
        problem = verify_on_ranks(path, "checksum", group)
        if problem is not None:
            raise ValueError(refusal(path, problem))
        return path
    candidates = (path, *pending.older)
    problems: dict[Path, str] = {}
    for candidate in candidates:
        problem = verify_on_ranks(candidate, "checksum", group)
        if problem is None:
            if problems:
                log.warning(
                    "Resuming from %s: the newer checkpoint(s) in %s are incomplete or corrupted (see above).",
                    candidate,
                    candidate.parent,
                )
                log.info("Auto-resuming from %s.", candidate)
            return candidate
        log.warning("Skipping checkpoint %s: %s.", candidate, problem)
        problems[candidate] = problem
    raise no_valid_checkpoint(path.parent, lambda p: problems.get(p) or verify_checkpoint(p, "size"))
