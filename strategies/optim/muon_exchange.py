"""Sharded Muon's all-to-all of one bucket: each rank's update slices to their matrices' owners, the
orthogonalised slices back (the plan: `mula.layout.muon_exchange`).

Both trips are one `all_to_all_single` over the bucket's domain. The forward sends each owner the pieces
of its matrices this rank holds, packed in the plan's order, and the owner receives its matrices whole,
one after another; the return sends those same buffers back with the split sizes swapped, so each rank
receives its pieces in the order it packed them and unpacks them into its slice. A domain of one rank
skips the collectives (its plan sends everything to itself).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mula.layout.muon_exchange import ExchangePlan
from strategies.optim.grad_reduce import Domain

__all__ = ["BucketExchange"]


class BucketExchange:
    """The all-to-all of one Muon bucket for this rank, by its `ExchangePlan` over `domain`."""

    def __init__(self, plan: ExchangePlan, domain: Domain) -> None:
        self.plan, self.domain = plan, domain
        self._runs = [run for runs in plan.send for run in runs]  # packing order: by destination rank

    def send(self, update: Tensor) -> tuple[Tensor, Tensor, list[Any]]:
        """Start sending this rank's slice ``update`` (the bucket's slice, in Newton-Schulz's dtype) to the
        owners: (the packed send buffer, which the return reuses; the buffer of this rank's matrices
        being received; the work handles)."""
        packed = torch.cat([update[lo:hi] for lo, hi in self._runs]) if self._runs else update[:0].clone()
        if self.domain.size == 1:
            return packed, packed, []
        received = update.new_empty(self.plan.received)
        return (
            packed,
            received,
            self._all_to_all(received, packed, list(self.plan.recv), self.plan.send_sizes),
        )

    def matrices(self, received: Tensor) -> list[tuple[Any, Tensor]]:
        """This rank's matrices in ``received``: (their `MatrixTask`, a [rows, cols] view)."""
        out = []
        for task, offset in self.plan.owned:
            out.append((task, received[offset : offset + task.rows * task.cols].view(task.rows, task.cols)))
        return out

    def give_back(self, received: Tensor, packed: Tensor) -> list[Any]:
        """Start returning the owned matrices (orthogonalised in place in ``received``) to the ranks that
        sent them; each rank's pieces land in ``packed``, in the order it packed them."""
        if self.domain.size == 1:
            if received is not packed:
                packed.copy_(received)
            return []
        return self._all_to_all(packed, received, self.plan.send_sizes, list(self.plan.recv))

    def unpack(self, packed: Tensor, out: Tensor) -> Tensor:
        """Write the returned pieces in ``packed`` into this rank's slice ``out``; returns ``out``."""
        at = 0
        for lo, hi in self._runs:
            out[lo:hi].copy_(packed[at : at + hi - lo])
            at += hi - lo
        return out

    def _all_to_all(self, out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int]) -> list[Any]:
        dom = self.domain
        return [dist.all_to_all_single(out, inp, out_splits, in_splits, group=dom.group, async_op=True)]
