"""Token ids to litdata chunks under a task's name, with the size and sha256 of every chunk written.

One writer per task of `mula prepare`: its chunks are ``chunk-<index>-<n>.bin`` and its index
``<index>.index.json`` (litdata names both after the writer's rank, so the task number is passed as the
rank), which is what lets any process write any task and rank 0 merge the indexes in task order.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from typing import Any

import numpy as np

from mula.checkpoint.atomic import atomic_write_text
from mula.checkpoint.manifest import file_digest
from mula.data.prepare_summary import SOURCE_MARKER, read_json

log = logging.getLogger(__name__)

ITEM_TOKENS = 1 << 20  # documents are concatenated into litdata items of about this many tokens


def chunk_prefix(index: int) -> str:
    """The file-name prefix of the chunks of task ``index``."""
    return f"chunk-{index}-"


class _LogQueue:
    """Receives litdata's writer messages (it would print them otherwise) and logs them at debug level."""

    def put_nowait(self, msg: str) -> None:
        log.debug(msg)


class TaskChunkWriter:
    """A context manager that writes documents' token ids as the litdata chunks of task ``index``.

    Leftovers of an interrupted attempt at the same task are removed first. After the ``with`` block,
    ``chunks`` maps each chunk file name to its ``{"bytes", "sha256"}``.

    Args:
        out_dir: The folder of the source being prepared.
        index: The task number (names the chunks and the per-task index).
        chunk_bytes: litdata's chunk size, e.g. "64MB".
    """

    def __init__(self, out_dir: str, index: int, chunk_bytes: str) -> None:
        self.out_dir = out_dir
        self.index = index
        self.chunk_bytes = chunk_bytes
        self.chunks: dict[str, dict[str, Any]] = {}
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._item = 0
        self._previous_rank: str | None = None
        self._writer: Any = None

    def __enter__(self) -> TaskChunkWriter:
        from litdata.streaming.item_loader import TokensLoader
        from litdata.streaming.writer import BinaryWriter

        for stale in os.listdir(self.out_dir):
            if stale.startswith(chunk_prefix(self.index)) or stale == f"{self.index}.index.json":
                os.remove(os.path.join(self.out_dir, stale))
        self._previous_rank = os.environ.get("DATA_OPTIMIZER_GLOBAL_RANK")
        os.environ["DATA_OPTIMIZER_GLOBAL_RANK"] = str(self.index)
        self._writer = BinaryWriter(
            self.out_dir, chunk_bytes=self.chunk_bytes, item_loader=TokensLoader(), msg_queue=_LogQueue()
        )
        return self

    def add(self, ids: np.ndarray) -> None:
        """Append one document's token ids (EOS included)."""
        self._pending.append(ids)
        self._pending_tokens += len(ids)
        if self._pending_tokens >= ITEM_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._writer.add_item(self._item, np.concatenate(self._pending))
            self._item += 1
            self._pending, self._pending_tokens = [], 0

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None:
                self._flush()
                self._writer.done()
        finally:
            if self._previous_rank is None:
                os.environ.pop("DATA_OPTIMIZER_GLOBAL_RANK", None)
            else:
                os.environ["DATA_OPTIMIZER_GLOBAL_RANK"] = self._previous_rank
        if exc_type is None:
            names = sorted(
                n
                for n in os.listdir(self.out_dir)
                if n.startswith(chunk_prefix(self.index)) and n.endswith(".bin")
            )
            for name in names:
                path = os.path.join(self.out_dir, name)
                self.chunks[name] = {"bytes": os.path.getsize(path), "sha256": file_digest(path, "sha256")}


def merge_indexes(out_dir: str, writers: list[int], chunks: dict[str, dict[str, Any]]) -> None:
    """Merge the litdata indexes of the writers (task or bucket numbers) into ``index.json`` in that order,
    byte-identically.

    litdata's own merge stamps the time into ``updated_at`` (its cache key); here it is a digest of the
    chunks' checksums, so the index depends on the content alone and still changes when it does.
    """
    merged: list[dict[str, Any]] = []
    config = None
    for index in writers:
        data = read_json(os.path.join(out_dir, f"{index}.index.json"))
        if data is None:  # a task without documents writes no index
            continue
        config = config or data["config"]
        merged.extend(data["chunks"])
    listed = sorted(c["filename"] for c in merged)
    if listed != sorted(chunks):
        raise RuntimeError(f"{out_dir}: the task indexes list {listed} but the tasks wrote {sorted(chunks)}.")
    digest = hashlib.sha256(json.dumps(chunks, sort_keys=True).encode()).hexdigest()[:16]
    index = {"chunks": merged, "config": config, "updated_at": digest}
    atomic_write_text(os.path.join(out_dir, "index.json"), json.dumps(index, sort_keys=True))
    for index in writers:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, f"{index}.index.json"))


def verify_chunks(final_dir: str, names: list[str]) -> list[str]:
    """The chunks among ``names`` of a finished source whose size or sha256 differ from its marker."""
    marker = read_json(os.path.join(final_dir, SOURCE_MARKER)) or {}
    recorded = marker.get("chunks", {})
    bad = []
    for name in names:
        path = os.path.join(final_dir, name)
        entry = recorded.get(name)
        if (
            entry is None
            or not os.path.isfile(path)
            or os.path.getsize(path) != entry["bytes"]
            or file_digest(path, "sha256") != entry["sha256"]
        ):
            bad.append(os.path.join(os.path.basename(final_dir), name))
    return bad
