"""The optional global document shuffle of `mula prepare`: scatter, split, gather over the tasks.

A source of ``B`` tokenize tasks is shuffled into ``K1 x K2`` buckets (``K1 = ceil(sqrt(B))``,
``K2 = ceil(B / K1)``: about one task's tokens per bucket, so no process holds more than that):

1. **Scatter** (one per tokenize task ``t``): each document draws a coarse bucket in ``[0, K1)`` from
   ``rng(seed, t)``; the task's documents are written grouped by coarse bucket (document order kept)
   as ``scatter-<t>.bin`` plus the offsets ``scatter-<t>.offsets.npy``.
2. **Split** (one per coarse bucket ``c``, once every task has scattered): ``c``'s slice of every
   task's scatter file, in task order, document by document draws a fine bucket in ``[0, K2)`` from
   ``rng(seed, c)`` and is appended to ``split-<c>-<f>.bin``.
3. **Gather** (one per bucket ``b = c * K2 + f``, once every split is done): ``split-<c>-<f>.bin``'s
   documents permuted with ``rng(seed, b)`` and written as litdata chunks under ``b``; the buckets'
   indexes are merged in bucket order.

Every document lands in a bucket drawn uniformly and independently, each bucket is permuted uniformly
and the buckets are concatenated: a uniformly random permutation of the whole source. Every draw
depends only on the seed and a task or bucket number, so the order is the same for any number of
ranks and workers, and a resumed job redraws exactly what an interrupted one drew.

Why three passes and not two: gathering straight from the scatter files reads ``B`` slices of each of
``B`` files, ``B**2`` reads of ``S / B**2`` bytes each (a 14 TB source in 256 MB tasks: 3 billion reads
of 5 KB). The split makes that ``B * K1`` reads of ``S / (B * K1)`` bytes plus ``K1 * K2`` whole-file
reads (the same source: 13 million reads of about 1 MB and 56,000 files), at the price of writing the
tokens once more.
"""

from __future__ import annotations

import contextlib
import math
import os

import numpy as np

_SCATTER = 0  # the draws of pass 1 (task -> coarse bucket of each document)
_GATHER = 1  # the draws of pass 3 (bucket -> order of its documents)
_SPLIT = 2  # the draws of pass 2 (coarse bucket -> fine bucket of each document)


def _rng(seed: int, stream: int, number: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, stream, number])))


def shuffle_shape(tasks: int) -> tuple[int, int]:
    """``(K1, K2)``: the coarse buckets of the scatter and the fine buckets each one splits into."""
    coarse = max(1, math.isqrt(max(tasks, 1) - 1) + 1)  # ceil(sqrt(tasks))
    return coarse, max(1, -(-tasks // coarse))


def scatter_paths(out_dir: str, task: int) -> tuple[str, str]:
    """The token file and the offsets file of pass-1 task ``task``."""
    return os.path.join(out_dir, f"scatter-{task}.bin"), os.path.join(out_dir, f"scatter-{task}.offsets.npy")


def split_path(out_dir: str, coarse: int, fine: int) -> str:
    """The token file of fine bucket ``fine`` of coarse bucket ``coarse`` (written by pass 2)."""
    return os.path.join(out_dir, f"split-{coarse}-{fine}.bin")


def _documents(piece: np.ndarray, eos_id: int) -> list[np.ndarray]:
    # Every document ends with exactly one EOS (a literal EOS string in the text is encoded as text).
    if piece.size == 0:
        return []
    ends = np.flatnonzero(piece == eos_id) + 1
    return np.split(piece, ends[:-1])


def write_scatter(
    out_dir: str, task: int, docs: list[np.ndarray], seed: int, coarse: int, dtype: str
) -> None:
    """Pass 1: write task ``task``'s documents grouped by their drawn coarse bucket (see module doc)."""
    drawn = _rng(seed, _SCATTER, task).integers(0, coarse, size=len(docs))
    order = np.argsort(drawn, kind="stable")  # by bucket, document order kept inside one
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    per_bucket = np.bincount(drawn, weights=lengths, minlength=coarse).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(per_bucket)])
    tokens_path, offsets_path = scatter_paths(out_dir, task)
    with open(tokens_path, "wb") as fh:
        for i in order:
            fh.write(np.ascontiguousarray(docs[i], dtype=dtype).tobytes())
    with open(offsets_path, "wb") as fh:
        np.save(fh, offsets)


def split_coarse(
    out_dir: str, coarse: int, tasks: int, fine: int, seed: int, eos_id: int, dtype: str
) -> dict[str, int]:
    """Pass 2: spread coarse bucket ``coarse``'s documents over its ``fine`` split files.

    Reads one slice per task (in task order) and holds one slice at a time; every split file is
    rewritten from its start, so a split interrupted half-way is simply run again.
    """
    draws = _rng(seed, _SPLIT, coarse)
    documents = tokens = 0
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(open(split_path(out_dir, coarse, f), "wb")) for f in range(fine)]
        for task in range(tasks):
            tokens_path, offsets_path = scatter_paths(out_dir, task)
            offsets = np.load(offsets_path)
            start, end = int(offsets[coarse]), int(offsets[coarse + 1])
            if end == start:
                continue
            piece = np.fromfile(
                tokens_path, dtype=dtype, count=end - start, offset=start * np.dtype(dtype).itemsize
            )
            docs = _documents(piece, eos_id)
            drawn = draws.integers(0, fine, size=len(docs))
            for f in np.unique(drawn):
                outs[f].write(np.concatenate([docs[i] for i in np.flatnonzero(drawn == f)]).tobytes())
            documents += len(docs)
            tokens += int(piece.size)
    return {"documents": documents, "tokens": tokens}


def gather_bucket(
    out_dir: str, bucket: int, fine: int, seed: int, eos_id: int, dtype: str
) -> list[np.ndarray]:
    """Pass 3: bucket ``bucket``'s documents (its split file) in their permuted order."""
    coarse, f = divmod(bucket, fine)
    docs = _documents(np.fromfile(split_path(out_dir, coarse, f), dtype=dtype), eos_id)
    order = _rng(seed, _GATHER, bucket).permutation(len(docs))
    return [docs[i] for i in order]


def remove_scatter(out_dir: str, tasks: int) -> None:
    """Delete the pass-1 files (once every split is done: pass 2 was their only reader)."""
    for task in range(tasks):
        for path in scatter_paths(out_dir, task):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def remove_split(out_dir: str, bucket: int, fine: int) -> None:
    """Delete bucket ``bucket``'s split file (once its chunks are written: pass 3 was its only reader)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(split_path(out_dir, *divmod(bucket, fine)))
