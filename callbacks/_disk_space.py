"""How much room the next checkpoint needs, and whether the checkpoint directory has it.

A save writes the new checkpoint next to the ``keep_last`` kept ones and prunes only after it is
committed, so the directory needs room for ``keep_last + 1`` checkpoints. The size of the next one
is taken from the newest manifest (``total_bytes``); before the first save it is estimated from
rank 0's model and optimizer state.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from mula.checkpoint import list_checkpoints, read_manifest

# A new checkpoint may be a little larger than the last one (metadata, a grown loss window), and the
# manifest, the symlink and directory entries take some room too.
HEADROOM = 1.05
SLACK_BYTES = 64 << 10
_ADAM_MOMENT_BYTES = 8  # two fp32 moments per parameter element, when the optimizer has no state yet


def free_bytes(dirpath: Path) -> int:
    """Free bytes on the filesystem of ``dirpath`` (of its nearest existing ancestor if it does not exist yet)."""
    path = dirpath.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def checkpoint_sizes(dirpath: Path) -> list[int]:
    """``total_bytes`` of every checkpoint in ``dirpath`` with a readable manifest, newest first."""
    sizes = []
    for entry in list_checkpoints(dirpath):
        try:
            sizes.append(read_manifest(entry.path).total_bytes)
        except (OSError, ValueError):  # no or damaged manifest: not a checkpoint we can size
            continue
    return sizes


def estimate_checkpoint_bytes(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes of this rank's parameters and optimizer state (Adam-like moments assumed while it has none).

    Exact for data-parallel runs; a lower bound when the strategy shards the model over the ranks.
    """
    params = list(module.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    state_bytes = 0
    for optimizer in optimizers:
        for state in optimizer.state.values():
            state_bytes += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    if state_bytes == 0:
        state_bytes = _ADAM_MOMENT_BYTES * sum(p.numel() for p in params if p.requires_grad)
    return total + state_bytes


def needed_bytes(checkpoint_bytes: int) -> int:
    """Free bytes required before writing a checkpoint of about ``checkpoint_bytes``."""
    return int(checkpoint_bytes * HEADROOM) + SLACK_BYTES


def space_problem(dirpath: Path, checkpoint_bytes: int) -> str | None:
    """Why a checkpoint of about ``checkpoint_bytes`` cannot be written to ``dirpath`` now, or None."""
    free = free_bytes(dirpath)
    if free >= needed_bytes(checkpoint_bytes):
        return None
    return (
        f"{dirpath} has {mib(free)} free, and the checkpoint needs about {mib(checkpoint_bytes)}"
        " (the size of the last one); free some space or lower keep_last"
    )


def shortage(dirpath: Path, keep_last: int, checkpoint_bytes: int) -> str | None:
    """A warning when ``keep_last`` checkpoints of ``checkpoint_bytes`` plus the one being written
    cannot fit in ``dirpath``, counting the existing checkpoints (pruning frees them) as room; else None."""
    free = free_bytes(dirpath)
    existing = sum(checkpoint_sizes(dirpath))
    needed = (keep_last + 1) * needed_bytes(checkpoint_bytes)
    if free + existing >= needed:
        return None
    return (
        f"Checkpoint directory {dirpath} is short of space: {mib(free)} free (plus {mib(existing)} in"
        f" existing checkpoints), and keep_last={keep_last} checkpoints of about {mib(checkpoint_bytes)}"
        f" plus the one being written need {mib(needed)}; saves will fail once it is full."
    )


def mib(n: int) -> str:
    """``n`` bytes as a readable size."""
    return f"{n / 2**20:.1f} MiB"
