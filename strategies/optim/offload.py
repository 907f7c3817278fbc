"""Optimizer offload as SuperOffload does it (Lian et al., arXiv 2509.21271): speculation, then validation.

With ``optimizer_options.offload: true`` the fp32 master weights and Adam moments of ``EPShardedAdamW``
live in (pinned) host memory. ``HostUpdate`` starts a bucket's host update as soon as that bucket's
gradient reduction is launched in the step's last backward (with pipeline stages: in the last backward
of the bucket's stage, while the schedule goes on): one host worker thread waits for the
reduction, copies the bucket's gradient shard to host memory and runs the vectorised AdamW on it
(``adamw.update_runs``: torch's fused CPU kernel), while the device goes on with backward. It first
saves the slices of master / exp_avg / exp_avg_sq it is about to change (preallocated host buffers).

The update is a speculation: it assumed no clipping and finite gradients, and the step's hyperparameters
as they were when it started. Once the global norm and the all-ranks finite flag are known
(``EPShardedAdamW.grad_norm``, one all-reduce) it is validated:

* kept, when the clip coefficient is exactly 1 (or clipping is off) and nothing changed;
* undone and recomputed, when clipping applies (coef < 1), when a bucket was reduced again after its
  speculation (a further backward in the same step), or when the hyperparameters changed: the saved
  slices are restored bit for bit and the bucket is updated again with the clipped gradient;
* undone, when the step is skipped (a non-finite gradient, or a callback's veto): ``zero_grad``
  without a ``step`` restores every speculated bucket.

Restoring saved bits and running the same kernel on the same inputs makes an offloaded run bitwise equal
to one that updates after backward; ``rollbacks`` counts the steps where a speculation was undone
(``optim/offload_rollbacks``). No weight reaches the device before validation: the parameters' all-gather
is launched by ``step()`` afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from strategies.optim.grad_reduce import GradReducer

_HPARAMS = ("lr", "betas", "eps", "weight_decay")


def host_memory(device: torch.device) -> torch.device:
    """Where offloaded state lives for parameters on ``device``: host memory, or the meta device when the
    parameters are meta tensors (``mula plan --dry_run`` measures shapes and stores nothing)."""
    return torch.device("meta") if device.type == "meta" else torch.device("cpu")


def pinned(device: torch.device) -> bool:
    """Whether host buffers feeding ``device`` are pinned: only for an accelerator (a CPU or meta run has
    no pinned allocator, and nothing to overlap a copy with)."""
    return device.type not in ("cpu", "meta")


class HostUpdate:
    """The speculative host update of an offloaded sharded optimizer's flat shard.

    Args:
        reducer: the optimizer's gradient reducer (its ``shard_grad`` on the device, its buckets).
        buckets: the buckets updated on the host (all but the tail buckets, which stay on the device).
        state: (master, exp_avg, exp_avg_sq), flat fp32 host tensors over this rank's shard.
        host_grad: the host copy of the gradient shard (reduce dtype, pinned on accelerators).
        step_count: the optimizer's step counter (incremented by ``step()`` before ``finish``).
        param_groups: the optimizer's param groups (read for each update).
        update: ``update(index, grads, step)`` runs AdamW on bucket ``index`` with ``grads``.
        speculate: start updates during backward; False updates every bucket in ``finish`` (the
            benchmark's "after backward" arm).
    """

    def __init__(
        self,
        reducer: GradReducer,
        buckets: Sequence[int],
        state: tuple[Tensor, Tensor, Tensor],
        host_grad: Tensor,
        step_count: Tensor,
        param_groups: Sequence[dict[str, Any]],
        update: Callable[[int, Tensor, Tensor], None],
        *,
        speculate: bool = True,
    ) -> None:
        self.reducer, self.state, self.host_grad = reducer, state, host_grad
        self.step_count, self.param_groups, self._update = step_count, param_groups, update
        self.speculate, self.buckets = speculate, list(buckets)
        self._mine = set(self.buckets)
        self.device = reducer.shard_grad.device
        # what a speculated bucket needs to be undone exactly: its state slices before the update (12
        # bytes per element of host memory, only when speculating)
        self._saved = tuple(torch.empty_like(t) for t in state) if speculate else ()
        self._spec_step = torch.zeros_like(step_count)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mula-offload")
        self._pending: dict[int, Future] = {}  # bucket -> its speculative update
        self._landed: dict[int, threading.Event] = {}  # bucket -> its reduction landed and was copied
        self._copied: dict[int, Any] = {}  # bucket -> device event after its copy (accelerators)
        self._stream = torch.Stream(device=self.device) if self.device.type != "cpu" else None
        self._on_host: set[int] = set()  # buckets whose gradient shard is in host_grad this round
        self._spec_hparams: list[tuple] | None = None
        self._stale = False  # a speculated bucket was reduced again: recompute
        self._relaunched: set[int] = set()  # those buckets
        self._clip: Tensor | None = None  # the clip coefficient applied to host_grad this round
        self.rollbacks = 0
        self.speculated = 0  # bucket updates started during backward, over the run
        reducer.on_launch = self.on_launch if speculate else None

    # ----- backward: speculation ---------------------------------------------------------------
    def on_launch(self, index: int) -> None:
        """The reducer launched bucket ``index``'s reduction in the step's last backward: queue its
        speculative host update (main thread; the worker does the waiting)."""
        if index not in self._mine:
            return  # a tail bucket: updated on the device in step()
        if index in self._pending:
            self._stale = True  # its gradient changes again: the speculation no longer holds
            self._relaunched.add(index)  # and its host copy must be taken again
            return
        if not self._pending:
            self._spec_hparams = self._hparams()
            torch.add(self.step_count, 1, out=self._spec_step)
        self._landed[index] = threading.Event()
        self._pending[index] = self._pool.submit(self._speculate, index)
        self.speculated += 1

    def order_device(self) -> None:
        """Before the main thread reads the gradient shard (the norm): the worker may have landed a
        bucket's reduction on its side stream; make the current stream wait for it."""
        for index, future in self._pending.items():
            while not self._landed[index].wait(timeout=0.05):
                if future.done():
                    future.result()  # the worker failed before landing: raise its error here
            if index in self._copied:
                torch.accelerator.current_stream(self.device).wait_event(self._copied[index])

    def _speculate(self, index: int) -> None:
        lo, hi = self._range(index)
        if self._stream is None:
            self.reducer.wait_bucket(index)
            self._to_host(lo, hi)
        else:  # a side stream: waiting for the reduction and copying do not queue behind backward
            with self._stream:
                landed = self.reducer.wait_bucket(index)  # alive until the side stream is done with it
                self._to_host(lo, hi)
                event = torch.Event(device=self.device)
                event.record(self._stream)
            self._copied[index] = event
            event.synchronize()
            del landed
        self._landed[index].set()
        self._on_host.add(index)
        for saved, live in zip(self._saved, self.state):
            saved[lo:hi].copy_(live[lo:hi])
        self._update(index, self.host_grad, self._spec_step)

    def _join(self) -> None:
        for future in self._pending.values():
            future.result()  # re-raises a worker's exception here

    # ----- after backward: validation ----------------------------------------------------------
    def clip(self, coef: Tensor) -> None:
        """Scale this round's gradient shard by the clip coefficient ``coef`` (on the host, where
        the update reads it). A coefficient of exactly 1 changes nothing, so speculations stand."""
        self._join()
        self._all_to_host()
        if not bool(coef == 1):  # coef < 1, or NaN from a non-finite norm: as the device path does
            self.host_grad.mul_(coef.to(self.host_grad.device, self.host_grad.dtype))
            self._clip = coef

    def finish(self) -> None:
        """In ``step()``, after ``step_count`` was incremented: keep the speculations that hold, undo and
        recompute the others, update the buckets nobody speculated on. Then every bucket's master
        shard is this step's."""
        self._join()
        valid = (
            self._clip is None
            and not self._stale
            and self._spec_hparams == self._hparams()
            and bool(self._spec_step == self.step_count)
        )
        if self._pending and not valid:
            self.rollbacks += 1
        self._all_to_host()
        for index in self.buckets:
            if index in self._pending:
                if valid:
                    continue
                self._restore(index)
            self._update(index, self.host_grad, self.step_count)
        self._reset()

    def discard(self) -> None:
        """The step was skipped (``zero_grad`` without ``step``): undo every speculated bucket."""
        self._join()
        if self._pending:
            self.rollbacks += 1
            for index in self._pending:
                self._restore(index)
        self._reset()

    def close(self) -> None:
        """Stop the worker thread (after finishing what it has)."""
        self._pool.shutdown(wait=True)

    # ----- helpers ------------------------------------------------------------------------------
    def _restore(self, index: int) -> None:
        lo, hi = self._range(index)
        for saved, live in zip(self._saved, self.state):
            live[lo:hi].copy_(saved[lo:hi])

    def _reset(self) -> None:
        self._pending.clear()
        self._landed.clear()
        self._copied.clear()
        self._on_host.clear()
        self._relaunched.clear()
        self._spec_hparams, self._stale, self._clip = None, False, None

    def _all_to_host(self) -> None:
        """Copy every bucket's gradient shard not yet on the host, or reduced again since its copy (all
        queued, then one wait; after ``_join``: the worker is done)."""
        missing = [i for i in self.buckets if i not in self._on_host or i in self._relaunched]
        self._relaunched.clear()
        for index in missing:
            self._to_host(*self._range(index))
            self._on_host.add(index)
        if missing and self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)

    def _to_host(self, lo: int, hi: int) -> None:
        self.host_grad[lo:hi].copy_(self.reducer.shard_grad[lo:hi], non_blocking=True)

    def _range(self, index: int) -> tuple[int, int]:
        lo = self.reducer.states[index].shard_offset
        return lo, lo + self.reducer.buckets[index].shard_numel

    def _hparams(self) -> list[tuple]:
        return [tuple(g[k] for k in _HPARAMS) for g in self.param_groups]

    def state_bytes(self) -> int:
        """Host bytes this engine adds: the saved slices (12 per element, when speculating) and the
        gradient copy."""
        return sum(t.numel() * t.element_size() for t in (*self._saved, self.host_grad))
