"""Gradient synchronisation for expert parallelism when the optimizer is not sharded.

Dense parameters are replicated on all W ranks, each expert on the W/E ranks of its EDP group.
Every rank's loss is the mean over its own micro-batch, so the gradient of the global-batch loss is
(1/W) * sum over ranks of the local gradients. For dense parameters that sum runs over the world.
For expert parameters the all-to-all backward has already summed the contributions of the E ranks
of the EP group into the expert's owner, so the remaining sum runs over the EDP group only. Both are
therefore "pre-divide by W, then SUM-all-reduce" -- over the world for dense, over EDP for experts.
(Averaging expert gradients over EDP, or reducing them over the world, is wrong: the tests check it.)

Gradients are packed into flat buckets of about `bucket_size_mb`; a bucket's all-reduce starts
asynchronously as soon as backward has produced all its gradients (post-accumulate-grad hooks), and
buckets are launched strictly in a fixed order on every rank so that collectives always match.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mula.moe import is_expert_param
from strategies.topology import ExpertParallelTopology


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    group: Any
    scale: float
    buffer: Tensor
    views: list[Tensor]
    ready: int = 0
    handle: Any = None
    seen: set[int] = field(default_factory=set)


class GradientSynchronizer:
    """Averages gradients as described in the module docstring, bucketed and overlapped with backward.

    named_params: the model's trainable (name, parameter) pairs on this rank (experts already sliced).
    Call `finish()` after each backward that must synchronise (it waits for all buckets and writes
    the reduced gradients back to `param.grad`); set `enabled = False` during gradient-accumulation
    micro-batches so that their backward passes do not communicate.
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        topology: ExpertParallelTopology,
        bucket_size_mb: float = 25.0,
        overlap: bool = True,
    ) -> None:
        self.topology = topology
        self.overlap = overlap
        self.enabled = True
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, int] = {}
        self._next_launch = 0
        self._hooks: list[Any] = []
        params = [(n, p) for n, p in named_params if p.requires_grad]
        if topology.world_size == 1:
            return
        # Backward produces gradients roughly in reverse registration order: bucket in that order so
        # that early buckets fill (and start communicating) first.
        scale = 1.0 / topology.world_size
        dense = [p for n, p in reversed(params) if not is_expert_param(n)]
        experts = [p for n, p in reversed(params) if is_expert_param(n)]
        self._add_buckets(dense, topology.world_group, scale, bucket_size_mb)
        # With EDP = 1 every expert lives on one rank: no reduction, but the 1/W scaling still applies.
        self._add_buckets(experts, topology.edp_group if topology.edp_size > 1 else None, scale, bucket_size_mb)
        # Interleave dense and expert buckets by the position of their first parameter in backward
        # order, then fix that order: every rank launches bucket i only after buckets < i.
        position = {id(p): i for i, (_, p) in enumerate(reversed(params))}
        self.buckets.sort(key=lambda b: position[id(b.params[0])])
        for index, bucket in enumerate(self.buckets):
            for p in bucket.params:
                self._bucket_of[id(p)] = index
                if overlap:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _add_buckets(self, params: list[nn.Parameter], group: Any, scale: float, bucket_size_mb: float) -> None:
        limit = max(1, int(bucket_size_mb * 2**20))
        current: list[nn.Parameter] = []
        for p in params:
            same_kind = not current or (current[0].dtype == p.dtype and current[0].device == p.device)
            size = sum(q.numel() * q.element_size() for q in current)
            if current and (not same_kind or size + p.numel() * p.element_size() > limit):
                self.buckets.append(self._make_bucket(current, group, scale))
                current = []
            current.append(p)
        if current:
            self.buckets.append(self._make_bucket(current, group, scale))

    @staticmethod
    def _make_bucket(params: list[nn.Parameter], group: Any, scale: float) -> _Bucket:
        total = sum(p.numel() for p in params)
        buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        views, offset = [], 0
        for p in params:
            views.append(buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return _Bucket(params=params, group=group, scale=scale, buffer=buffer, views=views)

    @property
    def num_buckets(self) -> int:
        """Number of flat buckets (dense and expert) this rank reduces per step."""
        return len(self.buckets)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.enabled:
            return
        bucket = self.buckets[self._bucket_of[id(param)]]
        if id(param) in bucket.seen:  # a second backward in the same step: finish() will re-read
            return
        bucket.seen.add(id(param))
        bucket.ready += 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.ready < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        for p, view in zip(bucket.params, bucket.views):
            if p.grad is None:  # unused this step: contributes zeros (every rank must still reduce)
                view.zero_()
            else:
                torch.mul(p.grad, bucket.scale, out=view)
        if bucket.group is not None:
            bucket.handle = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=bucket.group, async_op=True)

    def finish(self) -> None:
        """Start the buckets backward did not complete, wait for all, and point grads at the results."""
        if not self.buckets:
            return
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            for p, view in zip(bucket.params, bucket.views):
                # The reduced gradient lives in the bucket; the next step's zero_grad drops the alias.
                p.grad = view
            bucket.handle, bucket.ready = None, 0
            bucket.seen.clear()
        self._next_launch = 0

    def remove_hooks(self) -> None:
        """Detach the backward hooks (when the strategy tears down)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def clip_grad_norm_(
    named_params: Iterable[tuple[str, nn.Parameter]],
    max_norm: float,
    topology: ExpertParallelTopology,
    norm_type: float = 2.0,
) -> Tensor:
    """Clip synchronised gradients by the global norm over all dense and all expert parameters.

    Dense gradients are identical on every rank and each expert's gradient is identical across its
    EDP group, so the global squared norm is dense^2 (counted once) + the sum over the EP group of the
    local experts' squared norms: each element is counted exactly once. Returns the total norm.
    """
    if norm_type != 2.0:
        raise ValueError(f"Only the 2-norm is supported for gradient clipping, got norm_type={norm_type}.")
    dense, experts = [], []
    for name, p in named_params:
        if p.grad is not None:
            (experts if is_expert_param(name) else dense).append(p.grad)
    device = (dense + experts)[0].device if dense or experts else torch.device("cpu")
    dense_sq = _sum_sq(dense, device)
    expert_sq = _sum_sq(experts, device)
    if topology.ep_size > 1:
        dist.all_reduce(expert_sq, op=dist.ReduceOp.SUM, group=topology.ep_group)
    total = (dense_sq + expert_sq).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in dense + experts:
        g.mul_(coef.to(g.dtype))
    return total


def _sum_sq(grads: list[Tensor], device: torch.device) -> Tensor:
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        total += g.detach().float().pow(2).sum()
    return total
