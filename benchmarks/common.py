"""What the benchmark scripts share: the gloo launch and its slowest-rank timing, the interleaved rounds
(every candidate once per round, in order, so a drift of the host's speed hits them all alike) and their
medians and spreads, the lines and tables they print, and the docs/benchmarks.md section they write.

Scripts import it as `common`: benchmarks/ is on sys.path when one runs.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mula.model.config import MulaConfig
from mula.training.devices import cpu_flags, cpu_model

MiB = 2**20


# ----- the gloo launch -----------------------------------------------------------------------------------
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


def start_together() -> float:
    """The start of a timed step, every rank at once: a barrier, then `time.perf_counter()` (the clock
    `slowest_rank_seconds` reads). Every rank calls it."""
    dist.barrier()
    return time.perf_counter()


def slowest_rank_seconds(start: float) -> float:
    """Seconds since `start` (a `time.perf_counter()`) on the job's slowest rank: a step ends when its
    slowest rank ends. One MAX all-reduce over the job: every rank calls it."""
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def largest_over_ranks(gathered: list[list[dict[str, Any]]], keys: Iterable[str]) -> list[dict[str, Any]]:
    """Rank 0's rows (`gathered`: each rank's rows, in rank order), each of `keys` replaced by the largest
    value any rank measured in that row (bytes differ per rank; the worst rank is what has to fit)."""
    keys = list(keys)
    return [{**row, **{k: max(g[i][k] for g in gathered) for k in keys}} for i, row in enumerate(gathered[0])]


# ----- interleaved rounds ----------------------------------------------------------------------------------
def interleaved_rounds(
    fns: dict[str, Callable[[], Any]],
    rounds: int,
    warmup: int = 1,
    calls: int = 1,
    fresh: bool = False,
    sync: Callable[[], Any] = lambda: None,
) -> dict[str, list[float]]:
    """Seconds of `calls` calls of each of `fns`, once per round, the candidates in turn in every round,
    after `warmup` untimed rounds. `fresh`: one untimed call of a candidate right before its timed ones
    (a cache the previous candidate filled, e.g. oneDNN's per-shape kernels, would otherwise charge it
    what training never pays). `sync` waits for the device's queued work before a clock is read."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if fresh:
                fn()
                sync()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def by_case(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows grouped by their "case", one row per round, cases in first-seen order."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        grouped.setdefault(r["case"], []).append(r)
    return grouped


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per case (first-seen order): the median over rounds of every numeric field."""
    return [
        {
            k: statistics.median(r[k] for r in rs)
            if isinstance(v, (int, float)) and not isinstance(v, bool)
            else v
            for k, v in rs[0].items()
        }
        for rs in by_case(rows).values()
    ]


def median_range(values: Sequence[float], fmt: str = ",.0f", unit: str = "") -> str:
    """Values over rounds as "median [min-max]", each in `fmt`, the median followed by `unit`."""
    return f"{statistics.median(values):{fmt}}{unit} [{min(values):{fmt}}-{max(values):{fmt}}]"


def spread(ratios: Sequence[float]) -> str:
    """A ratio over rounds as "median x [min-max]"."""
    return median_range(ratios, ".2f", "x")


# ----- what a script prints and writes ---------------------------------------------------------------------
def positive(**counts: int) -> None:
    """One sentence when any of the named counts (world size, steps, rounds, ...) is below 1."""
    if min(counts.values()) < 1:
        names = list(counts)
        named = f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0]
        raise ValueError(f"{named} must be positive, got {', '.join(str(v) for v in counts.values())}.")


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table: the header row, its separator and one row per sequence of cells."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def moe_config(seq_len: int, **shape: Any) -> MulaConfig:
    """The benchmarked MoE: `mula-tiny-moe` with `shape`'s fields (hidden_size, num_layers, num_experts,
    ...), 4 heads, and positions for sequences of `seq_len` tokens."""
    return MulaConfig.from_name(
        "mula-tiny-moe", num_heads=4, max_position_embeddings=max(seq_len, 64), **shape
    )


def moe_shape(config: MulaConfig, routing: str = "") -> str:
    """The benchmarked MoE's shape and size, as the tables' headers name it (`routing`: a note after the
    expert FFN, e.g. ", uniform routing")."""
    return (
        f"mula-tiny-moe shape with hidden {config.hidden_size}, {config.num_layers} layers, "
        f"{config.num_experts} experts top-{config.top_k} (FFN {config.expert_intermediate_size}{routing}), "
        f"vocab {config.vocab_size}: {config.num_params() / 1e6:.1f}M parameters"
    )


def gloo_ranks(world: int) -> str:
    """How the job ran, as the headers say it: `world` gloo processes on this host's cores."""
    return f"W={world} processes on {os.cpu_count()} CPU cores (1 torch thread each)"


def command_line() -> str:
    """The command that made a section, as its "Command:" line shows it."""
    return f"Command: `{' '.join(['python', *sys.argv])}`  "


def host_line() -> str:
    """The "Host:" line every table carries: CPU model, cores, the ISA extensions that change CPU
    kernels (AVX-512, AVX512-BF16, AMX), torch version and date."""
    flags = cpu_flags()
    isa = ", ".join(
        f"{name} {'yes' if flag in flags else 'no'}"
        for name, flag in (("AVX-512", "avx512f"), ("AVX512-BF16", "avx512_bf16"), ("AMX", "amx_tile"))
    )
    return (
        f"Host: {cpu_model()}, {os.cpu_count()} cores ({platform.machine()}; {isa}), "
        f"torch {torch.__version__}; measured {datetime.date.today().isoformat()} with nothing else running."
    )


def publish(result: str, doc: str | Path | None, heading: str, section: str | None = None) -> str:
    """Print `result` and, with `doc`, write it (or the `section` made of it) as the section `heading` of
    that file; `result`, which the script's `main` returns."""
    print(result)
    write_section(doc, heading, result if section is None else section)
    return result


def write_section(doc: str | Path | None, heading: str, section: str) -> None:
    """Replace the section of `doc` that starts with `heading` (e.g. "## optimizer") by `section`, or
    append it, leaving the other sections alone; nothing without a `doc` (the script's --doc not given)."""
    if doc is None:
        return
    doc = Path(doc)
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    start = text.find(heading + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    else:
        end = text.find("\n## ", start + len(heading))
        tail = text[end + 1 :] if end >= 0 else ""
        text = text[:start] + section.rstrip("\n") + "\n" + ("\n" + tail if tail else "")
    doc.write_text(text.rstrip("\n") + "\n")
