"""Which lm-evaluation-harness tasks to run: hub task names and local task files, checked before any work.

A task is named as lm-eval names it (`arc_easy`, `hellaswag`, a group such as `mmlu`, a tag), or
given as a local task: a YAML file in lm-eval's own custom-task format (`task:`, `dataset_path: json`,
`dataset_kwargs: {data_files: ...}`, `doc_to_text`, ...), or a directory of such files
(`include_path`) whose task names then become known. Local JSONL data is read by `datasets`' json
builder and needs no network; hub tasks download their data on first use.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lm_eval.tasks import TaskManager


@dataclass
class ResolvedTasks:
    """The tasks to evaluate: lm-eval specs (names or YAML paths), their names, and the manager that loads them."""

    specs: list[str]
    names: list[str]
    manager: TaskManager


def split_tasks(tasks: str | Sequence[str]) -> list[str]:
    """`"a,b"` or `["a", "b,c"]` -> `["a", "b", "c"]` (empty entries dropped)."""
    items = [tasks] if isinstance(tasks, str) else list(tasks)
    return [t.strip() for item in items for t in item.split(",") if t.strip()]


def resolve_tasks(tasks: str | Sequence[str], include_path: str | os.PathLike | None = None) -> ResolvedTasks:
    """Check every task before anything is loaded; raise ValueError naming the first unknown one.

    Args:
        tasks: Task names, task YAML files, or both (a list, or one comma-separated string).
        include_path: A directory of task YAML files whose tasks may then be named.
    """
    from lm_eval.tasks._index import TaskIndex

    specs = split_tasks(tasks)
    if not specs:
        raise ValueError(
            "no task given; name lm-eval tasks (e.g. --tasks arc_easy,hellaswag) or task YAML files."
        )
    if include_path is not None and not Path(include_path).is_dir():
        raise FileNotFoundError(f"include_path {include_path} is not a directory of task YAML files.")
    # lm-eval's own task index takes seconds to build: only when a task is named rather than given as a file
    named = any(not s.endswith((".yaml", ".yml")) for s in specs)
    manager = TaskManager(
        include_path=str(include_path) if include_path is not None else None, include_defaults=named
    )
    known = set(manager.all_tasks)
    names = []
    for spec in specs:
        if spec in known:
            names.append(spec)
            continue
        entry = TaskIndex.entry_from_path(Path(spec)) if spec.endswith((".yaml", ".yml")) else None
        if entry is None:
            raise ValueError(_unknown(spec, manager.all_tasks))
        names.append(entry.name)
    return ResolvedTasks(specs, names, manager)


def _unknown(spec: str, known: list[str]) -> str:
    if spec.endswith((".yaml", ".yml")):
        return f"task file {spec} does not exist or names no task (lm-eval's format needs a 'task:' key)."
    close = difflib.get_close_matches(spec, known, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return (
        f"unknown task {spec!r}{hint}: not an lm-eval task, group or tag, nor a task YAML file "
        "(`lm-eval ls tasks` lists them)."
    )


def documents_per_task(tasks: ResolvedTasks, limit: int | float | None = None) -> dict[str, int]:
    """How many documents lm-eval will evaluate of each task (of every task of a group), `limit` applied
    as lm-eval applies it (the first N, or a fraction of each task, rounded up). Loads the tasks' data."""
    import math

    from lm_eval.api.group import ConfigurableGroup
    from lm_eval.tasks import get_task_dict

    counts: dict[str, int] = {}

    def walk(entries: dict) -> None:
        for key, task in entries.items():
            if isinstance(task, dict):  # a group: its tasks
                walk(task)
                continue
            n = len(task.eval_docs)
            if limit is not None:
                n = min(n, int(math.ceil(n * limit)) if limit < 1 else int(limit))
            group = key.group_name if isinstance(key, ConfigurableGroup) else None
            counts[group or str(key)] = n

    walk(get_task_dict(tasks.specs, tasks.manager))
    return counts


def check_documents_per_rank(tasks: ResolvedTasks, ranks: int, limit: int | float | None = None) -> None:
    """Refuse, before any evaluation, a task with fewer documents than the data-parallel ranks that split
    them: lm-eval skips a rank without requests, which then leaves the others' collectives (a hang)."""
    if ranks <= 1:
        return
    for name, n in documents_per_task(tasks, limit).items():
        if n < ranks:
            raise ValueError(
                f"task {name!r} has {n} document(s) to evaluate, fewer than the {ranks} data-parallel ranks "
                "that split them, and every rank needs one; evaluate it on fewer ranks, or with a larger "
                "--limit / more documents."
            )
