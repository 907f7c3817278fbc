"""What `mula prepare` reads and writes about sources: their specs, their counts, the job's summary."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from mula.data.readers import FORMATS

SUMMARY_FILE = "summary.json"
SOURCE_MARKER = "mula_source.json"
FORMAT_VERSION = 1
# The per-task counts summed into a source's totals (a task's result also lists its chunks).
COUNTS = ("files", "documents", "tokens", "bad_records", "empty_documents", "input_bytes")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def read_json(path: str) -> Any:
    """The JSON content of ``path``, or None when it is missing or unreadable (not yet written)."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError):
        return None


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
        return {k: sum(getattr(s, k) for s in self.sources) for k in COUNTS}

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


def recorded_tokenizer(summary: Mapping[str, Any]) -> str:
    """The tokenizer a summary.json (`PrepareSummary.to_dict`) records, as `load_tokenizer` takes it: a named
    tokenizer's name, which survives moving the virtual environment its file lives in
    (mula/data/named_tokenizers.py), else the absolute path of its tokenizer.json."""
    tokenizer = summary["tokenizer"]
    name = tokenizer.get("name")
    return name if isinstance(name, str) else os.path.abspath(tokenizer["path"])


def as_spec(source: SourceSpec | Mapping[str, Any]) -> SourceSpec:
    """A source given as a spec or a mapping, checked (one sentence per mistake)."""
    spec = source if isinstance(source, SourceSpec) else SourceSpec(**dict(source))
    if not NAME_RE.match(spec.name or ""):
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
