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
import functools
import json
import logging
import multiprocessing as mp
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from mula.checkpoint.atomic import atomic_write_text
from mula.checkpoint.lock import LockInfo, RunDirLock
from mula.data.chunks import TaskChunkWriter, verify_chunks
from mula.data.paths import expand_paths, expand_pattern
from mula.data.prepare_plan import (
    SourcePlan,
    Task,
    chunks_to_verify,
    finish_source,
    plan_source,
    result_path,
    shuffle_pass_to_run,
    stats_path,
    token_dtype_name,
)
from mula.data.prepare_progress import JobProgress, format_rates
from mula.data.prepare_summary import (
    SUMMARY_FILE,
    PrepareSummary,
    SourceSpec,
    as_spec,
    recorded_tokenizer,
)
from mula.data.ranks import Ranks, describe_error, job_ranks, shared_error
from mula.data.readers import ReadStats, iter_documents
from mula.data.shuffle import (
    gather_bucket,
    remove_split,
    split_coarse,
    write_scatter,
)
from mula.data.tokenizer import LoadedTokenizer, load_tokenizer

log = logging.getLogger(__name__)


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


def _encode_into(tok: LoadedTokenizer, texts: list[str], add: Callable[[Any], None]) -> int:
    """Encode a batch of documents (EOS appended), hand each to ``add``; the number of tokens."""
    tokens = 0
    for ids in tok.encode_documents(texts) if texts else []:
        add(ids)
        tokens += len(ids)
    return tokens


def _run_task(task: Task) -> dict[str, Any]:
    """Tokenize one task's files into litdata chunks ``chunk-<task>-*.bin`` + ``<task>.index.json``
    (with a shuffle seed: into the task's scatter files), or gather one shuffle bucket into its chunks.

    Returns the task's counts and the size and sha256 of each chunk it wrote (also saved, last, as
    ``result_path(task)``: its presence means the task is complete).
    """
    assert task.kind == "tokenize" or task.shuffle_seed is not None
    if task.kind == "split":
        result = split_coarse(
            task.out_dir, task.index, task.tasks, task.fine, task.shuffle_seed, task.eos_id, task.dtype
        )
        atomic_write_text(result_path(task), json.dumps(result))
        return result
    if task.kind == "bucket":
        docs = gather_bucket(task.out_dir, task.index, task.fine, task.shuffle_seed, task.eos_id, task.dtype)
        with TaskChunkWriter(task.out_dir, task.index, task.chunk_bytes) as writer:
            for ids in docs:
                writer.add(ids)
        result = {"tokens": int(sum(len(d) for d in docs)), "chunks": writer.chunks}
        atomic_write_text(result_path(task), json.dumps(result))
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
    atomic_write_text(stats_path(task.out_dir, task.index), json.dumps(result))
    return result


def _run_tasks(
    todo: list[Task],
    workers: int,
    tokenizer: LoadedTokenizer | None,
    tokenizer_path: str,
    eos_token: str | int | None,
    on_done: Callable[[Task, dict[str, Any]], None],
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
        tokenizer_path: A Hugging Face tokenizer.json (or a model directory holding one), or a named tokenizer:
            ``olmo`` (OLMo's, the tokenizer of OLMoE-1B-7B-0924; mula/data/named_tokenizers.py).
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
    specs = [as_spec(s) for s in sources]
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

    def plan_job() -> tuple[PrepareSummary, list[SourcePlan]]:
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
                # a named tokenizer: its name, what later runs load it by (mula/data/named_tokenizers.py)
                **({"name": tokenizer.name} if tokenizer.name is not None else {}),
                "sha256": tokenizer.sha256,
                "vocab_size": tokenizer.vocab_size,
                "eos_id": tokenizer.eos_id,
                "eos_token": tokenizer.eos_token,
            },
            dtype=str(token_dtype_name(tokenizer)),
            shuffle_seed=shuffle_seed,
        )
        plans = [
            plan_source(
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
    bar = JobProgress(todo, progress) if ranks.rank == 0 else None
    # the workers load the tokenizer by what the summary records (a named tokenizer by its name)
    reference = recorded_tokenizer(summary.to_dict())
    report = _run_share(ranks, mine, loaded, reference, eos_token, num_workers)
    if bar is not None:
        bar.close()
    reports = ranks.gather(report)
    # Each shuffle pass starts once every rank has finished the one before (it reads what every task wrote).
    previous = reports
    for kind in ("split", "bucket") if any(p.buckets for p in plans) else ():
        work = ranks.on_zero(functools.partial(_next_shuffle_pass, previous, plans, kind))
        if ranks.rank == 0:
            log.info("%d shuffle %s tasks to run on %d rank(s)", len(work), kind, ranks.world)
        share = work[ranks.rank :: ranks.world]
        previous = ranks.gather(_run_share(ranks, share, loaded, reference, eos_token, num_workers))

    def finish_job() -> tuple[PrepareSummary, list[tuple[str, str]]]:
        assert reports is not None
        _raise_failures(previous)
        for plan in plans:
            summary.sources.append(plan.up_to_date or finish_source(plan))
        atomic_write_text(
            os.path.join(summary.output_dir, SUMMARY_FILE), json.dumps(summary.to_dict(), indent=2)
        )
        if progress:
            print(summary.format_table())
            if todo:
                print(format_rates(reports))
            print(f"wrote {os.path.join(summary.output_dir, SUMMARY_FILE)}")
        return summary, (chunks_to_verify(plans) if verify else [])

    summary, checks = ranks.on_zero(finish_job)
    if verify:
        bad = [
            b
            for final_dir, name in checks[ranks.rank :: ranks.world]
            for b in verify_chunks(final_dir, [name])
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


def _next_shuffle_pass(
    reports: list[dict[str, Any]] | None, plans: list[SourcePlan], kind: str
) -> list[Task]:
    """Rank 0: stop on the previous pass's first error, else the shuffle's `kind` tasks still to run."""
    _raise_failures(reports)
    return shuffle_pass_to_run(plans, kind)


def _raise_failures(reports: list[dict[str, Any]] | None) -> None:
    """Rank 0: stop the job with the first error a rank reported (the same sentence on every rank)."""
    failed = [r for r in reports or [] if r["error"] is not None]
    if failed:
        raise shared_error(failed[0]["rank"], *failed[0]["error"])


def _run_share(
    ranks: Ranks,
    mine: list[Task],
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

    def on_done(task: Task, result: dict[str, Any]) -> None:
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
