"""What the multi-process benchmarks share: a gloo launch on a free rendezvous port, and rows repeated
over interleaved rounds (every layout once per round, in order) reduced to medians and ratio spreads."""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that is free right now on localhost (the workers' MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_gloo(worker: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """worker(rank, world, *args) in `world` spawned processes joined by a gloo process group, one torch
    thread each (more processes than cores otherwise thrash); each rank's return value, in rank order.
    `worker` must be a module-level function (spawn pickles it by reference)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _gloo_rank, args=(world, free_port(), tmp, worker, args), nprocs=world, start_method="spawn"
        )
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _gloo_rank(rank: int, world: int, port: int, tmp: str, worker: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = worker(rank, world, *args)
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(tmp) / f"rank{rank}.pt")


def by_case(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows grouped by their "case", one row per round, cases in first-seen order."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        grouped.setdefault(r["case"], []).append(r)
    return grouped


def spread(ratios: list[float]) -> str:
    """A ratio over rounds as "median x [min-max]"."""
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
