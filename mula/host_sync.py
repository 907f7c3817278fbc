"""Host syncs: the points where the host waits for the device, counted (`HostSyncMeter`) and kept few.

A training step that never waits for the host lets the host queue the next step's work while the device
still runs this one. It waits whenever a value computed on the device is read on the host: `.item()`,
`int()`/`float()`/`bool()` of a tensor, `.tolist()`, `.cpu()`, and ops whose output size depends on the
data. The rule, in one place:

* A sync is one of these aten ops on a tensor of the run's device (`HostSyncMeter(device)`): a scalar
  read (`_local_scalar_dense`), `nonzero`, `masked_select`, the `unique` family, `bincount`, `equal`,
  `repeat_interleave` of a repeats tensor without `output_size`, indexing or assigning through a boolean
  mask, and a blocking copy between the host and an accelerator, either way (torch synchronises the
  stream around it). On a CPU-only run every tensor is "on the device", so the meter counts what a GPU
  run of the same code would wait for, with gaps it states: `.cpu()`, `.tolist()` and `.numpy()` of a
  CPU tensor dispatch no op at all (hence `to_host`, below), a host-to-device copy does not exist there,
  and tensors that live on the host on every device (torch.optim's step counters,
  `optimizer_host_tensors`) are passed as `host_tensors` and never count.
* Mula's own deliberate host reads in the step go through one function, `to_host(tensor, reason)`,
  which the meter counts once by reason (the expert all-to-all's split sizes) when the tensor is on the
  run's device, whatever ops the copy takes; tests/test_host_sync.py scans the step's code for any other
  `.cpu()`, `.tolist()`, `.numpy()`, `.item()`.
* Code that only the CPU runs, standing in for a GPU kernel that needs no host read (the CPU expert
  kernel plans its padded buckets from host counts, `mula.model.kernels.padded`), runs inside
  `host_syncs_excluded(mark)`: the meter counts what happens there under `excluded[mark]`, outside the
  step's total.

`HostSyncMeter` is a context manager; `mula bench` wraps steady-state optimizer steps in it
(`mula.bench.probe.HostSyncSteps`) and reports `host_syncs_per_step`.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Generator, Iterable
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from mula import torch_compat

# The mark of the CPU expert kernel's host planning (`mula.model.kernels.padded`): a GPU runs torch's
# grouped GEMM or Triton's on the device's own counts instead, with no host read.
CPU_EXPERT_KERNEL = "cpu expert kernel"

_PRIVATE = torch_compat.private_aten_ops()
_ATEN = torch.ops.aten
# ops that always make the device wait for their result (output size or value needed on the host)
_ALWAYS = frozenset(
    [
        _PRIVATE["_local_scalar_dense"],
        _PRIVATE["_unique"],
        _PRIVATE["_unique2"],
        _ATEN.nonzero,
        _ATEN.masked_select,
        _ATEN.unique_dim,
        _ATEN.unique_consecutive,
        _ATEN.unique_dim_consecutive,
        _ATEN.bincount,
        _ATEN.equal,
    ]
)
# ops whose output size depends on the values of a boolean index
_MASK_INDEXING = frozenset([_ATEN.index, _ATEN.index_put, _ATEN.index_put_, _PRIVATE["_index_put_impl_"]])


class _ThreadState(threading.local):
    """What this thread is inside: a `to_host` read (its copy is counted once, by reason) and the
    innermost `host_syncs_excluded` mark. Per thread: autograd runs backward on threads of its own."""

    def __init__(self) -> None:
        self.reading = False
        self.mark: str | None = None


_state = _ThreadState()
_meters: list[HostSyncMeter] = []  # the entered meters
_meters_lock = threading.Lock()


def to_host(tensor: Tensor, reason: str) -> Tensor:
    """`tensor` copied to the host (the tensor itself when it is there already): Mula's one way to read a
    device tensor on the host inside a training step, counted by an entered `HostSyncMeter` under
    `reason` (one read, whatever ops the copy takes)."""
    with _meters_lock:
        meters = list(_meters)
    for meter in meters:
        meter.record_read(tensor, reason)
    _state.reading, before = True, _state.reading
    try:
        return tensor.cpu()
    finally:
        _state.reading = before


@contextmanager
def host_syncs_excluded(mark: str) -> Generator[None, None, None]:
    """Code that runs only on the CPU in place of a device kernel that needs no host read: its host
    syncs count under `HostSyncMeter.excluded[mark]`, not in the step's total."""
    before, _state.mark = _state.mark, mark
    try:
        yield
    finally:
        _state.mark = before


def logging_step(step: int, log_every_n_steps: int) -> bool:
    """Whether optimizer step `step` (1-based) is one Lightning hands the train metrics to the loggers on
    (`log_every_n_steps`; 0 never): its metrics are read on the host, so it may sync. Mula's own reads
    that need not happen every step (Lightning's SIGTERM agreement, PreemptionHandler's, the strategy's
    report of non-finite skips) happen on these steps only."""
    return log_every_n_steps > 0 and step % log_every_n_steps == 0


def optimizer_host_tensors(optimizers: Iterable[Any]) -> list[Tensor]:
    """The tensors torch.optim keeps on the host on every device: each parameter's `step` counter of a
    param group that is neither `capturable` nor `fused` (torch reads it with `.item()` on purpose)."""
    found = []
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.Optimizer):
            continue
        for group in optimizer.param_groups:
            if group.get("capturable") or group.get("fused"):
                continue
            for p in group["params"]:
                state = optimizer.state.get(p)
                step = state.get("step") if isinstance(state, dict) else None
                if isinstance(step, Tensor) and step.device.type == "cpu" and step.numel() == 1:
                    found.append(step)
    return found


class HostSyncMeter:
    """Counts the host syncs of the code run while it is entered (the module docstring's rule).

    Args:
        device: the run's device (its type decides which tensors are "on the device").
        host_tensors: tensors that live on the host on every device; reading them is never a sync.

    After (or while) entered: `ops` (aten op -> syncs), `reads` (`to_host` reason -> reads), `excluded`
    (`host_syncs_excluded` mark -> syncs inside it, not counted in `total`), `total` (ops + reads).
    Entering again starts a new count.
    """

    def __init__(self, device: torch.device | str = "cpu", host_tensors: Iterable[Tensor] = ()) -> None:
        self.device_type = torch.device(device).type
        self._host = {_storage(t) for t in host_tensors}
        self.ops: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()
        self.excluded: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._mode: Any = None

    @property
    def total(self) -> int:
        """Host syncs counted outside the excluded marks: sync ops plus `to_host` reads."""
        return sum(self.ops.values()) + sum(self.reads.values())

    def counts(self) -> dict[str, dict[str, int]]:
        """{"ops": {op: n}, "reads": {reason: n}, "excluded": {mark: n}} (plain dicts, sorted)."""
        return {k: dict(sorted(getattr(self, k).items())) for k in ("ops", "reads", "excluded")}

    def on_device(self, t: Any) -> bool:
        """Whether `t` is a tensor of the run's device whose value would have to come back to the host."""
        return (
            isinstance(t, Tensor)
            and t.device.type == self.device_type
            and not (self._host and _storage(t) in self._host)
        )

    def record_read(self, tensor: Tensor, reason: str) -> None:
        """A `to_host(tensor, reason)` read: one sync when `tensor` is on the device."""
        if self._mode is not None and self.on_device(tensor):
            self._add(self.reads, reason)

    def record_op(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        """An aten op `func` about to run: one sync when it is one (module docstring); ops inside a
        `to_host` read are that read's."""
        if _state.reading:
            return
        packet = func.overloadpacket  # an aten op (the mode takes no higher-order operators)
        if packet in _ALWAYS:
            sync = self.on_device(args[0]) if args else False
        elif func is _ATEN.repeat_interleave.Tensor:
            sync = kwargs.get("output_size") is None and self.on_device(args[0])
        elif packet in _MASK_INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            sync = any(
                self.on_device(i) and i.dtype in (torch.bool, torch.uint8) for i in indices if i is not None
            )
        elif packet is _PRIVATE["_to_copy"]:
            target = kwargs.get("device")
            target_type = args[0].device.type if target is None else torch.device(target).type
            sync = self._crosses(args[0].device.type, target_type, kwargs.get("non_blocking", False))
        elif packet is _ATEN.copy_:
            src = args[1] if len(args) > 1 else kwargs.get("src")
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            sync = isinstance(src, Tensor) and self._crosses(
                src.device.type, args[0].device.type, non_blocking
            )
        else:
            return
        if sync:
            self._add(self.ops, packet.__name__)

    def _crosses(self, source: str, target: str, non_blocking: bool) -> bool:
        """Whether a copy from a `source` to a `target` device type waits for the device: a blocking copy
        between the host and the run's accelerator, either way (torch synchronises the stream around a
        blocking copy from or to pageable host memory)."""
        return (
            self.device_type != "cpu" and not non_blocking and {source, target} == {"cpu", self.device_type}
        )

    def _add(self, counter: Counter[str], key: str) -> None:
        with self._lock:
            if _state.mark is not None:
                self.excluded[_state.mark] += 1
            else:
                counter[key] += 1

    def __enter__(self) -> HostSyncMeter:
        self.ops.clear()
        self.reads.clear()
        self.excluded.clear()
        self._mode = _SyncOps(self)
        self._mode.__enter__()
        with _meters_lock:
            _meters.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        with _meters_lock:
            _meters.remove(self)
        mode, self._mode = self._mode, None
        mode.__exit__(*exc)


class _SyncOps(torch_compat.TorchDispatchMode):
    """The dispatch mode of a `HostSyncMeter`: hands each aten op to the meter, then runs it unchanged."""

    def __init__(self, meter: HostSyncMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.meter.record_op(func, args, kwargs)
        return func(*args, **kwargs)


def _storage(t: Tensor) -> tuple[str, int]:
    """The memory `t` lives in (a tensor subclass without storage of its own: none)."""
    try:
        return str(t.device), t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return str(t.device), -1
