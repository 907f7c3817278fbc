"""Refusal sentences written once each, under a key.

A module that owns a kind of check (mula/layout/rules.py: the parallel layout; sharding_options.py: the
sharded optimizer's options) keeps its sentences in one `Sentences` table of `str.format` templates and
raises `SENTENCES.refuse(key, **values)`; every other module that refuses the same thing calls that
module's check. tests/test_cli_refusals.py names, for each command line, the key of the sentence it must
print and renders it with the command line's values, and fails on a table it does not read, a key no
check raises or no command line reaches, or a sentence written out a second time. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


class Sentences(Mapping[str, str]):
    """key -> `str.format` template of one refusal sentence (a read-only mapping)."""

    def __init__(self, templates: dict[str, str]) -> None:
        self._templates = dict(templates)

    def __getitem__(self, key: str) -> str:
        return self._templates[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._templates)

    def __len__(self) -> int:
        return len(self._templates)

    def render(self, key: str, **values: Any) -> str:
        """The sentence of `key` with `values` in place."""
        return self[key].format(**values)

    def refuse(self, key: str, **values: Any) -> ValueError:
        """The ValueError to raise with the sentence of `key` (`raise SENTENCES.refuse(key, ...)`)."""
        return ValueError(self.render(key, **values))
