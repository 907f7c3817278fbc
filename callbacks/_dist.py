"""Tiny collective helpers over the default process group (no-ops in a single process).

Fault-tolerance decisions (skip this step, checkpoint now, stop) must be taken identically on every
rank, or ranks run different collectives and hang. These helpers are how the callbacks agree.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True when a default process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """Global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """World size (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(values: list[float], op: str, device: torch.device) -> list[float]:
    """All-reduce a few numbers (op "sum" or "max") in one collective; returns the reduced values."""
    tensor = torch.tensor(
        values, dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device
    )
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor.tolist()


def all_reduce_tensor(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """All-reduce ``tensor`` in place (op "sum" or "max") and return it."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if ``flag`` is true on at least one rank."""
    return all_reduce([1.0 if flag else 0.0], "max", device)[0] > 0


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, indexed by rank (``group``: another group over every rank, e.g. the
    checkpoint writer's own gloo group in its background thread)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier() -> None:
    """Wait for every rank."""
    if is_distributed():
        dist.barrier()


def describe_error(err: BaseException) -> str:
    """An error as a short phrase for the one-sentence message (with the rank that had it)."""
    return f"rank {rank()}: {type(err).__name__}: {err}"


def attempt(fn: Any) -> Any:
    """``fn()``, or the description of the error it raised (sent to the other ranks to agree on failure)."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 (reported to every rank, then skipped or raised)
        return describe_error(err)


def first_problem(problems: list[str | None]) -> str | None:
    """The first non-None problem reported by the ranks."""
    return next((p for p in problems if p is not None), None)


def gather_to_zero(obj: Any, group: Any = None) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere)."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out
