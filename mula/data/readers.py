"""Iterate the documents of one input file: Dolma-style JSONL (plain, gzip, zstd), parquet, or plain text.

Formats (``format=``):
  - ``"jsonl"``: one JSON object per line with the text under ``text_key`` (``.jsonl``, ``.json``, optionally
    compressed as ``.gz`` or ``.zst``/``.zstd``; OLMoE-mix-0924's DCLM shards are ``.json.zst``).
  - ``"parquet"``: the string column ``text_key``.
  - ``"text"``: the whole file is one document (``.txt``, or any text file such as ``.py`` sources).
  - ``"auto"``: chosen from the file name (see :func:`detect_format`); other extensions need ``format="text"``.

Malformed input raises ``ValueError`` naming the file and line (row for parquet). With ``skip_bad_records=True``
a bad record is skipped and counted in the ``ReadStats`` passed by the caller instead.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

log = logging.getLogger(__name__)

FORMATS = ("auto", "jsonl", "parquet", "text")
_COMPRESSIONS = (".gz", ".zst", ".zstd")
_JSONL_EXTS = (".jsonl", ".json", ".ndjson")
_TEXT_EXTS = (".txt", ".text", ".md")
# Only the first few skipped records of a file are logged one by one; the rest are only counted.
_MAX_LOGGED_BAD = 5


@dataclass
class ReadStats:
    """Counters a reader updates while iterating a file."""

    documents: int = 0
    bad_records: int = 0
    empty_documents: int = 0


def _split_compression(path: str) -> tuple[str, str]:
    """Return (name without compression suffix, compression suffix or "")."""
    lower = path.lower()
    for ext in _COMPRESSIONS:
        if lower.endswith(ext):
            return lower[: -len(ext)], ext
    return lower, ""


def detect_format(path: str | os.PathLike) -> str:
    """The reader format of a file from its name: "jsonl", "parquet" or "text".

    Raises:
        ValueError: for an extension Mula does not know (read such files with ``format="text"``).
    """
    name, _ = _split_compression(str(path))
    if name.endswith(_JSONL_EXTS):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(_TEXT_EXTS):
        return "text"
    raise ValueError(
        f"{path}: unknown input format (expected .jsonl/.json[.gz|.zst], .parquet or .txt); "
        "set format='text' to read every file as one document."
    )


def _open_binary(path: str) -> IO[bytes]:
    """Open a file for binary reading, decompressing gzip or zstd streams on the fly."""
    _, compression = _split_compression(path)
    if compression == ".gz":
        return gzip.open(path, "rb")
    if compression in (".zst", ".zstd"):
        import zstandard

        # Large windows (zstd --long) appear in web-scale dumps; multi-frame files are concatenated shards.
        dctx = zstandard.ZstdDecompressor(max_window_size=2**31)
        raw = open(path, "rb")  # noqa: SIM115 - closed by the reader below (closefd=True)
        reader = dctx.stream_reader(raw, read_across_frames=True, closefd=True)
        return io.BufferedReader(reader, buffer_size=1 << 20)
    return open(path, "rb")


def _decompression_errors() -> tuple[type[BaseException], ...]:
    import zstandard

    return (gzip.BadGzipFile, EOFError, zstandard.ZstdError, OSError)


class _BadRecord:
    """Either raise for a bad record or count it, depending on ``skip``."""

    def __init__(self, path: str, skip: bool, stats: ReadStats) -> None:
        self.path, self.skip, self.stats = path, skip, stats

    def __call__(self, where: str, reason: str) -> None:
        if not self.skip:
            raise ValueError(
                f"{self.path}, {where}: {reason} (set skip_bad_records to skip and count bad records)."
            )
        self.stats.bad_records += 1
        if self.stats.bad_records <= _MAX_LOGGED_BAD:
            log.warning("skipping bad record in %s, %s: %s", self.path, where, reason)


def _iter_jsonl(path: str, text_key: str, bad: _BadRecord) -> Iterator[str]:
    with _open_binary(path) as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue  # blank lines (often a trailing newline) are not records
            try:
                record = json.loads(line)
            except UnicodeDecodeError:
                bad(f"line {lineno}", "not valid UTF-8")
                continue
            except json.JSONDecodeError as e:
                bad(f"line {lineno}", f"invalid JSON ({e.msg} at column {e.colno})")
                continue
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                bad(f"line {lineno}", f"no string field {text_key!r}")
                continue
            yield text


def _iter_text(path: str, bad: _BadRecord) -> Iterator[str]:
    with _open_binary(path) as fh:
        data = fh.read()
    try:
        yield data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        bad(f"line {line}", "not valid UTF-8")


def _iter_parquet(path: str, text_key: str, bad: _BadRecord) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path}: not a readable parquet file ({e}).") from None
    if text_key not in pf.schema_arrow.names:
        raise ValueError(
            f"{path}: parquet file has no column {text_key!r} (columns: {pf.schema_arrow.names})."
        )
    column_type = pf.schema_arrow.field(text_key).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise ValueError(f"{path}: parquet column {text_key!r} has type {column_type}, expected string.")
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[text_key]):
        for text in batch.column(0).to_pylist():
            row += 1
            if text is None:
                bad(f"row {row}", f"null {text_key!r}")
                continue
            yield text


def iter_documents(
    path: str | os.PathLike,
    format: str = "auto",
    text_key: str = "text",
    skip_bad_records: bool = False,
    stats: ReadStats | None = None,
) -> Iterator[str]:
    """Yield the non-empty documents of one file, in file order.

    Args:
        path: The input file.
        format: "auto", "jsonl", "parquet" or "text" (see the module docstring).
        text_key: JSON field / parquet column that holds the text.
        skip_bad_records: Skip (and count in ``stats``) malformed records instead of raising.
        stats: Counters to update (documents yielded, bad records, empty documents skipped).

    Raises:
        ValueError: malformed input, naming the file and line (or row); unreadable compressed streams.
        FileNotFoundError: the file does not exist.
    """
    path = os.fspath(path)
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}.")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"input file {path} does not exist.")
    stats = stats if stats is not None else ReadStats()
    fmt = detect_format(path) if format == "auto" else format
    bad = _BadRecord(path, skip_bad_records, stats)
    if fmt == "jsonl":
        docs = _iter_jsonl(path, text_key, bad)
    elif fmt == "parquet":
        docs = _iter_parquet(path, text_key, bad)
    else:
        docs = _iter_text(path, bad)
    try:
        for text in docs:
            if not text:
                stats.empty_documents += 1
                continue
            stats.documents += 1
            yield text
    except _decompression_errors() as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"{path}: cannot read the file ({type(e).__name__}: {e}).") from None
