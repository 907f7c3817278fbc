"""EP-aware sharded Muon (`model.optimizer: muon` with `shard_optimizer: true`): Muon's state split once
across the data-parallel ranks like AdamW's, Newton-Schulz split by matrix.

The layout is `EPShardedAdamW`'s (strategies/optim/sharded_optimizer.py): dense parameters sharded
over all data-parallel ranks, expert parameters over their expert-data-parallel (EDP) group, each rank
owning an even, element-wise slice of every bucket. Muon's matrices fill buckets of their own
(`mula.layout.flat_buffers.plan_buckets`), so a rank keeps 8 bytes per owned Muon element (fp32 master
+ momentum) and 12 per owned AdamW element (master + exp_avg + exp_avg_sq): the second moment exists
only for AdamW's buckets.

Newton-Schulz needs each matrix whole, so every matrix has one owner in its domain, chosen by
Newton-Schulz FLOPs (m * n * min(m, n), `mula.layout.flat_buffers.matrix_owners`): dense matrices over
all data-parallel ranks, experts' over their EDP group. Per Muon bucket and step:

1. every rank updates the momentum of its slice and forms the Nesterov update U there (elementwise,
   as `torch.optim.Muon`) in Newton-Schulz's dtype (bfloat16 as torch's, or `ns_dtype="float32"`) --
   exactly what Newton-Schulz reads, its first operation being the cast to that dtype -- and sends
   each owner the pieces of its matrices it holds (one all-to-all, strategies/optim/muon_exchange.py);
2. each owner, having received its matrices whole, orthogonalises them in place;
3. a second all-to-all returns every piece to the rank it came from, which puts it in its slice;
4. every rank applies decoupled weight decay and the scaled update to its fp32 master slice, and the
   bucket's parameter all-gather starts, as for AdamW's buckets.

Against replicated Muon (every rank runs every Newton-Schulz of the matrices it holds) this divides
the Newton-Schulz work by the domain's size, and each rank sends and receives about 2/n of a bucket's
Muon elements per step (its matrices in, its slice back; `mula.layout.muon_exchange`), where an
all-gather of the update and a reduce-scatter of the result moved 2 (n - 1)/n of them. The next
bucket's exchange runs while this one's Newton-Schulz does and at most two returns are in flight, so
the transient buffers are a few buckets' slices and owned matrices, never the model (the planner
counts them: `mula.layout.muon_exchange.exchange_volume`). AdamW's buckets update first, their
parameter all-gathers overlapping Muon's work. The gradient norm, clipping and the non-finite skip are
the step's, as for AdamW (`strategies.optim.clipping`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mula.layout.flat_buffers import Bucket, MatrixTask, ParamEntry, matrix_owners
from mula.layout.muon_exchange import exchange_plan
from mula.layout.rules import check_optimizer
from mula.training.muon import (
    NS_DTYPES,
    adjusted_lr,
    check_matrix_shapes,
    check_muon_options,
    is_muon_group,
    newton_schulz,
)
from strategies.optim.muon_exchange import BucketExchange
from strategies.optim.sharded_optimizer import EPShardedAdamW
from strategies.topology import LayoutMesh

__all__ = ["EPShardedMuon"]

_MUON_KINDS = ("master", "momentum_buffer")


@dataclass
class _InFlight:
    """One Muon bucket between its update and its apply: this rank's update slice (where the returned
    orthogonal slice lands), the packed send buffer (the return lands there), the received matrices and
    the all-to-all in flight."""

    index: int
    update: Tensor
    packed: Tensor
    received: Tensor
    handles: list[Any]


class EPShardedMuon(EPShardedAdamW):
    """`EPShardedAdamW` whose param groups marked `{"muon": True}` train with Muon, sharded by matrix.

    Args: those of `EPShardedAdamW`, plus Muon's `momentum`, `ns_steps`, `adjust_lr` and `ns_dtype`
    (`mula.training.muon.check_muon_options`), the defaults of the Muon groups (`ns_dtype`, also the
    dtype of the update's collectives, is the optimizer's, as `MulaMuon`'s); a Muon group lists the
    (rows, cols) of its parameters' matrices under "matrix_shapes" (`MulaLightningModule.param_groups`).
    Offload (its host update is AdamW's) and tensor parallelism are refused (`check_optimizer`). Equal
    to `mula.training.muon.MulaMuon` on one process (tests/test_sharded_muon.py).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        named_params: Iterable[tuple[str, Tensor]],
        topology: LayoutMesh | None = None,
        *,
        momentum: float = 0.95,
        ns_steps: int = 5,
        adjust_lr: str = "match_rms_adamw",
        ns_dtype: str = "bfloat16",
        **kwargs: Any,
    ) -> None:
        check_muon_options(momentum, ns_steps, adjust_lr, ns_dtype)
        check_optimizer("muon", 1 if topology is None else topology.size("tp"), bool(kwargs.get("offload")))
        self._muon_defaults = {"momentum": momentum, "ns_steps": ns_steps, "adjust_lr": adjust_lr}
        self._ns_dtype = NS_DTYPES[ns_dtype]
        super().__init__(params, named_params, topology, **kwargs)
        states = self.reducer.states
        self._tasks = matrix_owners(self.buckets)
        self._exchange = {
            i: BucketExchange(exchange_plan(self.buckets[i], tasks, states[i].domain.rank), states[i].domain)
            for i, tasks in self._tasks.items()
        }
        self._mine = {i: [t for t, _ in ex.plan.owned] for i, ex in self._exchange.items()}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As `EPShardedAdamW`'s; a Muon group also gets Muon's defaults and its matrix shapes checked."""
        if is_muon_group(param_group):
            for key, value in self._muon_defaults.items():
                param_group.setdefault(key, value)
            check_matrix_shapes(param_group)
        super().add_param_group(param_group)

    def _matrix_shape(self, group: dict[str, Any], position: int) -> tuple[int, int] | None:
        if not is_muon_group(group):
            return None
        rows, cols = group["matrix_shapes"][position]
        return int(rows), int(cols)

    # ----------------------------------------------------------------------------------------
    # state: master + momentum for Muon's buckets, AdamW's three for the others

    def _second_moment_numel(self) -> int:
        """Only AdamW's buckets keep exp_avg_sq: a compact buffer, `_sq_offset` maps a bucket's shard
        offset into it."""
        self._sq_offset: dict[int, int] = {}
        numel = 0
        for b, st in zip(self.buckets, self.reducer.states):
            if not b.muon:
                self._sq_offset[st.shard_offset] = numel
                numel += b.shard_numel
        return numel

    def state_kinds(self, entry: ParamEntry) -> tuple[str, ...]:
        """A Muon matrix keeps its fp32 master and "momentum_buffer", an AdamW parameter AdamW's."""
        return _MUON_KINDS if entry.matrix is not None else super().state_kinds(entry)

    def state_buffer(self, kind: str, offset: int) -> tuple[Tensor, int]:
        if kind == "momentum_buffer":  # (Muon's momentum shares the first-moment buffer)
            return self.exp_avg, offset
        if kind == "exp_avg_sq":
            return self.exp_avg_sq, self._sq_offset[offset]
        return super().state_buffer(kind, offset)

    def bucket_state(self, index: int) -> tuple[Tensor, Tensor, Tensor]:
        """Bucket ``index``'s shard of (master, exp_avg or Muon's momentum, exp_avg_sq: empty for Muon)."""
        if not self.buckets[index].muon:
            return super().bucket_state(index)
        lo, hi = self._shard_range(index)
        return self.master[lo:hi], self.exp_avg[lo:hi], self.exp_avg_sq[:0]

    # ----------------------------------------------------------------------------------------
    # update

    def _update_and_gather(self, step: Tensor, found_inf: Tensor | None = None) -> None:
        # (`found_inf` is always None here: `step` refuses it, `masks_update_on_device` being False with
        # Muon's buckets; the AdamW buckets take it as `EPShardedAdamW`'s do)
        muon = [i for i, b in enumerate(self.buckets) if b.muon]
        for i, b in enumerate(self.buckets):
            if not b.muon:
                self._update_bucket(i, self.shard_grad, step, found_inf)
                self._gather.launch(i, self.bucket_state(i)[0])
        sends: dict[int, _InFlight] = {}
        returns: list[_InFlight] = []
        if muon:
            sends[muon[0]] = self._send_update(muon[0])
        for k, i in enumerate(muon):
            if k + 1 < len(muon):  # the next bucket's exchange overlaps this one's Newton-Schulz
                sends[muon[k + 1]] = self._send_update(muon[k + 1])
            flight = sends.pop(i)
            for handle in flight.handles:
                handle.wait()
            returns.append(self._orthogonalise(flight))
            if len(returns) > 2:
                self._apply(returns.pop(0))
        for pending in returns:
            self._apply(pending)

    def _send_update(self, index: int) -> _InFlight:
        """The Nesterov update of this rank's slice of Muon bucket ``index`` and the start of its
        all-to-all to the matrices' owners."""
        update = self._nesterov_update(index)
        packed, received, handles = self._exchange[index].send(update)
        return _InFlight(index, update, packed, received, handles)

    def _nesterov_update(self, index: int) -> Tensor:
        """Momentum and Nesterov update of this rank's slice of Muon bucket ``index`` (fp32, as
        `mula.training.muon.muon_matrix_update`), in Newton-Schulz's dtype."""
        lo, hi = self._shard_range(index)
        _, momentum, _ = self.bucket_state(index)
        grads = self.shard_grad[lo:hi]
        update = torch.zeros(hi - lo, dtype=self._ns_dtype, device=self.device)
        for run in self._runs[index]:  # (padding between a run's segments: zero gradient, zero update)
            mu = float(self.param_groups[run.group]["momentum"])
            g, buf = grads[run.lo : run.hi].float(), momentum[run.lo : run.hi]
            buf.lerp_(g, 1 - mu)
            update[run.lo : run.hi].copy_(g.lerp(buf, mu))
        return update

    def _orthogonalise(self, flight: _InFlight) -> _InFlight:
        """Newton-Schulz of the matrices this rank owns in the bucket (received whole), in place, and the
        start of their return to the ranks holding their slices."""
        exchange = self._exchange[flight.index]
        mine = {t.start for t in self._mine[flight.index]}
        for task, x in exchange.matrices(flight.received):
            if task.start in mine:  # (newton_schulz has read x when it returns: overwriting it is safe)
                x.copy_(newton_schulz(x, int(self.param_groups[task.group]["ns_steps"]), self._ns_dtype))
        flight.handles = exchange.give_back(flight.received, flight.packed)
        return flight

    def _returned(self, flight: _InFlight) -> Tensor:
        """This rank's slice of the orthogonalised update, once returned (in ``flight.update``)."""
        return self._exchange[flight.index].unpack(flight.packed, flight.update)

    def _apply(self, flight: _InFlight) -> None:
        """Decoupled weight decay and the scaled orthogonal update on this rank's master slice of the
        bucket, then the start of the bucket's parameter all-gather."""
        for handle in flight.handles:
            handle.wait()
        index = flight.index
        mine = self._returned(flight)
        master, _, _ = self.bucket_state(index)
        bucket: Bucket = self.buckets[index]
        for seg in bucket.segments(self.reducer.states[index].domain.rank):
            entry = seg.slot.entry
            group = self.param_groups[entry.group]
            lr, rows, cols = float(group["lr"]), *entry.matrix  # type: ignore[misc]
            piece = master[seg.shard_start : seg.shard_start + seg.length]
            piece.mul_(1 - lr * float(group["weight_decay"]))
            scale = adjusted_lr(lr, group["adjust_lr"], rows, cols)
            piece.add_(mine[seg.shard_start : seg.shard_start + seg.length], alpha=-scale)
        self._gather.launch(index, master)

    def owned_matrices(self) -> list[MatrixTask]:
        """The Muon matrices this rank orthogonalises each step."""
        return [t for tasks in self._mine.values() for t in tasks]
