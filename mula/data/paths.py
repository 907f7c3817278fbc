"""Expand the input path patterns of `mula prepare` / `mula train-tokenizer` into a sorted list of files."""

from __future__ import annotations

import glob
import os
import sysconfig
from collections.abc import Sequence


def stdlib_dir() -> str:
    """The running Python's standard-library directory (text that exists offline on every machine)."""
    return sysconfig.get_paths()["stdlib"]


def expand_pattern(pattern: str) -> str:
    """Substitute ``{stdlib}`` and ``~`` in one path pattern."""
    return os.path.expanduser(pattern.replace("{stdlib}", stdlib_dir()))


def expand_paths(patterns: Sequence[str] | str, what: str = "inputs") -> list[str]:
    """Absolute paths of the files matching any of the patterns, sorted and without duplicates.

    A pattern is a file, a directory (all files below it) or a glob (``**`` recurses); ``{stdlib}`` stands for
    the running Python's standard-library directory.

    Raises:
        FileNotFoundError: a pattern matches nothing, naming it.
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns:
        raise ValueError(f"no {what} given.")
    files: set[str] = set()
    for pattern in patterns:
        expanded = expand_pattern(pattern)
        if os.path.isdir(expanded):
            expanded = os.path.join(expanded, "**", "*")
        matches = [m for m in glob.glob(expanded, recursive=True) if os.path.isfile(m)]
        if not matches:
            raise FileNotFoundError(f"no files match {pattern!r} ({what}).")
        files.update(os.path.abspath(m) for m in matches)
    return sorted(files)
