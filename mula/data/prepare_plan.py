"""Rank 0's decisions in `mula prepare`: each source's tasks (a pure function of its inputs and settings),
what an interrupted job already finished, and the merge, marker and swap once every task is done."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

from mula.checkpoint.atomic import atomic_write_text, replace_path
from mula.data.chunks import merge_indexes
from mula.data.prepare_summary import (
    COUNTS,
    FORMAT_VERSION,
    SOURCE_MARKER,
    SourceSpec,
    SourceSummary,
    read_json,
)
from mula.data.shuffle import remove_scatter, remove_split, shuffle_shape
from mula.data.tokenizer import LoadedTokenizer

# Task sizing: aim for ~16 tasks per source, but not below 1 MB (each litdata chunk loses < seq_len + 1 tail
# tokens to window alignment) nor above 256 MB (memory and restart granularity per worker).
_MIN_TASK_BYTES = 1 << 20
_MAX_TASK_BYTES = 256 << 20
_TASKS_PER_SOURCE = 16


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
class Task:
    """One unit of work of a source: tokenize a group of files, or one pass-2/3 step of the shuffle."""

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
class SourcePlan:
    """What rank 0 decided for one source; broadcast to every rank."""

    spec: SourceSpec
    fingerprint: dict[str, Any]
    final_dir: str
    partial_dir: str
    tasks: list[Task]
    done: set[int]  # tasks finished by an earlier, interrupted run
    up_to_date: SourceSummary | None  # set when the source is finished and unchanged: nothing to do
    splits: list[Task] = field(default_factory=list)  # the shuffle's pass 2 (empty without a shuffle)
    buckets: list[Task] = field(default_factory=list)  # the shuffle's pass 3 (empty without a shuffle)


def stats_path(out_dir: str, index: int) -> str:
    return os.path.join(out_dir, f"{index}.stats.json")


def result_path(task: Task) -> str:
    """The file a task writes last: its presence means the task is complete."""
    if task.kind == "tokenize":
        return stats_path(task.out_dir, task.index)
    return os.path.join(task.out_dir, f"{task.index}.{task.kind}.json")


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


def plan_source(
    spec: SourceSpec,
    files: list[str],
    tokenizer: LoadedTokenizer,
    output_dir: str,
    skip_bad_records: bool,
    overwrite: bool,
    chunk_bytes: str,
    shuffle_seed: int | None,
) -> SourcePlan:
    """Rank 0: is the source up to date, and which of its tasks remain (resuming a partial run)."""
    final_dir = os.path.join(output_dir, spec.name)
    partial_dir = final_dir + ".partial"
    fingerprint = _fingerprint(spec, files, tokenizer, chunk_bytes, shuffle_seed)
    marker = read_json(os.path.join(final_dir, SOURCE_MARKER))
    if marker is not None and marker.get("fingerprint") == fingerprint:
        summary = SourceSummary(name=spec.name, weight=spec.weight, **marker["stats"])
        summary.status = "up to date"
        return SourcePlan(spec, fingerprint, final_dir, partial_dir, [], set(), summary)
    if os.path.exists(final_dir) and not overwrite:
        what = "different inputs or tokenizer" if marker is not None else "something else"
        raise ValueError(
            f"{final_dir} already holds data prepared from {what}; pass overwrite=True to replace it "
            "or choose another output directory."
        )
    # Resume a partial run only if it was made from exactly the same inputs; otherwise start afresh.
    if read_json(os.path.join(partial_dir, "fingerprint.json")) != fingerprint:
        shutil.rmtree(partial_dir, ignore_errors=True)
        os.makedirs(partial_dir)
        atomic_write_text(os.path.join(partial_dir, "fingerprint.json"), json.dumps(fingerprint))
    sizes = [os.path.getsize(f) for f in files]
    tasks = [
        Task(i, group, partial_dir, spec.format, spec.text_key, skip_bad_records, chunk_bytes, spec.name)
        for i, group in enumerate(_plan_tasks(files, sizes))
    ]
    size_of = dict(zip(files, sizes))
    coarse, fine = shuffle_shape(len(tasks))
    shuffle = dict(shuffle_seed=shuffle_seed, tasks=len(tasks), coarse=coarse, fine=fine)
    shuffle.update(eos_id=tokenizer.eos_id, dtype=token_dtype_name(tokenizer))
    for task in tasks:
        task.input_bytes = sum(size_of[f] for f in task.files)
        if shuffle_seed is not None:
            vars(task).update(shuffle)

    def shuffle_pass(kind: str, count: int) -> list[Task]:
        common = (partial_dir, spec.format, spec.text_key, skip_bad_records, chunk_bytes, spec.name)
        return [
            Task(i, [], *common, kind=kind, **shuffle)
            for i in range(count if shuffle_seed is not None else 0)
        ]

    splits, buckets = shuffle_pass("split", coarse), shuffle_pass("bucket", coarse * fine)
    # One listing per source, not one stat per task: cheap on a shared filesystem.
    present = set(os.listdir(partial_dir))
    done = {t.index for t in tasks if os.path.basename(stats_path(partial_dir, t.index)) in present}
    return SourcePlan(spec, fingerprint, final_dir, partial_dir, tasks, done, None, splits, buckets)


def shuffle_pass_to_run(plans: list[SourcePlan], kind: str) -> list[Task]:
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
        todo += [t for t in work if os.path.basename(result_path(t)) not in present]
    return todo


def finish_source(plan: SourcePlan) -> SourceSummary:
    """Rank 0, every task done: merge the indexes, write the marker with the chunk checksums, swap in."""
    results = []
    for task in plan.tasks:
        result = read_json(stats_path(plan.partial_dir, task.index))
        if result is None:
            raise RuntimeError(
                f"source {plan.spec.name!r}: task {task.index} has no result after every rank ended."
            )
        results.append(result)
    totals = {k: sum(r[k] for r in results) for k in COUNTS}
    if totals["tokens"] == 0:
        raise ValueError(f"source {plan.spec.name!r} produced no tokens (every document was empty or bad).")
    writers = plan.tasks
    if plan.buckets:  # the chunks were written by the shuffle's buckets
        writers = plan.buckets
        results = [read_json(result_path(b)) for b in plan.buckets]
        if any(r is None for r in results):
            raise RuntimeError(
                f"source {plan.spec.name!r}: a shuffle bucket has no result after every rank ended."
            )
    chunks = {name: entry for r in results for name, entry in r["chunks"].items()}
    merge_indexes(plan.partial_dir, [w.index for w in writers], chunks)
    for task in [*plan.tasks, *plan.splits, *plan.buckets]:
        os.remove(result_path(task))
    for bucket in plan.buckets:  # left by a bucket task killed between its result and its cleanup
        remove_split(plan.partial_dir, bucket.index, bucket.fine)
    os.remove(os.path.join(plan.partial_dir, "fingerprint.json"))
    marker = {"fingerprint": plan.fingerprint, "stats": totals, "chunks": chunks}
    atomic_write_text(os.path.join(plan.partial_dir, SOURCE_MARKER), json.dumps(marker))
    # Swap the finished folder in; an existing one is only removed once its replacement is complete.
    replace_path(plan.partial_dir, plan.final_dir)
    return SourceSummary(name=plan.spec.name, weight=plan.spec.weight, **totals)


def chunks_to_verify(plans: list[SourcePlan]) -> list[tuple[str, str]]:
    """Rank 0: (source folder, chunk name) of every finished source, from the markers; refuses a source
    whose marker records no checksums."""
    work = []
    for plan in plans:
        marker = read_json(os.path.join(plan.final_dir, SOURCE_MARKER)) or {}
        if "chunks" not in marker:
            raise ValueError(
                f"{plan.final_dir} records no chunk checksums (prepared by an older Mula); prepare it again "
                "with overwrite=True to verify it."
            )
        work.extend((plan.final_dir, name) for name in sorted(marker["chunks"]))
    return work


def token_dtype_name(tokenizer: LoadedTokenizer) -> str:
    """The numpy dtype name the source's token ids are stored in."""
    from mula.data.tokenizer import token_dtype

    return token_dtype(tokenizer.vocab_size).name
