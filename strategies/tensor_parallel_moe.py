"""MoE layers under tensor parallelism: tokens split over the TP group, experts whole (docs/tensor-parallel.md).

Each TP rank routes and dispatches 1/T of a micro-batch's tokens (a contiguous 1/T of the sequence)
through the same experts as its TP peers: the expert-parallel all-to-all runs inside the EP group of
its TP index (the job mesh's "ep" dimension is taken at a fixed "tp" coordinate), so an MoE layer
communicates over TP only to split and gather its tokens, and no expert weight is split.

    input   without sequence parallelism the layer's input is replicated over TP: `PrepareModuleInput`
            (Replicate -> Shard(1)) keeps this rank's slice of the sequence (backward: the slices'
            gradients all-gathered, so every TP rank holds the whole, replicated gradient);
            `PrepareModuleOutput` (Shard(1) -> Replicate) all-gathers the output (backward: the slice).
            Under sequence parallelism the residual stream is split already: the layer takes its local
            Shard(1) tensor and returns its local output (no gather).
    losses  `TensorParallelTokens` (a `mula.model.moe.balancing.TokenSplit`): the aux loss's frequencies and
            mean probabilities and the z loss's mean over the whole micro-batch, summed over the TP group
            with a Partial -> Replicate DTensor redistribution (forward all-reduce, identity backward:
            each TP rank's loss already holds the whole sum). The step's expert counts (router-bias
            update, expert-load metrics) and the global aux-loss scope sum each rank's own counts over
            every rank, so they are exact without a TP term.
    grads   the router's and the (routed and shared) experts' gradients on a TP rank come from its
            tokens only: the layer's parameters are marked (`mark_tp_partial`) and the gradient-reduce engine sums them over the
            TP group before they enter a bucket (`strategies.optim.grad_reduce.laid_out_grad`), then
            averages them over data parallelism as any replicated weight (experts over their EDP group).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

from mula.model.moe import MoELayer
from mula.model.moe.balancing import TokenSplit
from strategies.optim.grad_reduce import mark_tp_partial


class TensorParallelTokens(TokenSplit):
    """A micro-batch's tokens split evenly over the 1-D `tp_mesh` (see the module docstring)."""

    def __init__(self, tp_mesh: Any) -> None:
        self.mesh = tp_mesh
        self.parts = tp_mesh.size()

    def __repr__(self) -> str:
        return f"TensorParallelTokens(parts={self.parts})"

    def total(self, t: Tensor) -> Tensor:
        """t summed over the TP group: Partial -> Replicate, whose backward keeps the gradient as it is."""
        return DTensor.from_local(t, self.mesh, [Partial()], run_check=False).full_tensor()


@torch.no_grad()
def split_moe_tokens(layer: MoELayer, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Make MoE `layer` route this TP rank's 1/T of the sequence (in place; see the module docstring)."""
    if sequence_parallel:  # the residual stream is already this rank's slice
        take = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        parallelize_module(layer, tp_mesh, take)
    else:
        take = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        # (y, stats): y gathered along the sequence, the (already whole) stats as they are
        give = PrepareModuleOutput(
            output_layouts=(Shard(1), None), desired_output_layouts=(Replicate(), None)
        )
        parallelize_module(layer, tp_mesh, take)
        parallelize_module(layer, tp_mesh, give)
    layer.token_split = TensorParallelTokens(tp_mesh)
    group = tp_mesh.get_group()
    first = dist.get_global_rank(group, 0)
    for tensor in [*layer.parameters(), *layer.buffers()]:
        # the same weights on every TP rank, as DTensor's distribution takes them from the first
        dist.broadcast(tensor.data, src=first, group=group)
    for p in layer.parameters():
        mark_tp_partial(p, tp_mesh)
