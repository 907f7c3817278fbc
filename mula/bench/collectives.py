"""The bytes a rank's collectives move, by kind of collective: `CollectiveMeter`, and `CollectiveSteps`,
which counts chosen optimizer steps of a Lightning run with it.

`mula bench` compares what it counts with what `mula plan` plans for the same layout
(`mula.plan.collective_kinds.planned_collectives`); tests/test_plan_volumes.py and
tests/test_plan_volumes_tp.py hold the two equal. Two doors cover every collective a step issues:

* eager collectives (`torch.distributed.all_reduce`, `reduce`, `broadcast`, `all_to_all_single`,
  `all_gather_into_tensor`, `reduce_scatter_tensor`, `isend`/`irecv` and the pipeline's batched
  point-to-point operations, whichever module imported them by name) all end in a method of the
  process group, wrapped once per process (`_install_eager`);
* torch's functional collectives (`_c10d_functional` ops: DTensor's tensor parallelism, Ulysses'
  all-to-alls, context parallelism's router-loss totals) run in C++ and are seen by a dispatch mode on
  plain tensors, entered with the meter (it steps aside for DTensor arguments, as torch's
  `CommDebugMode` does, and so sees the collectives DTensor turns an op into).

Bytes are counted as a bandwidth-optimal algorithm moves them, the "bus bytes" of nccl-tests, each way:
an all-to-all sends what leaves for other ranks and receives what arrives from them; a reduce-scatter
(its input) and an all-gather (its output) move (n-1)/n of the buffer out and as much in; an all-reduce
2(n-1)/n both ways; a rooted broadcast's root sends the tensor to the n-1 others, each of which receives
it once; a rooted reduce's non-roots send it once and its root receives n-1 of them; a point-to-point
send or receive moves its tensor. Over a bucket's n shards, each rooted at its owner, the rooted pair
moves what the ring collectives do.

Not seen: collectives torch issues from C++ without a Python call (Lightning's DDP strategy's gradient
reducer; Mula's strategy issues none), and object collectives (`broadcast_object_list`: setup, not a
step's). The eager door counts every meter entered on any thread of the process.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from mula.plan.collective_kinds import KINDS, planned_collectives
from mula.torch_compat import PROCESS_GROUP_BASE_METHODS, TorchDispatchMode, resolve_process_group
from mula.training.lightning_compat import ends_optimizer_step

Count = tuple[str, float, float]  # (kind, bytes sent, bytes received)


def _nbytes(tensors: Tensor | Iterable[Tensor]) -> int:
    """Bytes of a tensor, or of a list of them."""
    if isinstance(tensors, Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _others(tensor: Tensor, splits: list[int] | None, rank: int, size: int) -> float:
    """Bytes of all-to-all buffer `tensor` (split along dim 0 by `splits`, evenly without) outside the
    slice of group rank `rank`: what leaves for (or arrives from) the other ranks."""
    if not splits:
        return _nbytes(tensor) * (size - 1) / size
    row = _nbytes(tensor) / tensor.shape[0] if tensor.shape[0] else 0.0
    return (sum(splits) - splits[rank]) * row


# ----- eager collectives: ProcessGroup method -> (group, its arguments) -> Count


def _all_reduce(group: Any, tensors: Any, *args: Any) -> Count:
    n = group.size()
    moved = 2 * _nbytes(tensors) * (n - 1) / n
    return "all_reduce", moved, moved


def _reduce(group: Any, tensors: Any, opts: Any, *args: Any) -> Count:
    n, root = group.size(), group.rank() == opts.rootRank
    nbytes = _nbytes(tensors)
    return "reduce", nbytes * (not root), nbytes * (n - 1) * root


def _broadcast(group: Any, tensors: Any, opts: Any, *args: Any) -> Count:
    n, root = group.size(), group.rank() == opts.rootRank
    nbytes = _nbytes(tensors)
    return "broadcast", nbytes * (n - 1) * root, nbytes * (not root)


def _all_to_all(group: Any, output: Tensor, input: Tensor, out_splits: Any, in_splits: Any, *a: Any) -> Count:
    rank, n = group.rank(), group.size()
    return "all_to_all", _others(input, list(in_splits), rank, n), _others(output, list(out_splits), rank, n)


def _all_gather(group: Any, output: Any, *args: Any) -> Count:
    n = group.size()
    moved = _nbytes(output) * (n - 1) / n
    return "all_gather", moved, moved


def _reduce_scatter(group: Any, output: Any, input: Any, *args: Any) -> Count:
    n = group.size()
    moved = _nbytes(input) * (n - 1) / n
    return "reduce_scatter", moved, moved


def _send(group: Any, tensors: Any, *args: Any) -> Count:
    return "send_recv", float(_nbytes(tensors)), 0.0


def _recv(group: Any, tensors: Any, *args: Any) -> Count:
    return "send_recv", 0.0, float(_nbytes(tensors))


# the methods `torch.distributed`'s collectives call (older torch: `alltoall_base` and the private ones of
# `PROCESS_GROUP_BASE_METHODS`); `allgather` into a list and the object collectives are left out: no
# training step issues them
_EAGER: dict[str, Callable[..., Count]] = {
    "allreduce": _all_reduce,
    "reduce": _reduce,
    "broadcast": _broadcast,
    "all_to_all_single": _all_to_all,
    "alltoall_base": _all_to_all,
    "all_gather_single": _all_gather,
    "reduce_scatter_single": _reduce_scatter,
    "send": _send,
    "recv": _recv,
}
_EAGER.update({private: _EAGER[public] for private, public in PROCESS_GROUP_BASE_METHODS.items()})
_meters: list[CollectiveMeter] = []  # the meters counting now (the wrappers report to them)
_install_lock = threading.Lock()
_installed = False


def _install_eager() -> None:
    """Wrap the process group's collective methods, once per process."""
    global _installed
    with _install_lock:
        if _installed:
            return
        for name, count in _EAGER.items():
            original = getattr(dist.ProcessGroup, name, None)
            if original is not None:
                setattr(dist.ProcessGroup, name, _counted(original, count))
        _installed = True


def _counted(original: Callable[..., Any], count: Callable[..., Count]) -> Callable[..., Any]:
    def method(group: Any, *args: Any, **kwargs: Any) -> Any:
        if _meters:
            kind, sent, received = count(group, *args, **kwargs)
            for meter in list(_meters):
                meter.add(kind, sent, received)
        return original(group, *args, **kwargs)

    return method


# ----- functional collectives


def _functional(name: str, args: tuple, out: Any) -> Count | None:
    """The Count of functional op `name` (`_c10d_functional`) run on `args` with result `out`; None for
    one that moves nothing (`wait_tensor`, the autograd wrappers' `_wrap_tensor_autograd`)."""
    x = args[0]
    if name in ("all_reduce", "all_reduce_"):  # (input, op, group_name)
        n = resolve_process_group(args[2]).size()
        moved = 2 * _nbytes(x) * (n - 1) / n
        return "functional", moved, moved
    if name == "all_gather_into_tensor":  # (input, group_size, group_name): the output is n inputs
        moved = _nbytes(x) * (args[1] - 1)
        return "functional", moved, moved
    if name == "reduce_scatter_tensor":  # (input, op, group_size, group_name)
        moved = _nbytes(x) * (args[2] - 1) / args[2]
        return "functional", moved, moved
    if name == "all_to_all_single":  # (input, output_split_sizes, input_split_sizes, group_name)
        group = resolve_process_group(args[3])
        rank, n = group.rank(), group.size()
        return "functional_all_to_all", _others(x, args[2], rank, n), _others(out, args[1], rank, n)
    if name == "wait_tensor" or name.startswith("_wrap"):  # a wait, the autograd wrappers' bookkeeping
        return None
    raise NotImplementedError(f"CollectiveMeter does not count the functional collective {name}.")


class _FunctionalMode(TorchDispatchMode):
    """Sees the functional collectives run on plain tensors while entered."""

    def __init__(self, meter: CollectiveMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor turns the op into local ops and collectives first
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional":
            counted = _functional(func.overloadpacket.__name__, args, out)
            if counted is not None:
                self.meter.add(*counted)
        return out


class CollectiveMeter:
    """Counts, while entered, the bytes this process's collectives send and receive and the calls, by kind
    (`mula.plan.collective_kinds.KINDS`; the module docstring says how each is counted).

    `sent`, `received`, `calls`: kind -> total since it was built; entering again adds to them.
    Enter it on the thread that runs the step (its dispatch mode is that thread's and autograd's).
    """

    def __init__(self) -> None:
        self.sent: dict[str, float] = defaultdict(float)
        self.received: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._mode: _FunctionalMode | None = None
        self._lock = threading.Lock()

    def add(self, kind: str, sent: float, received: float) -> None:
        """One collective call of `kind` moving `sent` bytes out and `received` in."""
        assert kind in KINDS, kind
        with self._lock:
            self.sent[kind] += sent
            self.received[kind] += received
            self.calls[kind] += 1

    def __enter__(self) -> CollectiveMeter:
        _install_eager()
        self._mode = _FunctionalMode(self)
        self._mode.__enter__()
        _meters.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _meters.remove(self)
        mode, self._mode = self._mode, None
        mode.__exit__(*exc)

    def totals(self) -> dict[str, dict[str, float]]:
        """{"sent": {kind: bytes}, "received": {...}, "calls": {...}} over every kind (0 where none)."""
        return {
            "sent": {k: float(self.sent.get(k, 0.0)) for k in KINDS},
            "received": {k: float(self.received.get(k, 0.0)) for k in KINDS},
            "calls": {k: float(self.calls.get(k, 0)) for k in KINDS},
        }


class CollectiveSteps(L.Callback):
    """Counts the collectives of chosen optimizer steps with a `CollectiveMeter`.

    Step n's window runs from the end of step n - 1 (the start of training for step 1) to the end of
    step n: every micro-batch's forward and backward, the optimizer step and the loop's work between.

    Args:
        steps: optimizer step numbers (1-based) to count.

    `counts`: step -> `CollectiveMeter.totals()` for the counted steps.
    """

    def __init__(self, steps: Iterable[int]) -> None:
        self.steps = set(steps)
        self.counts: dict[int, dict[str, dict[str, float]]] = {}
        self._meter: CollectiveMeter | None = None

    def _open(self, step: int) -> None:
        if step in self.steps:
            self._meter = CollectiveMeter().__enter__()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._open(trainer.global_step + 1)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not ends_optimizer_step(trainer):
            return
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            self.counts[trainer.global_step] = self._meter.totals()
            self._meter = None
        self._open(trainer.global_step + 1)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._meter is not None:  # training ended before the window's step did
            self._meter.__exit__(None, None, None)
            self._meter = None

    def per_step(self) -> dict[str, dict[str, float]] | None:
        """The mean over the counted steps of each kind's bytes and calls (None when none was counted)."""
        if not self.counts:
            return None
        steps = list(self.counts.values())
        return {way: {k: sum(s[way][k] for s in steps) / len(steps) for k in KINDS} for way in steps[0]}


WAYS = ("sent", "received", "calls")


def matches(measured: dict[str, dict[str, float]], planned: dict[str, dict[str, float]], kind: str) -> bool:
    """Whether a rank's `kind` moved what the plan says, both ways, in as many calls (float sums of
    (n-1)/n shares: equal up to rounding)."""
    return all(abs(measured[w][kind] - planned[w][kind]) <= 1e-9 * max(1.0, planned[w][kind]) for w in WAYS)


def collective_result(
    trainer: Any, counted: CollectiveSteps, inputs: Any, steps: list[int]
) -> dict[str, Any]:
    """`mula bench`'s collective figures: `collective_bytes_per_step`, the largest over the ranks of each
    kind's bytes sent and received and calls per counted step beside the plan's largest pipeline stage,
    and per kind the number of ranks that moved exactly their stage's plan (None when no step was
    counted: `steps`, the chosen ones, empty, or a compiled model); `collectives`: the counted steps,
    each rank's counts with its stage, the plan of every stage (`planned_collectives`), and why nothing
    was counted."""
    planned = planned_collectives(inputs.config, inputs.layout)
    mine = counted.per_step()
    flat = [-1.0] * (len(WAYS) * len(KINDS)) if mine is None else [mine[w][k] for w in WAYS for k in KINDS]
    gathered = trainer.strategy.all_gather(torch.tensor(flat, dtype=torch.float64))
    gathered = gathered.reshape(-1, len(WAYS), len(KINDS)).tolist()
    counted_all = mine is not None and min(min(min(w) for w in r) for r in gathered) >= 0
    per_rank = None
    if counted_all:
        per_rank = [
            {"stage": inputs.layout.parallel.coordinates(r).pp}
            | {w: dict(zip(KINDS, values[i])) for i, w in enumerate(WAYS)}
            for r, values in enumerate(gathered)
        ]
    largest = None
    if per_rank is not None:
        largest = {
            "measured": {w: {k: max(r[w][k] for r in per_rank) for k in KINDS} for w in WAYS},
            "planned": {w: {k: max(p[w][k] for p in planned) for k in KINDS} for w in WAYS},
            "ranks_as_planned": {k: sum(matches(r, planned[r["stage"]], k) for r in per_rank) for k in KINDS},
        }
    why_not = None
    if largest is None:
        why_not = "not measured for compiled models" if steps else "every step's window holds a logging step"
    return {
        "collective_bytes_per_step": largest,
        "collectives": {
            "steps": sorted(counted.counts) if counted_all else [],
            "per_rank": per_rank,
            "planned": planned,
            "not_measured": why_not,
        },
    }
