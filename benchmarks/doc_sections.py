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


def host_line() -> str:
    """The "Host:" line every table carries: CPU model, cores, the ISA extensions that change CPU
    kernels (AVX-512, AVX512-BF16, AMX), torch version and date."""
    import datetime
    import os
    import platform

    import torch

    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    isa = ", ".join(
        f"{name} {'yes' if flag in flags else 'no'}"
        for name, flag in (("AVX-512", "avx512f"), ("AVX512-BF16", "avx512_bf16"), ("AMX", "amx_tile"))
    )
    return (
        f"Host: {model}, {os.cpu_count()} cores ({platform.machine()}; {isa}), torch {torch.__version__}; "
        f"measured {datetime.date.today().isoformat()} with nothing else running."
    )
