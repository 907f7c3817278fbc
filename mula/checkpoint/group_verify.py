"""Verification by one reader per file: a checkpoint's files divided among the ranks of a process group.

Every process re-hashing a 1.4 TB checkpoint is 384 reads of it from the shared filesystem at 384
ranks. Here each file is hashed by exactly one rank (all of them by rank 0 when the checkpoint is
small), the verdicts are gathered, and every rank gets the same one: the cost is one read of the
checkpoint in total, whatever the world size, and the verdict and its sentence are those of
``manifest.verify_checkpoint`` in one process.

Before the process group exists nothing can be divided, so the readers that run there (auto-resume
discovery, ``--ckpt_path``, ``init_weights``) check only manifests and sizes and leave the checksums
of the checkpoint they picked *pending* (``defer``); the code that loads it, once the group exists,
settles them (``settle.settle``): ``XPUMoEStrategy.load_checkpoint`` for sharded checkpoints and the
module's ``init_weights`` loading. A pending auto-resume candidate that fails is skipped with the
same warning as before and the next valid checkpoint is loaded instead.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from mula.checkpoint import manifest as manifest_module
from mula.checkpoint.manifest import CheckpointManifest, FileEntry, Verify, check_sizes, verify_checkpoint

log = logging.getLogger(__name__)

SMALL_CHECKPOINT_BYTES = 64 << 20  # below this, rank 0 hashes every file: not worth a split
_ENV_WORLD = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")


def launch_world_size() -> int:
    """The number of processes of this launch as the launcher's environment tells it before any process
    group exists (torchrun, Lightning's own launcher for its children, mpiexec, srun); 1 when none does."""
    for name in _ENV_WORLD:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def group_size(group: object | None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def assign_files(files: list[FileEntry], ranks: int, small_bytes: int | None = None) -> list[int]:
    """The rank that hashes each file: all rank 0 for a small checkpoint (below ``small_bytes``, default
    ``SMALL_CHECKPOINT_BYTES``), else the largest file first to the least-loaded rank (deterministic:
    every rank computes the same assignment)."""
    owner = [0] * len(files)
    small = SMALL_CHECKPOINT_BYTES if small_bytes is None else small_bytes
    if ranks <= 1 or sum(f.size for f in files) < small:
        return owner
    load = [0] * ranks
    for i in sorted(range(len(files)), key=lambda i: (-files[i].size, i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += files[i].size
    return owner


def first_mismatch_on_ranks(
    checkpoint: Path, manifest: CheckpointManifest, group: object | None = None
) -> FileEntry | None:
    """``manifest.first_mismatch`` with each file hashed by one rank of ``group`` (a collective: every
    rank calls it); every rank gets the same answer, the first mismatching file in manifest order."""
    ranks = group_size(group)
    if ranks == 1:
        return manifest_module.first_mismatch(checkpoint, manifest)
    me = dist.get_rank(group)
    owner = assign_files(manifest.files, ranks)
    mine = [i for i, r in enumerate(owner) if r == me]
    bad: int | None = None
    error: str | None = None
    try:
        for i in mine:
            entry = manifest.files[i]
            path = checkpoint / entry.path if entry.path else checkpoint
            if manifest_module.file_digest(path, manifest.checksum) != entry.digest:
                bad = i
                break
    except OSError as err:  # an unreadable file: every rank raises it, instead of one rank leaving
        error = f"rank {me}: {type(err).__name__}: {err}"
    reports: list[tuple[int | None, str | None]] = [(None, None)] * ranks
    dist.all_gather_object(reports, (bad, error), group=group)
    errors = [e for _, e in reports if e is not None]
    if errors:
        raise OSError(errors[0])
    found = [b for b, _ in reports if b is not None]
    return manifest.files[min(found)] if found else None


def verify_on_ranks(
    checkpoint: str | os.PathLike, verify: Verify = "checksum", group: object | None = None
) -> str | None:
    """``verify_checkpoint``'s verdict, each file read by one rank of ``group`` (a collective; in one
    process, or without a process group, the plain verification). The ranks agree on the size check
    first (rank 0's verdict wins), so a rank never waits in a hashing collective the others skipped."""
    checkpoint = Path(checkpoint)
    if group_size(group) == 1:
        return verify_checkpoint(checkpoint, verify)
    _, problem = check_sizes(checkpoint)
    box = [problem]
    dist.broadcast_object_list(
        box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group
    )
    if box[0] is not None:
        return box[0]
    if verify == "size":
        return None
    return verify_checkpoint(checkpoint, verify, lambda c, m: first_mismatch_on_ranks(c, m, group))


# ---------------------------------------------------------------- checksums left for the process group


@dataclass
class Pending:
    """A checkpoint whose checksums were left for the process group: ``resume`` (auto-resume's candidate,
    with its directory and the candidates after it) or ``named`` (a path the user gave)."""

    kind: str
    older: tuple[Path, ...] = ()  # resume: the older size-valid checkpoints to fall back on, newest first


_PENDING: dict[str, Pending] = {}


def _key(path: str | os.PathLike) -> str:
    return str(Path(path).resolve())


def defer(path: str | os.PathLike, kind: str, older: tuple[Path, ...] = ()) -> None:
    """Leave the checksums of ``path`` to ``settle`` (its manifest and sizes were checked)."""
    _PENDING[_key(path)] = Pending(kind, tuple(older))


def is_pending(path: str | os.PathLike) -> bool:
    """True while the checksums of ``path`` wait for the process group."""
    return _key(path) in _PENDING


def take_pending(path: str | os.PathLike) -> Pending | None:
    """What was left pending for ``path`` (now no longer pending), or None when nothing was."""
    return _PENDING.pop(_key(path), None)


_VERIFY_SECONDS = [0.0]


def add_verify_time(seconds: float) -> None:
    """Count ``seconds`` spent verifying checkpoints in this process (discovery, ``settle``)."""
    _VERIFY_SECONDS[0] += seconds


def verify_time() -> float:
    """Seconds this process spent verifying checkpoints so far (the restart's verification time)."""
    return _VERIFY_SECONDS[0]
