"""The optional global document shuffle of `mula prepare`: a two-pass scatter / gather over the tasks.

Pass 1 (one per tokenize task ``t`` of a source with ``B`` tasks): each document draws a bucket in
``[0, B)`` from ``rng(seed, t)``; the task's documents are written grouped by bucket (document order
kept inside a bucket) as ``scatter-<t>.bin`` plus the bucket offsets ``scatter-<t>.offsets.npy``.
Pass 2 (one per bucket ``b``, once every pass-1 task is done): bucket ``b``'s slice of every task's
scatter file, in task order, is permuted with ``rng(seed, b)`` and written as litdata chunks under
the bucket's number; the buckets' indexes are merged in bucket order.

Scattering every item to an independent uniform bucket, permuting each bucket uniformly and
concatenating the buckets gives a uniformly random permutation of the whole source (the two-pass
shuffle), while no process holds more than one task's or one bucket's tokens. Every draw depends only
on the seed and a task or bucket number, so the order is the same for any number of ranks and workers,
and a resumed job redraws exactly what an interrupted one drew. Pass 2 reads ``B`` slices of each of
the ``B`` scatter files (``B`` squared small reads per source; ``B`` grows with the source, one task per
256 MB of input above 4 GB).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

_SCATTER = 0  # the stream of draws of pass 1 (task -> bucket of each document)
_GATHER = 1  # the stream of draws of pass 2 (bucket -> order of its documents)


def _rng(seed: int, stream: int, number: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, stream, number])))


def scatter_paths(out_dir: str, task: int) -> tuple[str, str]:
    """The token file and the offsets file of pass-1 task ``task``."""
    return os.path.join(out_dir, f"scatter-{task}.bin"), os.path.join(out_dir, f"scatter-{task}.offsets.npy")


def write_scatter(
    out_dir: str, task: int, docs: list[np.ndarray], seed: int, buckets: int, dtype: str
) -> None:
    """Pass 1: write task ``task``'s documents grouped by their drawn bucket (see module doc)."""
    drawn = _rng(seed, _SCATTER, task).integers(0, buckets, size=len(docs))
    order = np.argsort(drawn, kind="stable")  # by bucket, document order kept inside one
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    per_bucket = np.bincount(drawn, weights=lengths, minlength=buckets).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(per_bucket)])
    tokens_path, offsets_path = scatter_paths(out_dir, task)
    with open(tokens_path, "wb") as fh:
        for i in order:
            fh.write(np.ascontiguousarray(docs[i], dtype=dtype).tobytes())
    with open(offsets_path, "wb") as fh:
        np.save(fh, offsets)


def gather_bucket(
    out_dir: str, bucket: int, tasks: int, seed: int, eos_id: int, dtype: str
) -> list[np.ndarray]:
    """Pass 2: bucket ``bucket``'s documents from every task's scatter file, in their permuted order."""
    docs: list[np.ndarray] = []
    for task in range(tasks):
        tokens_path, offsets_path = scatter_paths(out_dir, task)
        offsets = np.load(offsets_path)
        start, end = int(offsets[bucket]), int(offsets[bucket + 1])
        if end == start:
            continue
        piece = np.fromfile(
            tokens_path, dtype=dtype, count=end - start, offset=start * np.dtype(dtype).itemsize
        )
        # Every document ends with exactly one EOS (a literal EOS string in the text is encoded as text).
        ends = np.flatnonzero(piece == eos_id) + 1
        docs.extend(np.split(piece, ends[:-1]))
    order = _rng(seed, _GATHER, bucket).permutation(len(docs))
    return [docs[i] for i in order]


def remove_scatter(out_dir: str, tasks: int) -> None:
    """Delete the pass-1 files once the source's chunks are complete."""
    for task in range(tasks):
        for path in scatter_paths(out_dir, task):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
