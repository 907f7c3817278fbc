"""Streams of token windows for one data-parallel rank, and a DataLoader whose position is checkpointed.

Global batch b is the sample positions ``[start + b*G, start + (b+1)*G)`` of :class:`MixtureOrder`'s order.
Rank r of W takes the contiguous slice ``[r*G/W, (r+1)*G/W)`` of it and splits that into ``A = G/(W*m)``
micro-batches of m windows, which Lightning accumulates into one optimizer step. The union over ranks of a
global batch is therefore the same for every W.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mula.data.sampling import MixtureOrder
from mula.layout.rules import micro_batches_per_step

log = logging.getLogger(__name__)


class WindowReader:
    """Random access to windows of ``block`` tokens of prepared sources, through litdata's StreamingDataset.

    Windows are consecutive, non-overlapping blocks inside each litdata chunk (litdata's TokensLoader layout).
    Datasets are opened lazily in each process, so the reader can be sent to DataLoader workers.
    """

    def __init__(self, source_dirs: Sequence[str], block: int) -> None:
        self.source_dirs = list(source_dirs)
        self.block = block
        self._datasets: list[Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"source_dirs": self.source_dirs, "block": self.block, "_datasets": None}

    def _open(self) -> list[Any]:
        if self._datasets is None:
            from litdata import StreamingDataset
            from litdata.streaming.item_loader import TokensLoader

            self._datasets = [
                StreamingDataset(d, item_loader=TokensLoader(block_size=self.block)) for d in self.source_dirs
            ]
        return self._datasets

    def num_windows(self) -> list[int]:
        """Number of windows of each source, over the whole dataset.

        Counted from litdata's index with TokensLoader's rule (``tokens_in_chunk // block`` per chunk):
        ``len(StreamingDataset)`` would be this rank's share once torch.distributed is initialised, while
        indexing stays global.
        """
        counts = []
        for d in self.source_dirs:
            with open(os.path.join(d, "index.json")) as fh:
                index = json.load(fh)
            if index["config"].get("item_loader") != "TokensLoader":
                raise ValueError(f"{d} does not hold token chunks written by `mula prepare`.")
            counts.append(sum(chunk["dim"] // self.block for chunk in index["chunks"]))
        return counts

    def get(self, sources: np.ndarray, windows: np.ndarray) -> torch.Tensor:
        """A LongTensor [len(windows), block] of the given (source, window) pairs."""
        datasets = self._open()
        out = torch.empty(len(windows), self.block, dtype=torch.long)
        for row, (s, w) in enumerate(zip(sources.tolist(), windows.tolist())):
            out[row] = torch.from_numpy(datasets[s][w].astype(np.int64))
        return out


@dataclass(frozen=True)
class BatchLayout:
    """How global batches are cut into this rank's micro-batches."""

    global_batch_size: int
    micro_batch_size: int
    rank: int
    world_size: int

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step on each rank."""
        return micro_batches_per_step(self.global_batch_size, self.world_size, self.micro_batch_size)

    def positions(self, start: int, micro: int) -> np.ndarray:
        """Sample positions of this rank's ``micro``-th micro-batch counted from sample position ``start``."""
        batch, within = divmod(micro, self.accumulation)
        per_rank = self.global_batch_size // self.world_size
        first = start + batch * self.global_batch_size + self.rank * per_rank + within * self.micro_batch_size
        return np.arange(first, first + self.micro_batch_size, dtype=np.int64)


def _worker_split() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class TrainStream(IterableDataset):
    """Endless micro-batches [m, block] of this rank, from sample position ``start`` and micro-batch ``micro``.

    DataLoader workers take micro-batches round-robin, which the DataLoader returns in order.
    """

    def __init__(self, reader: WindowReader, order: MixtureOrder, layout: BatchLayout) -> None:
        self.reader, self.order, self.layout = reader, order, layout
        self.start, self.micro = 0, 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        wid, nw = _worker_split()
        for k in itertools.count(self.micro + wid, nw):
            sources, windows = self.order.train(self.layout.positions(self.start, k))
            yield self.reader.get(sources, windows)


class ValStream(IterableDataset):
    """This rank's share of the validation windows, in micro-batches (padded so every rank has as many)."""

    def __init__(
        self, reader: WindowReader, order: MixtureOrder, micro_batch_size: int, rank: int, world: int
    ):
        self.reader, self.micro_batch_size = reader, micro_batch_size
        sources, windows = order.val()
        per_rank = (len(windows) + world - 1) // world
        # Pad by wrapping around so every rank runs the same number of steps (collectives must match).
        idx = np.arange(rank, rank + per_rank * world, world) % max(len(windows), 1)
        self.sources, self.windows = sources[idx], windows[idx]

    def __len__(self) -> int:
        return (len(self.windows) + self.micro_batch_size - 1) // self.micro_batch_size

    def __iter__(self) -> Iterator[torch.Tensor]:
        wid, nw = _worker_split()
        for j in range(wid, len(self), nw):
            sl = slice(j * self.micro_batch_size, (j + 1) * self.micro_batch_size)
            yield self.reader.get(self.sources[sl], self.windows[sl])


class StatefulLoader(DataLoader):
    """DataLoader over a :class:`TrainStream` that counts the micro-batches it hands out.

    Lightning saves ``state_dict()`` in checkpoints and calls ``load_state_dict()`` on resume (a loader with
    both methods is "stateful" to Lightning), so training continues exactly at the next micro-batch. The
    stream is endless; ``len()`` is one mixture epoch, which only sets where Lightning's epochs end (knowing
    the length also stops Lightning from fetching a batch ahead, which would make the count run early).
    """

    def __init__(self, stream: TrainStream, num_workers: int = 0, pin_memory: bool = False) -> None:
        super().__init__(
            stream, batch_size=None, num_workers=num_workers, pin_memory=pin_memory, persistent_workers=False
        )
        self.start = 0  # sample position where this layout began
        self.consumed = 0  # micro-batches of this rank handed out since `start`
        layout = stream.layout
        self._len = max(1, stream.order.epoch_length // layout.global_batch_size) * layout.accumulation

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[torch.Tensor]:
        stream: TrainStream = self.dataset  # type: ignore[assignment]
        stream.start, stream.micro = self.start, self.consumed  # read by the workers created just below
        for batch in super().__iter__():
            self.consumed += 1  # counted when handed out: a checkpoint after this step resumes at the next
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Position of the stream: samples of completed global batches, plus micro-batches into the next."""
        layout: BatchLayout = self.dataset.layout  # type: ignore[attr-defined]
        batches, micro = divmod(self.consumed, layout.accumulation)
        return {
            "samples": self.start + batches * layout.global_batch_size,
            "micro_in_batch": micro,
            "global_batch_size": layout.global_batch_size,
            "micro_batch_size": layout.micro_batch_size,
            "world_size": layout.world_size,
            "seed": self.dataset.order.seed,  # type: ignore[attr-defined]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by :meth:`state_dict` (possibly with another world size)."""
        layout: BatchLayout = self.dataset.layout  # type: ignore[attr-defined]
        self.start, self.consumed = int(state["samples"]), 0
        same_layout = (
            state.get("global_batch_size") == layout.global_batch_size
            and state.get("micro_batch_size") == layout.micro_batch_size
            and state.get("world_size") == layout.world_size
        )
        if state.get("micro_in_batch", 0):
            if same_layout:
                self.consumed = int(state["micro_in_batch"])
            else:
                log.warning(
                    "checkpoint was taken in the middle of a global batch with another batch layout; "
                    "restarting that global batch from its first sample."
                )
        if state.get("seed") != self.dataset.order.seed:  # type: ignore[attr-defined]
            log.warning(
                "resuming with seed %s (checkpoint used %s): the sample order changes from here.",
                self.dataset.order.seed,
                state.get("seed"),
            )  # type: ignore[attr-defined]
