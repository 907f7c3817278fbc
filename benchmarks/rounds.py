"""What the multi-process benchmarks share: a free rendezvous port, and rows repeated over interleaved
rounds (every layout once per round, in order) reduced to medians and ratio spreads."""

from __future__ import annotations

import socket
import statistics
from typing import Any


def free_port() -> int:
    """A TCP port that is free right now on localhost (the workers' MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def by_case(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows grouped by their "case", one row per round, cases in first-seen order."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        grouped.setdefault(r["case"], []).append(r)
    return grouped


def spread(ratios: list[float]) -> str:
    """A ratio over rounds as "median x [min-max]"."""
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
