"""Write one benchmark's `## <name>` section of docs/benchmarks.md, leaving the other sections alone."""

from __future__ import annotations

from pathlib import Path


def write_section(doc: Path, heading: str, section: str) -> None:
    """Replace the section that starts with `heading` (e.g. "## optimizer") by `section`, or append it."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    start = text.find(heading + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    else:
        end = text.find("\n## ", start + len(heading))
        tail = text[end + 1 :] if end >= 0 else ""
        text = text[:start] + section.rstrip("\n") + "\n" + ("\n" + tail if tail else "")
    doc.write_text(text.rstrip("\n") + "\n")
