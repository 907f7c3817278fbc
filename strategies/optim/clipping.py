"""The sharded optimizer's global gradient norm, non-finite flag and clipping (a mixin of
``EPShardedAdamW``): every gradient element is owned by exactly one rank's shard, so one all-reduce
of the local sums of squares (and a non-finite count) gives the norm of the unsharded model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from strategies.optim.norms import square_sum
from strategies.topology import reduce_over_stages


class ShardClipping:
    """``grad_norm`` and ``clip_grad_norm_`` of ``EPShardedAdamW`` (reads its shard, reducer, topology)."""

    options: Any
    topology: Any
    reducer: Any
    shard_grad: Tensor
    tail_start: int
    _host: Any
    _p: Any
    _tp_split_ranges: list[tuple[int, int]]
    reduce_gradients: Callable[[], None]  # EPShardedAdamW's: finish the gradient reduction

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, norm: Tensor | None = None) -> Tensor:
        """Clip the (global) gradient to ``max_norm`` as ``torch.nn.utils.clip_grad_norm_`` would on the
        unsharded model; returns the total norm before clipping. One all-reduce over the world, none
        when ``norm`` (this round's ``grad_norm()``) is given.

        No scaling during the first ``clip_after_step`` optimizer steps (warmup)."""
        if norm is None:
            norm, _ = self.grad_norm(norm_type)
        if self._p.steps_done >= self.options.clip_after_step:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            if self._host is not None:  # the update reads the host copy: scale that one
                self._host.clip(coef)
                self.shard_grad[self.tail_start :].mul_(coef.to(self.shard_grad.dtype))  # tail buckets
            else:
                self.shard_grad.mul_(coef.to(self.shard_grad.dtype))
        self._p.clipped = True
        return norm

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> tuple[Tensor, Tensor]:
        """Finish the reduction, then (global gradient norm, all gradients finite) over every rank's
        shard and every pipeline stage: one all-reduce carries the norm and a non-finite count, so
        every rank returns the same verdict (a 0-dim bool tensor; no host sync here)."""
        if norm_type not in (2.0, float("inf")):
            raise ValueError(f"clip_grad_norm_ supports norm_type 2 or inf, got {norm_type}.")
        if self._host is not None:
            self._host.order_device()
        self.reduce_gradients()
        inf = norm_type == float("inf")
        parts, split = [], []
        for name, (lo, hi) in self.reducer.domain_ranges.items():
            g = self.shard_grad[lo:hi].float()
            if inf:
                parts.append(g.abs().max() if g.numel() else g.new_zeros(()))
            else:
                sq = square_sum(g)  # not one fp32 dot over the shard (strategies/optim/norms.py)
                if name == "dense" and not self.options.ep_aware:
                    sq = sq / self.topology.size("ep")  # each dense element is held by E ranks
                parts.append(sq)
        for lo, hi in self._tp_split_ranges:  # TP-split elements: summed over the TP group below
            g = self.shard_grad[lo:hi].float()
            split.append(g.abs().max() if inf else square_sum(g))
        local = torch.stack(parts).max() if inf else torch.stack(parts).sum()
        zero = local.new_zeros(())
        split_part = (torch.stack(split).max() if inf else torch.stack(split).sum()) if split else zero
        if not inf:  # `local` counted them too: keep them apart, to be summed over the TP group
            local = local - split_part
        # a square (or |g|) is non-finite exactly when an element is: the flag costs no extra pass
        bad = (~torch.isfinite(local)).float() + (~torch.isfinite(split_part)).float()
        total = torch.stack([torch.where(bad > 0, zero, local), torch.where(bad > 0, zero, split_part), bad])
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        if self.topology.size("replica") > 1:
            dist.all_reduce(total, op=op, group=self.topology.group("replica"))
        if self.topology.size("tp") > 1:
            # the data-parallel world holds one TP shard: split elements differ over the TP group (sum
            # them), replicated ones are the same on every TP rank (count them once)
            tail = total[1:]
            dist.all_reduce(tail, op=op, group=self.topology.group("tp"))
        total = torch.stack([total[0] + total[1] if not inf else total[:2].max(), total[2]])
        reduce_over_stages(total, self.topology, op)  # each stage holds its part of the model
        finite = total[1] == 0
        norm = total[0] if norm_type == float("inf") else total[0].sqrt()
        norm = torch.where(finite, norm, torch.full_like(norm, float("nan")))
        self._p.last_norm = norm
        return norm, finite
