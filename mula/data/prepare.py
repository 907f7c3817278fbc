"""`mula prepare`: tokenize named sources into litdata chunks of token ids, one output folder per source.

Layout of ``output_dir``::

    summary.json            tokenizer facts + per-source counts and mixture weights (read by MulaDataModule)
    mula.lock               held by the job writing the directory (the run-directory lock's mechanism)
    <source>/index.json     litdata index of the chunks (TokensLoader format: one flat stream of token ids)
    <source>/chunk-*.bin
    <source>/mula_source.json   marker written last: input fingerprint, counts, size and sha256 of every
                                chunk; a re-run with identical inputs skips the source, --verify re-hashes
    <source>.partial/       work in progress; a re-run with identical inputs resumes it task by task

Input files are grouped, in sorted order, into tasks of roughly equal bytes: a pure function of the
inputs and settings. Each task is tokenized by one process and written with its own litdata writer
(chunk names carry the task number, ``chunks.py``) and a result file written last; the task indexes
are merged in task order. The bytes are therefore the same for any number of ranks and workers.

A job launched by torchrun, srun or mpiexec (``ranks.py``): rank 0 lists the inputs, takes the lock and
plans (which sources are up to date, which tasks an interrupted job finished); every rank runs every
world-th remaining task with its worker processes; rank 0 then merges, writes the markers and the
summary. With ``shuffle_seed`` the tasks scatter their documents to coarse buckets, a second pass splits
each coarse bucket into fine ones and a third gathers each fine bucket in a permuted order
(``shuffle.py``); each pass starts once every rank has finished the one before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import multiprocessing as mp
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from typing import Any

from mula.checkpoint.atomic import atomic_write_text, replace_path
from mula.checkpoint.lock import LockInfo, RunDirLock
from mula.checkpoint.manifest import file_digest
from mula.data.chunks import TaskChunkWriter
from mula.data.paths import expand_paths, expand_pattern
from mula.data.ranks import Ranks, describe_error, job_ranks, shared_error
from mula.data.readers import FORMATS, ReadStats, iter_documents
from mula.data.shuffle import (
    gather_bucket,
    remove_scatter,
    remove_split,
    shuffle_shape,
    split_coarse,
    write_scatter,
)
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
_PROGRESS_POLL_S = 5.0  # rank 0 lists each unfinished source's folder this often for the job's bar
# The per-task counts summed into a source's totals (a task's result also lists its chunks).
_COUNTS = ("files", "documents", "tokens", "bad_records", "empty_documents", "input_bytes")
_STATS_RE = re.compile(r"(\d+)\.stats\.json")
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
    shuffle_seed: int | None = None  # the documents of every source permuted with this seed, or None

    def totals(self) -> dict[str, int]:
        """Sums over sources of files, documents, tokens, bad records and input bytes."""
        return {k: sum(getattr(s, k) for s in self.sources) for k in _COUNTS}

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (the content of summary.json)."""
        return {
            "format": "mula-tokens",
            "version": FORMAT_VERSION,
            "output_dir": self.output_dir,
            "tokenizer": self.tokenizer,
            "dtype": self.dtype,
            "shuffle_seed": self.shuffle_seed,
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
    source: str = ""
    input_bytes: int = 0
    # The global shuffle (mula/data/shuffle.py): pass-1 tasks scatter, pass-2 "split" tasks spread one
    # coarse bucket over its fine ones, pass-3 "bucket" tasks gather one fine bucket into chunks.
    kind: str = "tokenize"  # or "split" or "bucket"
    shuffle_seed: int | None = None
    tasks: int = 0  # the tokenize tasks of the source
    coarse: int = 0  # the coarse buckets (pass 1 -> 2) and fine buckets per coarse one (pass 2 -> 3)
    fine: int = 0
    eos_id: int = -1
    dtype: str = "uint16"


@dataclass
class _SourcePlan:
    """What rank 0 decided for one source; broadcast to every rank."""

    spec: SourceSpec
    fingerprint: dict[str, Any]
    final_dir: str
    partial_dir: str
    tasks: list[_Task]
    done: set[int]  # tasks finished by an earlier, interrupted run
    up_to_date: SourceSummary | None  # set when the source is finished and unchanged: nothing to do
    splits: list[_Task] = field(default_factory=list)  # the shuffle's pass 2 (empty without a shuffle)
    buckets: list[_Task] = field(default_factory=list)  # the shuffle's pass 3 (empty without a shuffle)


class _PrepareLock(RunDirLock):
    """The run-directory lock's mechanism on a prepare output directory: one prepare job writes it."""

    def refusal(self, holder: LockInfo) -> str:
        """One sentence naming the job that holds the output directory."""
        return (
            f"{self.path.parent} is being prepared by another job ({holder.describe()}): two prepare jobs on one"
            " output directory would interleave their chunks, so this one stops; wait for that job to end, use"
            f" another output directory, or delete {self.path} if that job is dead."
        )


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


def _encode_into(tok: LoadedTokenizer, texts: list[str], add: Callable[[Any], None]) -> int:
    """Encode a batch of documents (EOS appended), hand each to ``add``; the number of tokens."""
    tokens = 0
    for ids in tok.encode_documents(texts) if texts else []:
        add(ids)
        tokens += len(ids)
    return tokens


def _result_path(task: _Task) -> str:
    """The file a task writes last: its presence means the task is complete."""
    if task.kind == "tokenize":
        return _stats_path(task.out_dir, task.index)
    return os.path.join(task.out_dir, f"{task.index}.{task.kind}.json")


def _run_task(task: _Task) -> dict[str, Any]:
    """Tokenize one task's files into litdata chunks ``chunk-<task>-*.bin`` + ``<task>.index.json``
    (with a shuffle seed: into the task's scatter files), or gather one shuffle bucket into its chunks.

    Returns the task's counts and the size and sha256 of each chunk it wrote (also saved, last, as
    ``_result_path(task)``: its presence means the task is complete).
    """
    assert task.kind == "tokenize" or task.shuffle_seed is not None
    if task.kind == "split":
        result = split_coarse(
            task.out_dir, task.index, task.tasks, task.fine, task.shuffle_seed, task.eos_id, task.dtype
        )
        atomic_write_text(_result_path(task), json.dumps(result))
        return result
    if task.kind == "bucket":
        docs = gather_bucket(task.out_dir, task.index, task.fine, task.shuffle_seed, task.eos_id, task.dtype)
        with TaskChunkWriter(task.out_dir, task.index, task.chunk_bytes) as writer:
            for ids in docs:
                writer.add(ids)
        result = {"tokens": int(sum(len(d) for d in docs)), "chunks": writer.chunks}
        atomic_write_text(_result_path(task), json.dumps(result))
        remove_split(task.out_dir, task.index, task.fine)
        return result

    tok = _WORKER_TOKENIZER
    assert tok is not None, "worker tokenizer not initialised"
    stats = ReadStats()
    kept: list[Any] = []  # the documents, kept for the shuffle's scatter
    writer = (
        None if task.shuffle_seed is not None else TaskChunkWriter(task.out_dir, task.index, task.chunk_bytes)
    )
    tokens = 0
    with writer or contextlib.nullcontext():
        add = writer.add if writer is not None else kept.append
        batch: list[str] = []
        for file in task.files:
            for text in iter_documents(
                file,
                format=task.format,
                text_key=task.text_key,
                skip_bad_records=task.skip_bad_records,
                stats=stats,
            ):
                batch.append(text)
                if len(batch) >= 256:
                    tokens += _encode_into(tok, batch, add)
                    batch = []
        tokens += _encode_into(tok, batch, add)
    if task.shuffle_seed is not None:
        write_scatter(task.out_dir, task.index, kept, task.shuffle_seed, task.coarse, task.dtype)
    result: dict[str, Any] = {
        "files": len(task.files),
        "documents": stats.documents,
        "tokens": tokens,
        "bad_records": stats.bad_records,
        "empty_documents": stats.empty_documents,
        "input_bytes": sum(os.path.getsize(f) for f in task.files),
        "chunks": writer.chunks if writer is not None else {},
    }
    # Written last (atomically): its presence means this task is complete (used to resume).
    atomic_write_text(_stats_path(task.out_dir, task.index), json.dumps(result))
    return result


def _run_tasks(
    todo: list[_Task],
    workers: int,
    tokenizer: LoadedTokenizer | None,
    tokenizer_path: str,
    eos_token: str | int | None,
    on_done: Callable[[_Task, dict[str, Any]], None],
) -> None:
    """Run this rank's tasks, in this process or in spawned worker processes, reporting each one done."""
    global _WORKER_TOKENIZER
    if workers <= 1:
        _WORKER_TOKENIZER = tokenizer or load_tokenizer(tokenizer_path, eos_token=eos_token)
        for task in todo:
            on_done(task, _run_task(task))
        return
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
            on_done(futures[future], future.result())
    except BrokenProcessPool:
        raise RuntimeError(
            "a tokenizer worker process died; if prepare() is called from a script, put the call under "
            "`if __name__ == '__main__':` (worker processes re-import the main module), or use num_workers=0."
        ) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _fingerprint(
    spec: SourceSpec, files: list[str], tokenizer: LoadedTokenizer, chunk_bytes: str, shuffle_seed: int | None
) -> dict[str, Any]:
    """Everything the output of a source depends on (not its weight, which is applied when sampling)."""
    # The seed only when there is one: sources prepared before the shuffle existed stay up to date.
    return ({"shuffle_seed": shuffle_seed} if shuffle_seed is not None else {}) | {
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


def _merge_indexes(out_dir: str, tasks: list[_Task], chunks: dict[str, dict[str, Any]]) -> None:
    """Merge the per-task litdata indexes into ``index.json`` in task order, byte-identically.

    litdata's own merge stamps the time into ``updated_at`` (its cache key); here it is a digest of the
    chunks' checksums, so the index depends on the content alone and still changes when it does.
    """
    merged: list[dict[str, Any]] = []
    config = None
    for task in tasks:
        data = _read_json(os.path.join(out_dir, f"{task.index}.index.json"))
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
    for task in tasks:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, f"{task.index}.index.json"))


def _plan_source(
    spec: SourceSpec,
    files: list[str],
    tokenizer: LoadedTokenizer,
    output_dir: str,
    skip_bad_records: bool,
    overwrite: bool,
    chunk_bytes: str,
    shuffle_seed: int | None,
) -> _SourcePlan:
    """Rank 0: is the source up to date, and which of its tasks remain (resuming a partial run)."""
    final_dir = os.path.join(output_dir, spec.name)
    partial_dir = final_dir + ".partial"
    fingerprint = _fingerprint(spec, files, tokenizer, chunk_bytes, shuffle_seed)
    marker = _read_json(os.path.join(final_dir, SOURCE_MARKER))
    if marker is not None and marker.get("fingerprint") == fingerprint:
        summary = SourceSummary(name=spec.name, weight=spec.weight, **marker["stats"])
        summary.status = "up to date"
        return _SourcePlan(spec, fingerprint, final_dir, partial_dir, [], set(), summary)
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
        atomic_write_text(os.path.join(partial_dir, "fingerprint.json"), json.dumps(fingerprint))
    sizes = [os.path.getsize(f) for f in files]
    tasks = [
        _Task(i, group, partial_dir, spec.format, spec.text_key, skip_bad_records, chunk_bytes, spec.name)
        for i, group in enumerate(_plan_tasks(files, sizes))
    ]
    size_of = dict(zip(files, sizes))
    coarse, fine = shuffle_shape(len(tasks))
    shuffle = dict(shuffle_seed=shuffle_seed, tasks=len(tasks), coarse=coarse, fine=fine)
    shuffle.update(eos_id=tokenizer.eos_id, dtype=_token_dtype_name(tokenizer))
    for task in tasks:
        task.input_bytes = sum(size_of[f] for f in task.files)
        if shuffle_seed is not None:
            vars(task).update(shuffle)

    def shuffle_pass(kind: str, count: int) -> list[_Task]:
        common = (partial_dir, spec.format, spec.text_key, skip_bad_records, chunk_bytes, spec.name)
        return [
            _Task(i, [], *common, kind=kind, **shuffle)
            for i in range(count if shuffle_seed is not None else 0)
        ]

    splits, buckets = shuffle_pass("split", coarse), shuffle_pass("bucket", coarse * fine)
    # One listing per source, not one stat per task: cheap on a shared filesystem.
    present = set(os.listdir(partial_dir))
    done = {t.index for t in tasks if os.path.basename(_stats_path(partial_dir, t.index)) in present}
    return _SourcePlan(spec, fingerprint, final_dir, partial_dir, tasks, done, None, splits, buckets)


def _shuffle_pass_to_run(plans: list[_SourcePlan], kind: str) -> list[_Task]:
    """Rank 0, the pass before done everywhere: the shuffle's ``kind`` tasks an earlier run did not finish.

    Once every split is done the scatter files have no reader left: they are removed here, before the
    gather pass, so a source's disk footprint peaks at about twice its tokens.
    """
    todo = []
    for plan in plans:
        work = plan.splits if kind == "split" else plan.buckets
        if not work:
            continue
        if kind == "bucket":
            remove_scatter(plan.partial_dir, len(plan.tasks))
        present = set(os.listdir(plan.partial_dir))
        todo += [t for t in work if os.path.basename(_result_path(t)) not in present]
    return todo


def _finish_source(plan: _SourcePlan) -> SourceSummary:
    """Rank 0, every task done: merge the indexes, write the marker with the chunk checksums, swap in."""
    results = []
    for task in plan.tasks:
        result = _read_json(_stats_path(plan.partial_dir, task.index))
        if result is None:
            raise RuntimeError(
                f"source {plan.spec.name!r}: task {task.index} has no result after every rank ended."
            )
        results.append(result)
    totals = {k: sum(r[k] for r in results) for k in _COUNTS}
    if totals["tokens"] == 0:
        raise ValueError(f"source {plan.spec.name!r} produced no tokens (every document was empty or bad).")
    writers = plan.tasks
    if plan.buckets:  # the chunks were written by the shuffle's buckets
        writers = plan.buckets
        results = [_read_json(_result_path(b)) for b in plan.buckets]
        if any(r is None for r in results):
            raise RuntimeError(
                f"source {plan.spec.name!r}: a shuffle bucket has no result after every rank ended."
            )
    chunks = {name: entry for r in results for name, entry in r["chunks"].items()}
    _merge_indexes(plan.partial_dir, writers, chunks)
    for task in [*plan.tasks, *plan.splits, *plan.buckets]:
        os.remove(_result_path(task))
    for bucket in plan.buckets:  # left by a bucket task killed between its result and its cleanup
        remove_split(plan.partial_dir, bucket.index, bucket.fine)
    os.remove(os.path.join(plan.partial_dir, "fingerprint.json"))
    marker = {"fingerprint": plan.fingerprint, "stats": totals, "chunks": chunks}
    atomic_write_text(os.path.join(plan.partial_dir, SOURCE_MARKER), json.dumps(marker))
    # Swap the finished folder in; an existing one is only removed once its replacement is complete.
    replace_path(plan.partial_dir, plan.final_dir)
    return SourceSummary(name=plan.spec.name, weight=plan.spec.weight, **totals)


def _verify_source(final_dir: str, names: list[str]) -> list[str]:
    """The chunks among ``names`` of a finished source whose size or sha256 differ from its marker."""
    marker = _read_json(os.path.join(final_dir, SOURCE_MARKER)) or {}
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


def _chunks_to_verify(plans: list[_SourcePlan]) -> list[tuple[str, str]]:
    """Rank 0: (source folder, chunk name) of every finished source, from the markers; refuses a source
    whose marker records no checksums."""
    work = []
    for plan in plans:
        marker = _read_json(os.path.join(plan.final_dir, SOURCE_MARKER)) or {}
        if "chunks" not in marker:
            raise ValueError(
                f"{plan.final_dir} records no chunk checksums (prepared by an older Mula); prepare it again "
                "with overwrite=True to verify it."
            )
        work.extend((plan.final_dir, name) for name in sorted(marker["chunks"]))
    return work


class _JobProgress:
    """Rank 0's one bar for the whole job: input bytes of finished tasks (every rank's, read from the
    task results on disk every few seconds), with tokens per second."""

    def __init__(self, plans: list[_SourcePlan], todo: list[_Task], enabled: bool) -> None:
        from tqdm.auto import tqdm

        self._todo = {(t.out_dir, t.index): t for t in todo}
        self._dirs = sorted({t.out_dir for t in todo})
        self._seen: set[tuple[str, int]] = set()
        self.tokens = 0
        self._start = time.monotonic()
        self._bar = tqdm(
            total=sum(t.input_bytes for t in todo),
            unit="B",
            unit_scale=True,
            desc="prepare",
            disable=not enabled or not todo,
            dynamic_ncols=True,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll_loop, name="mula-prepare-progress", daemon=True)
        if enabled and todo:
            self._thread.start()

    def _poll_loop(self) -> None:
        while not self._stop.wait(_PROGRESS_POLL_S):
            self.poll()

    def poll(self) -> None:
        """Count the tasks that finished since the last poll (one directory listing per source)."""
        for out_dir in self._dirs:
            with contextlib.suppress(OSError):
                for name in os.listdir(out_dir):
                    match = _STATS_RE.fullmatch(name)  # not the temporary name of one being written
                    if match is None:
                        continue
                    key = (out_dir, int(match[1]))
                    if key in self._seen or key not in self._todo:
                        continue
                    result = _read_json(os.path.join(out_dir, name))
                    if result is None:
                        continue
                    self._seen.add(key)
                    self.tokens += result["tokens"]
                    self._bar.update(self._todo[key].input_bytes)
        rate = self.tokens / max(time.monotonic() - self._start, 1e-9)
        self._bar.set_postfix_str(f"{self.tokens:,} tokens, {rate:,.0f} tokens/s", refresh=False)

    def close(self) -> None:
        """Stop polling; a last poll shows the final count."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
            self.poll()
        self._bar.close()


def _format_rates(reports: list[dict[str, Any]]) -> str:
    """One line per rank: tasks, tokens and tokens per second of its share."""
    lines = []
    for r in reports:
        rate = r["tokens"] / r["seconds"] if r["seconds"] > 0 else 0.0
        lines.append(
            f"rank {r['rank']:>4} ({r['host']}): {r['tasks']:>5} tasks {r['tokens']:>15,} tokens"
            f" {rate:>13,.0f} tokens/s"
        )
    return "\n".join(lines)


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
    verify: bool = False,
    shuffle_seed: int | None = None,
    distributed: bool = True,
) -> PrepareSummary:
    """Tokenize named sources (EOS after every document) into litdata chunks for MulaDataModule.

    A source whose inputs, tokenizer and settings are unchanged since a previous run is skipped; an
    interrupted source resumes from its finished tasks. Launched by torchrun, srun or mpiexec, every
    rank takes its share of the tasks (the output is the same whatever the number of ranks and workers)
    and rank 0 finishes each source. One job at a time writes an output directory. A summary table is
    printed and saved as ``<output_dir>/summary.json``.

    Args:
        sources: Named sources, each with path globs (``{stdlib}`` = the Python standard library), a mixture
            weight (1.0 = natural proportion), a format (auto, jsonl, parquet, text) and the text field.
        tokenizer_path: A Hugging Face tokenizer.json (or a model directory holding one).
        output_dir: Where to write one sub-folder per source plus summary.json.
        num_workers: Tokenizer processes per rank (default: all CPU cores of the rank's node divided by
            the ranks on it); 0 or 1 tokenizes in the rank's own process.
        skip_bad_records: Skip and count malformed records instead of failing on the first one.
        overwrite: Replace a source folder that was prepared from different inputs.
        eos_token: End-of-document token (default: found in the tokenizer).
        chunk_bytes: Size of each litdata chunk file.
        progress: Show one progress bar for the job and print the summary and each rank's throughput.
        verify: Also re-read every chunk of every source and check it against the size and sha256
            recorded when it was written (spread over the ranks); a mismatch stops with the chunk's name.
        shuffle_seed: Permute the documents of each source across the whole source with this seed (a
            two-pass shuffle over the tasks, recorded in each source's marker and in summary.json), so that
            the prepared order carries no bias of the input order; None keeps the input order.
        distributed: Spread the work over the ranks of a torchrun / srun / mpiexec launch (read from
            their environment variables), or over every rank of an initialised torch.distributed job
            (each must call prepare); false: this process alone.

    Returns:
        The summary (also written to summary.json), on every rank.
    """
    specs = [_as_spec(s) for s in sources]
    if not specs:
        raise ValueError("no sources given to prepare.")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"source names must be unique, got {names}.")
    if num_workers is not None and num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}.")
    ranks = job_ranks(distributed)
    lock: list[_PrepareLock] = []
    try:
        return _prepare_job(
            ranks,
            specs,
            tokenizer_path,
            output_dir,
            num_workers,
            skip_bad_records,
            overwrite,
            eos_token,
            chunk_bytes,
            progress,
            verify,
            shuffle_seed,
            lock,
        )
    finally:
        for held in lock:
            held.release()
        ranks.close()


def _prepare_job(
    ranks: Ranks,
    specs: list[SourceSpec],
    tokenizer_path: str,
    output_dir: str,
    num_workers: int | None,
    skip_bad_records: bool,
    overwrite: bool,
    eos_token: str | None,
    chunk_bytes: str,
    progress: bool,
    verify: bool,
    shuffle_seed: int | None,
    lock: list[_PrepareLock],
) -> PrepareSummary:
    """`prepare` on every rank: rank 0 plans, every rank runs its share, rank 0 finishes (see module doc)."""
    loaded: list[LoadedTokenizer] = []

    def plan_job() -> tuple[PrepareSummary, list[_SourcePlan]]:
        # Check every input pattern and the tokenizer before any expensive work; rank 0 alone lists the
        # inputs (one glob per pattern for the whole job, not one per rank).
        files = {s.name: expand_paths(s.paths, what=f"source {s.name!r}") for s in specs}
        tokenizer = load_tokenizer(tokenizer_path, eos_token=eos_token)
        loaded.append(tokenizer)
        out = os.path.abspath(expand_pattern(output_dir))
        os.makedirs(out, exist_ok=True)
        held = _PrepareLock(out)
        held.acquire()
        lock.append(held)
        summary = PrepareSummary(
            output_dir=out,
            tokenizer={
                "path": os.path.abspath(tokenizer.path),  # found again from a run in another directory
                "sha256": tokenizer.sha256,
                "vocab_size": tokenizer.vocab_size,
                "eos_id": tokenizer.eos_id,
                "eos_token": tokenizer.eos_token,
            },
            dtype=str(_token_dtype_name(tokenizer)),
            shuffle_seed=shuffle_seed,
        )
        plans = [
            _plan_source(
                s, files[s.name], tokenizer, out, skip_bad_records, overwrite, chunk_bytes, shuffle_seed
            )
            for s in specs
        ]
        return summary, plans

    summary, plans = ranks.on_zero(plan_job)
    # The task list is a pure function of the inputs and settings; each rank takes every world-th one.
    todo = [t for p in plans for t in p.tasks if t.index not in p.done]
    mine = todo[ranks.rank :: ranks.world]
    if ranks.rank == 0:
        resumed = sum(len(p.done) for p in plans)
        if resumed:
            log.info("resuming: %d of %d tasks already done", resumed, resumed + len(todo))
        log.info("%d tasks to run on %d rank(s)", len(todo), ranks.world)
    bar = _JobProgress(plans, todo, progress) if ranks.rank == 0 else None
    report = _run_share(ranks, mine, loaded, summary.tokenizer["path"], eos_token, num_workers)
    if bar is not None:
        bar.close()
    reports = ranks.gather(report)
    # Each shuffle pass starts once every rank has finished the one before (it reads what every task wrote).
    previous = reports
    for kind in ("split", "bucket") if any(p.buckets for p in plans) else ():
        work = ranks.on_zero(lambda: _raise_failures(previous) or _shuffle_pass_to_run(plans, kind))  # noqa: B023
        if ranks.rank == 0:
            log.info("%d shuffle %s tasks to run on %d rank(s)", len(work), kind, ranks.world)
        share = work[ranks.rank :: ranks.world]
        previous = ranks.gather(
            _run_share(ranks, share, loaded, summary.tokenizer["path"], eos_token, num_workers)
        )

    def finish_job() -> tuple[PrepareSummary, list[tuple[str, str]]]:
        assert reports is not None
        _raise_failures(previous)
        for plan in plans:
            summary.sources.append(plan.up_to_date or _finish_source(plan))
        atomic_write_text(
            os.path.join(summary.output_dir, SUMMARY_FILE), json.dumps(summary.to_dict(), indent=2)
        )
        if progress:
            print(summary.format_table())
            if todo:
                print(_format_rates(reports))
            print(f"wrote {os.path.join(summary.output_dir, SUMMARY_FILE)}")
        return summary, (_chunks_to_verify(plans) if verify else [])

    summary, checks = ranks.on_zero(finish_job)
    if verify:
        bad = [
            b
            for final_dir, name in checks[ranks.rank :: ranks.world]
            for b in _verify_source(final_dir, [name])
        ]
        every_bad = ranks.gather(bad)

        def judge() -> None:
            assert every_bad is not None
            wrong = sorted(b for part in every_bad for b in part)
            if wrong:
                raise ValueError(
                    f"{len(wrong)} chunk(s) differ from the checksums recorded when they were written "
                    f"({', '.join(wrong[:5])}{', ...' if len(wrong) > 5 else ''}); delete those sources and "
                    "prepare them again."
                )
            if progress:
                print(f"verified {len(checks)} chunks: all match their checksums")

        ranks.on_zero(judge)
    return summary


def _raise_failures(reports: list[dict[str, Any]] | None) -> None:
    """Rank 0: stop the job with the first error a rank reported (the same sentence on every rank)."""
    failed = [r for r in reports or [] if r["error"] is not None]
    if failed:
        raise shared_error(failed[0]["rank"], *failed[0]["error"])


def _run_share(
    ranks: Ranks,
    mine: list[_Task],
    loaded: list[LoadedTokenizer],
    tokenizer_path: str,
    eos_token: str | None,
    num_workers: int | None,
) -> dict[str, Any]:
    """Run this rank's tasks; its report (counts, seconds, or the error that stopped it) for rank 0."""
    if num_workers is None:
        # The cores this rank may use (srun and mpiexec bind each rank to its share), divided by the ranks
        # torchrun started on this node (it binds nothing).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        num_workers = max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1)))
    report: dict[str, Any] = {
        "rank": ranks.rank,
        "host": socket.gethostname(),
        "tasks": 0,
        "tokens": 0,
        "seconds": 0.0,
        "error": None,
    }
    start = time.monotonic()

    def on_done(task: _Task, result: dict[str, Any]) -> None:
        report["tasks"] += 1
        report["tokens"] += result["tokens"]
        kind = "task" if task.kind == "tokenize" else task.kind
        log.info(
            "rank %d: %s %s %d done: %d tokens", ranks.rank, task.source, kind, task.index, result["tokens"]
        )

    try:
        if mine:
            tokenizer = loaded[0] if loaded else None
            _run_tasks(mine, min(num_workers, len(mine)), tokenizer, tokenizer_path, eos_token, on_done)
    except Exception as exc:  # reported to rank 0, which stops every rank with it
        if ranks.world == 1:
            raise
        report["error"] = describe_error(exc)
        log.error("rank %d failed: %s: %s", ranks.rank, type(exc).__name__, exc)
    report["seconds"] = time.monotonic() - start
    return report


def _token_dtype_name(tokenizer: LoadedTokenizer) -> str:
    from mula.data.tokenizer import token_dtype

    return token_dtype(tokenizer.vocab_size).name
