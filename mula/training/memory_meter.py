"""Per-rank memory accounting: what a rank's parameters, gradients and saved activations hold.

`callbacks.MemoryMetrics` logs these every `log_every_n_steps` optimizer steps, `mula bench` reports
them next to `mula plan`'s prediction, and the planner's tests measure with them:

* `mem/param_bytes`: bytes of this rank's parameters (its local shards under expert parallelism).
* `mem/grad_bytes`: gradient bytes held when the optimizer steps: the optimizer's gradient buffer
  when it has one (`grad_buffer_bytes()`, the EP-aware sharded optimizer), else the `.grad` tensors.
* `mem/activation_bytes`: the most bytes autograd holds saved for backward at one time during a
  micro-batch's forward (the most over the logged step's micro-batches), each storage counted once and
  parameters excluded (`SavedTensorMeter`). With pipeline stages a step's whole schedule runs in one
  `training_step`: it is then the peak over the schedule, whose backwards free micro-batches while
  later forwards save more. Measured only on logged steps: other steps run without the hooks.
* `mem/peak_allocated_bytes` (CUDA/XPU only): the allocator's peak since the previous logged step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from mula.torch_compat import AsyncCollectiveTensor
from mula.training.strategy_contract import OptimizerBytes


def _storage_key(t: Tensor) -> tuple[str, int]:
    """Identifies the memory a tensor lives in: views of one storage share it."""
    return str(t.device), t.untyped_storage().data_ptr()


def _local(t: Tensor) -> Tensor:
    """This rank's part of a (possibly distributed) tensor: a DTensor's local shard; the waited result
    of a functional collective (tensor parallelism's), a wrapper without storage of its own."""
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.trigger_wait() if isinstance(t, AsyncCollectiveTensor) else t


class _Window:
    """Live saved-tensor bytes of one metering window: storages held by autograd's saved tensors, each
    counted once however many saved tensors refer to it, and the most held at any one time. Locked:
    on accelerators autograd's engine releases saved tensors from its own threads."""

    def __init__(self) -> None:
        self.live: dict[tuple[str, int], list[int]] = {}  # storage -> [saved tensors alive, bytes]
        self.current = 0
        self.peak = 0
        self._lock = threading.Lock()

    def hold(self, key: tuple[str, int], nbytes: int) -> None:
        """One more saved tensor refers to storage `key` of `nbytes` bytes."""
        with self._lock:
            entry = self.live.setdefault(key, [0, nbytes])
            if entry[0] == 0:
                self.current += nbytes
                self.peak = max(self.peak, self.current)
            entry[0] += 1

    def release(self, key: tuple[str, int]) -> None:
        """Autograd let go of one saved tensor referring to storage `key`."""
        with self._lock:
            entry = self.live[key]
            entry[0] -= 1
            if entry[0] == 0:
                self.current -= entry[1]
                del self.live[key]


class _Saved:
    """What autograd keeps for one saved tensor while a meter is active: the tensor itself, and a count
    in its window that ends when autograd lets go of it (its backward ran, or its graph was freed)."""

    __slots__ = ("tensor", "_window", "_key")

    def __init__(self, tensor: Tensor, window: _Window, key: tuple[str, int] | None) -> None:
        self.tensor, self._window, self._key = tensor, window, key

    def __del__(self) -> None:
        if self._key is not None:
            self._window.release(self._key)


class SavedTensorMeter:
    """The most bytes autograd holds saved for backward at any one time while the meter is entered.

    Every tensor saved while entered is wrapped (`saved_tensors_hooks`) in a small holder that autograd
    keeps in its place: a storage's bytes count from the first save referring to it until autograd has
    released every holder referring to it -- after the backward that used it (or when its graph is
    freed). `bytes` is the peak of that sum, so one forward gives everything it saves, and a pipeline
    schedule, whose backwards free micro-batches while later forwards save more, gives what the stage
    holds at its fullest. Views of one storage count once; storages of `exclude` (the parameters, which
    exist anyway) not at all. Saved tensors are handed back unchanged (numerics are untouched).
    Re-entering starts a new count; holders of an earlier window release into that window only.
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._exclude = {_storage_key(_local(t)) for t in exclude}
        self._window = _Window()
        self._hooks: Any = None

    @property
    def active(self) -> bool:
        """Whether the meter is counting (entered and not yet exited)."""
        return self._hooks is not None

    @property
    def bytes(self) -> int:
        """The peak of saved-tensor bytes held since the meter was last entered."""
        return self._window.peak

    def _pack(self, t: Tensor) -> _Saved:
        local = _local(t)
        key = _storage_key(local)
        if key in self._exclude:
            return _Saved(t.detach(), self._window, None)
        self._window.hold(key, local.untyped_storage().nbytes())
        return _Saved(t.detach(), self._window, key)

    @staticmethod
    def _unpack(saved: _Saved) -> Tensor:
        return saved.tensor

    def __enter__(self) -> SavedTensorMeter:
        self._window = _Window()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None


def param_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s parameters on this rank (tied parameters once)."""
    return sum(_local(p).numel() * _local(p).element_size() for p in module.parameters())


def grad_bytes(module: torch.nn.Module, optimizer: Any = None) -> int:
    """Gradient bytes held: the optimizer's own buffer if it has one, else `module`'s `.grad` storages."""
    if isinstance(optimizer, OptimizerBytes):
        return int(optimizer.grad_buffer_bytes())
    storages = {}
    for p in module.parameters():
        if p.grad is not None:
            g = _local(p.grad)
            storages.setdefault(_storage_key(g), g.untyped_storage().nbytes())
    return sum(storages.values())
