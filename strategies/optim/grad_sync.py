"""Gradient synchronisation for expert parallelism when the optimizer is not sharded.

The arithmetic (pre-divide by W, SUM-reduce dense gradients over the world and expert gradients over
EDP) and the bucketing live in ``strategies.optim.grad_reduce``; here whole buckets are all-reduced and the
parameters' ``.grad`` point at the results, plus the matching global-norm clipping.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mula.model.moe import is_expert_param
from strategies.optim.grad_reduce import GradReducer, is_tp_split, laid_out_grad, local_tensor, param_entry
from strategies.optim.norms import square_sum
from strategies.topology import LayoutMesh, reduce_over_stages


class GradientSynchronizer:
    """Averages gradients as ``strategies.optim.grad_reduce`` describes, bucketed and overlapped with backward.

    named_params: the model's trainable (name, parameter) pairs on this rank (experts already sliced).
    Call `finish()` after each backward that must synchronise (it waits for all buckets and writes
    the reduced gradients back to `param.grad`); set `enabled = False` during gradient-accumulation
    micro-batches so that their backward passes do not communicate.
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        topology: LayoutMesh,
        bucket_size_mb: float = 25.0,
        overlap: bool = True,
    ) -> None:
        self.topology = topology
        self.overlap = overlap
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self._reducer: GradReducer | None = None
        self._enabled = True
        self._params = [p for _, p in named]
        if topology.size("replica") == 1 or not named:
            return
        entries = [param_entry(i, n, p, 0, topology) for i, (n, p) in enumerate(named)]
        largest = max(p.element_size() for _, p in named)
        self._reducer = GradReducer(
            [p for _, p in named],
            entries,
            topology,
            sharded=False,
            bucket_numel=max(1, int(bucket_size_mb * 2**20) // largest),
            overlap=overlap,
            device=named[0][1].device,
        )

    @property
    def enabled(self) -> bool:
        """False during gradient-accumulation micro-batches: backward then communicates nothing."""
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = value
        if self._reducer is not None:
            self._reducer.sync = value

    @property
    def num_buckets(self) -> int:
        """Number of flat buckets (dense and expert) this rank reduces per step."""
        return len(self._reducer.buckets) if self._reducer is not None else 0

    def finish(self) -> None:
        """Start the buckets backward did not complete, wait for all, and point grads at the results."""
        if self._reducer is not None:
            self._reducer.reduce()
            self._reducer.point_grads()
            return
        for p in self._params:  # one data-parallel rank: only tensor-parallel gradients to complete
            if p.grad is not None:
                p.grad = laid_out_grad(p, p.grad)

    def remove_hooks(self) -> None:
        """Detach the backward hooks (when the strategy tears down)."""
        if self._reducer is not None:
            self._reducer.remove_hooks()


def grad_norm(
    named_params: Iterable[tuple[str, nn.Parameter]], topology: LayoutMesh
) -> tuple[Tensor, Tensor]:
    """(global 2-norm, all gradients finite) of synchronised gradients over all dense and all expert
    parameters, the same on every rank.

    Dense gradients are identical on every rank and each expert's gradient is identical across its
    EDP group, so the global squared norm is dense^2 (counted once) + the sum over the EP group of the
    local experts' squared norms: each element is counted exactly once. Likewise a tensor-parallel
    parameter split over the TP group (a DTensor with a Shard placement) adds its local shards' squares
    summed over that group, while one replicated over it (a norm weight) counts once. A non-finite
    element makes its square non-finite, and the sums carry it to every rank: the verdict costs no
    extra collective.
    """
    dense, experts, split = [], [], []
    for name, p in named_params:
        if p.grad is not None:
            if is_expert_param(name):
                experts.append(p.grad)
            elif is_tp_split(p):
                split.append(local_tensor(p.grad))
            else:
                dense.append(local_tensor(p.grad))
    every = dense + experts + split
    device = every[0].device if every else torch.device("cpu")
    dense_sq = _sum_sq(dense, device)
    expert_sq = _sum_sq(experts, device)
    if topology.size("ep") > 1:
        dist.all_reduce(expert_sq, op=dist.ReduceOp.SUM, group=topology.group("ep"))
    if topology.size("tp") > 1:
        split_sq = _sum_sq(split, device)
        dist.all_reduce(split_sq, op=dist.ReduceOp.SUM, group=topology.group("tp"))
        dense_sq = dense_sq + split_sq
    total = reduce_over_stages(dense_sq + expert_sq, topology).sqrt()
    return total, torch.isfinite(total)


def scale_grads_(named_params: Iterable[tuple[str, nn.Parameter]], max_norm: float, norm: Tensor) -> None:
    """Scale every gradient by min(1, max_norm / norm): clipping by a global norm from `grad_norm`."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    grads = [local_tensor(p.grad) for _, p in named_params if p.grad is not None]
    for g in grads:
        g.mul_(coef.to(g.dtype))


def clip_grad_norm_(
    named_params: Iterable[tuple[str, nn.Parameter]],
    max_norm: float,
    topology: LayoutMesh,
    norm_type: float = 2.0,
) -> Tensor:
    """Clip synchronised gradients by the global norm over all dense and all expert parameters
    (`grad_norm`, each element counted once); returns the total norm."""
    if norm_type != 2.0:
        raise ValueError(f"Only the 2-norm is supported for gradient clipping, got norm_type={norm_type}.")
    named = list(named_params)
    total, _ = grad_norm(named, topology)
    scale_grads_(named, max_norm, total)
    return total


def _sum_sq(grads: list[Tensor], device: torch.device) -> Tensor:
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        total += square_sum(g)  # no temporary the size of the gradient (strategies/optim/norms.py)
    return total
