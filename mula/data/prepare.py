"""`mula prepare`: tokenize named sources into litdata chunks of token ids, one output folder per source.

Layout of ``output_dir``::

    summary.json            tokenizer facts + per-source counts and mixture weights (read by MulaDataModule)
    <source>/index.json     litdata index of the chunks (TokensLoader format: one flat stream of token ids)
    <source>/chunk-*.bin
    <source>/mula_source.json   marker written last: input fingerprint + counts; a re-run with identical
                                inputs skips the source
    <source>.partial/       work in progress; a re-run with identical inputs resumes it task by task

Input files are grouped, in sorted order, into tasks of roughly equal bytes; each task is tokenized by one
worker process and written with its own litdata writer (chunk names carry the task number), and the task
indexes are merged in task order. The token stream is therefore the same for any number of workers.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing as mp
import os
import re
import shutil
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from typing import Any

from mula.checkpoint.atomic import atomic_write_text, replace_path
from mula.data.paths import expand_paths, expand_pattern
from mula.data.readers import FORMATS, ReadStats, iter_documents
from mula.data.tokenizer import LoadedTokenizer, load_tokenizer

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
SOURCE_MARKER = "mula_source.json"
FORMAT_VERSION = 1
# Task sizing: aim for ~16 tasks per source, but not below 1 MB (each litdata chunk loses < seq_len + 1 tail
# tokens to window alignment) nor above 256 MB (memory and restart granularity per worker).
_MIN_TASK_BYTES = 1 << 20
_MAX_TASK_BYTES = 256 << 20
_TASKS_PER_SOURCE = 16
_ITEM_TOKENS = 1 << 20  # documents are concatenated into litdata items of about this many tokens
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class SourceSpec:
    """One named input source of a data mixture.

    Attributes:
        name: Output sub-folder name (letters, digits, ``_ . -``), e.g. "dclm" or "starcoder".
        paths: Files, directories or glob patterns (``**`` recurses; ``{stdlib}`` = the Python standard library).
        weight: Sampling weight relative to the source's natural size: 1.0 samples the source in proportion to
            its tokens, 2.0 twice as often (upsampling), 0.5 half as often. MulaDataModule can override it.
        format: auto (from the file name), jsonl, parquet or text (a whole file is one document).
        text_key: JSON field / parquet column that holds the text.
    """

    name: str
    paths: list[str]
    weight: float = 1.0
    format: str = "auto"
    text_key: str = "text"


@dataclass
class SourceSummary:
    """Counts for one prepared source."""

    name: str
    weight: float
    files: int = 0
    documents: int = 0
    tokens: int = 0
    bad_records: int = 0
    empty_documents: int = 0
    input_bytes: int = 0
    status: str = "prepared"  # "prepared" now, or "up to date" (skipped)


@dataclass
class PrepareSummary:
    """What `prepare` produced; saved as ``summary.json`` in the output directory."""

    output_dir: str
    tokenizer: dict[str, Any]
    dtype: str
    sources: list[SourceSummary] = field(default_factory=list)

    def totals(self) -> dict[str, int]:
        """Sums over sources of files, documents, tokens, bad records and input bytes."""
        keys = ("files", "documents", "tokens", "bad_records", "empty_documents", "input_bytes")
        return {k: sum(getattr(s, k) for s in self.sources) for k in keys}

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (the content of summary.json)."""
        return {
            "format": "mula-tokens",
            "version": FORMAT_VERSION,
            "output_dir": self.output_dir,
            "tokenizer": self.tokenizer,
            "dtype": self.dtype,
            "sources": [asdict(s) for s in self.sources],
            "totals": self.totals(),
        }

    def format_table(self) -> str:
        """A plain-text table of the per-source counts and the totals."""
        header = f"{'source':<16}{'files':>8}{'documents':>12}{'tokens':>15}{'bad':>7}  status"
        rows = [header, "-" * len(header)]
        for s in self.sources:
            rows.append(
                f"{s.name:<16}{s.files:>8,}{s.documents:>12,}{s.tokens:>15,}{s.bad_records:>7,}  {s.status}"
            )
        t = self.totals()
        rows.append(
            f"{'total':<16}{t['files']:>8,}{t['documents']:>12,}{t['tokens']:>15,}{t['bad_records']:>7,}"
        )
        return "\n".join(rows)


def _as_spec(source: SourceSpec | Mapping[str, Any]) -> SourceSpec:
    spec = source if isinstance(source, SourceSpec) else SourceSpec(**dict(source))
    if not _NAME_RE.match(spec.name or ""):
        raise ValueError(f"source name {spec.name!r} must be letters, digits, '_', '.' or '-'.")
    if isinstance(spec.paths, str):
        spec.paths = [spec.paths]
    if not spec.paths:
        raise ValueError(f"source {spec.name!r} has no paths.")
    if not (math.isfinite(spec.weight) and spec.weight >= 0):
        raise ValueError(f"source {spec.name!r}: weight must be a finite number >= 0, got {spec.weight}.")
    if spec.format not in FORMATS:
        raise ValueError(f"source {spec.name!r}: format must be one of {FORMATS}, got {spec.format!r}.")
    return spec


def _plan_tasks(files: list[str], sizes: list[int]) -> list[list[str]]:
    """Group consecutive files into tasks of about total/16 bytes (clamped), in file order."""
    target = min(max(sum(sizes) // _TASKS_PER_SOURCE, _MIN_TASK_BYTES), _MAX_TASK_BYTES)
    tasks: list[list[str]] = [[]]
    acc = 0
    for f, size in zip(files, sizes):
        if tasks[-1] and acc >= target:
            tasks.append([])
            acc = 0
        tasks[-1].append(f)
        acc += size
    return tasks


@dataclass
class _Task:
    index: int
    files: list[str]
    out_dir: str
    format: str
    text_key: str
    skip_bad_records: bool
    chunk_bytes: str


class _LogQueue:
    """Receives litdata's writer messages (it would print them otherwise) and logs them at debug level."""

    def put_nowait(self, msg: str) -> None:
        log.debug(msg)


# Tokenizer of a worker process, loaded once by the pool initializer.
_WORKER_TOKENIZER: LoadedTokenizer | None = None


def _init_worker(tokenizer_path: str, eos_token: str | int | None, single_threaded: bool) -> None:
    global _WORKER_TOKENIZER
    if single_threaded:
        # N worker processes each running a Rust thread pool would oversubscribe the cores.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_TOKENIZER = load_tokenizer(tokenizer_path, eos_token=eos_token)


def _stats_path(out_dir: str, index: int) -> str:
    return os.path.join(out_dir, f"{index}.stats.json")


def _run_task(task: _Task) -> dict[str, int]:
    """Tokenize one task's files into litdata chunks ``chunk-<task>-*.bin`` + ``<task>.index.json``."""
    import numpy as np
    from litdata.streaming.item_loader import TokensLoader
    from litdata.streaming.writer import BinaryWriter

    tok = _WORKER_TOKENIZER
    assert tok is not None, "worker tokenizer not initialised"
    for stale in os.listdir(task.out_dir):  # leftovers of an interrupted attempt at this task
        if stale.startswith(f"chunk-{task.index}-") or stale == f"{task.index}.index.json":
            os.remove(os.path.join(task.out_dir, stale))
    stats = ReadStats()
    tokens = 0
    # litdata names chunks and the per-writer index after this rank; one rank per task keeps them apart.
    previous_rank = os.environ.get("DATA_OPTIMIZER_GLOBAL_RANK")
    os.environ["DATA_OPTIMIZER_GLOBAL_RANK"] = str(task.index)
    try:
        writer = BinaryWriter(
            task.out_dir, chunk_bytes=task.chunk_bytes, item_loader=TokensLoader(), msg_queue=_LogQueue()
        )
        item, pending, pending_tokens, batch = 0, [], 0, []

        def flush_pending() -> None:
            nonlocal item, pending, pending_tokens
            if pending:
                writer.add_item(item, np.concatenate(pending))
                item += 1
                pending, pending_tokens = [], 0

        def encode(texts: list[str]) -> None:
            nonlocal tokens, pending_tokens
            for ids in tok.encode_documents(texts):
                pending.append(ids)
                pending_tokens += len(ids)
                tokens += len(ids)
            if pending_tokens >= _ITEM_TOKENS:
                flush_pending()

        for file in task.files:
            docs = iter_documents(
                file,
                format=task.format,
                text_key=task.text_key,
                skip_bad_records=task.skip_bad_records,
                stats=stats,
            )
            for text in docs:
                batch.append(text)
                if len(batch) >= 256:
                    encode(batch)
                    batch = []
        if batch:
            encode(batch)
        flush_pending()
        writer.done()
    finally:
        if previous_rank is None:
            os.environ.pop("DATA_OPTIMIZER_GLOBAL_RANK", None)
        else:
            os.environ["DATA_OPTIMIZER_GLOBAL_RANK"] = previous_rank
    result = {
        "files": len(task.files),
        "documents": stats.documents,
        "tokens": tokens,
        "bad_records": stats.bad_records,
        "empty_documents": stats.empty_documents,
        "input_bytes": sum(os.path.getsize(f) for f in task.files),
    }
    # Written last: its presence means this task is complete (used to resume an interrupted source).
    with open(_stats_path(task.out_dir, task.index), "w") as fh:
        json.dump(result, fh)
    return result


def _run_pool(
    todo: list[_Task],
    workers: int,
    tokenizer_path: str,
    eos_token: str | int | None,
    results: dict[int, dict[str, int]],
    bar: Any,
) -> None:
    """Run tasks in spawned worker processes, recording each result as it completes."""
    # spawn, not fork: the parent may hold threads (torch, tokenizers' Rust pool, a Lightning trainer).
    # ProcessPoolExecutor, not multiprocessing.Pool: a worker that dies fails the run instead of hanging it.
    pool = ProcessPoolExecutor(
        workers,
        mp_context=mp.get_context("spawn"),
        initializer=_init_worker,
        initargs=(tokenizer_path, eos_token, True),
    )
    futures = {pool.submit(_run_task, task): task for task in todo}
    try:
        for future in as_completed(futures):
            res = future.result()
            results[futures[future].index] = res
            bar.update(res["input_bytes"])
    except BrokenProcessPool:
        raise RuntimeError(
            "a tokenizer worker process died; if prepare() is called from a script, put the call under "
            "`if __name__ == '__main__':` (worker processes re-import the main module), or use num_workers=0."
        ) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _fingerprint(
    spec: SourceSpec, files: list[str], tokenizer: LoadedTokenizer, chunk_bytes: str
) -> dict[str, Any]:
    """Everything the output of a source depends on (not its weight, which is applied when sampling)."""
    return {
        "version": FORMAT_VERSION,
        "files": [[f, os.path.getsize(f), os.stat(f).st_mtime_ns] for f in files],
        "format": spec.format,
        "text_key": spec.text_key,
        "tokenizer_sha256": tokenizer.sha256,
        "eos_id": tokenizer.eos_id,
        "chunk_bytes": chunk_bytes,
    }


def _read_json(path: str) -> Any:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError):
        return None


def _merge_indexes(out_dir: str) -> None:
    """Merge the per-task litdata indexes into ``index.json`` in task order."""
    from litdata.streaming.item_loader import TokensLoader
    from litdata.streaming.writer import BinaryWriter

    # _merge_no_wait concatenates ``<n>.index.json`` in natural order of n; merge() would also wait for one
    # index per (distributed rank x worker), which is wrong here (empty tasks write none, and prepare may
    # run inside a distributed job's rank 0).
    BinaryWriter(out_dir, chunk_bytes="64MB", item_loader=TokensLoader())._merge_no_wait()


def _prepare_source(
    spec: SourceSpec,
    files: list[str],
    tokenizer: LoadedTokenizer,
    output_dir: str,
    num_workers: int,
    skip_bad_records: bool,
    overwrite: bool,
    chunk_bytes: str,
    eos_token: str | int | None,
    progress: bool,
) -> SourceSummary:
    final_dir = os.path.join(output_dir, spec.name)
    partial_dir = final_dir + ".partial"
    fingerprint = _fingerprint(spec, files, tokenizer, chunk_bytes)
    marker = _read_json(os.path.join(final_dir, SOURCE_MARKER))
    if marker is not None and marker.get("fingerprint") == fingerprint:
        summary = SourceSummary(name=spec.name, weight=spec.weight, **marker["stats"])
        summary.status = "up to date"
        return summary
    if os.path.exists(final_dir) and not overwrite:
        what = "different inputs or tokenizer" if marker is not None else "something else"
        raise ValueError(
            f"{final_dir} already holds data prepared from {what}; pass overwrite=True to replace it "
            "or choose another output directory."
        )
    # Resume a partial run only if it was made from exactly the same inputs; otherwise start afresh.
    if _read_json(os.path.join(partial_dir, "fingerprint.json")) != fingerprint:
        shutil.rmtree(partial_dir, ignore_errors=True)
        os.makedirs(partial_dir)
        with open(os.path.join(partial_dir, "fingerprint.json"), "w") as fh:
            json.dump(fingerprint, fh)

    sizes = [os.path.getsize(f) for f in files]
    plan = _plan_tasks(files, sizes)
    tasks = [
        _Task(i, group, partial_dir, spec.format, spec.text_key, skip_bad_records, chunk_bytes)
        for i, group in enumerate(plan)
    ]
    results: dict[int, dict[str, int]] = {}
    todo = []
    for task in tasks:
        done = _read_json(_stats_path(partial_dir, task.index))
        if done is not None:
            results[task.index] = done
        else:
            todo.append(task)

    from tqdm.auto import tqdm

    bar = tqdm(
        total=sum(sizes),
        initial=sum(r["input_bytes"] for r in results.values()),
        unit="B",
        unit_scale=True,
        desc=f"prepare {spec.name}",
        disable=not progress,
        dynamic_ncols=True,
    )
    try:
        workers = min(num_workers, len(todo))
        if workers <= 1:
            global _WORKER_TOKENIZER
            _WORKER_TOKENIZER = tokenizer
            for task in todo:
                results[task.index] = _run_task(task)
                bar.update(results[task.index]["input_bytes"])
        elif todo:
            _run_pool(todo, workers, tokenizer.path, eos_token, results, bar)
    finally:
        bar.close()

    totals = {k: sum(r[k] for r in results.values()) for k in next(iter(results.values()))}
    if totals["tokens"] == 0:
        raise ValueError(f"source {spec.name!r} produced no tokens (every document was empty or bad).")
    if not os.path.exists(os.path.join(partial_dir, "index.json")):
        _merge_indexes(partial_dir)
    for task in tasks:
        os.remove(_stats_path(partial_dir, task.index))
    os.remove(os.path.join(partial_dir, "fingerprint.json"))
    with open(os.path.join(partial_dir, SOURCE_MARKER), "w") as fh:
        json.dump({"fingerprint": fingerprint, "stats": totals}, fh)
    # Swap the finished folder in; an existing one is only removed once its replacement is complete.
    replace_path(partial_dir, final_dir)
    return SourceSummary(name=spec.name, weight=spec.weight, **totals)


def prepare(
    sources: list[SourceSpec],
    tokenizer_path: str,
    output_dir: str,
    num_workers: int | None = None,
    skip_bad_records: bool = False,
    overwrite: bool = False,
    eos_token: str | None = None,
    chunk_bytes: str = "64MB",
    progress: bool = True,
) -> PrepareSummary:
    """Tokenize named sources (EOS after every document) into litdata chunks for MulaDataModule.

    A source whose inputs, tokenizer and settings are unchanged since a previous run is skipped; an
    interrupted source resumes from its finished tasks. A summary table is printed and saved as
    ``<output_dir>/summary.json``.

    Args:
        sources: Named sources, each with path globs (``{stdlib}`` = the Python standard library), a mixture
            weight (1.0 = natural proportion), a format (auto, jsonl, parquet, text) and the text field.
        tokenizer_path: A Hugging Face tokenizer.json (or a model directory holding one).
        output_dir: Where to write one sub-folder per source plus summary.json.
        num_workers: Tokenizer processes (default: all CPU cores); 0 or 1 tokenizes in this process.
        skip_bad_records: Skip and count malformed records instead of failing on the first one.
        overwrite: Replace a source folder that was prepared from different inputs.
        eos_token: End-of-document token (default: found in the tokenizer).
        chunk_bytes: Size of each litdata chunk file.
        progress: Show a progress bar per source and print the summary.

    Returns:
        The summary (also written to summary.json).
    """
    specs = [_as_spec(s) for s in sources]
    if not specs:
        raise ValueError("no sources given to prepare.")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"source names must be unique, got {names}.")
    # Check every input pattern before any expensive work.
    files = {s.name: expand_paths(s.paths, what=f"source {s.name!r}") for s in specs}
    tokenizer = load_tokenizer(tokenizer_path, eos_token=eos_token)
    num_workers = (os.cpu_count() or 1) if num_workers is None else num_workers
    output_dir = os.path.abspath(expand_pattern(output_dir))
    os.makedirs(output_dir, exist_ok=True)

    summary = PrepareSummary(
        output_dir=output_dir,
        tokenizer={
            "path": os.path.abspath(tokenizer.path),  # found again from a run in another directory
            "sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "eos_token": tokenizer.eos_token,
        },
        dtype=str(_token_dtype_name(tokenizer)),
    )
    for spec in specs:
        summary.sources.append(
            _prepare_source(
                spec,
                files[spec.name],
                tokenizer,
                output_dir,
                num_workers,
                skip_bad_records,
                overwrite,
                chunk_bytes,
                eos_token,
                progress,
            )
        )
    atomic_write_text(os.path.join(output_dir, SUMMARY_FILE), json.dumps(summary.to_dict(), indent=2))
    if progress:
        print(summary.format_table())
        print(f"wrote {os.path.join(output_dir, SUMMARY_FILE)}")
    return summary


def _token_dtype_name(tokenizer: LoadedTokenizer) -> str:
    from mula.data.tokenizer import token_dtype

    return token_dtype(tokenizer.vocab_size).name
