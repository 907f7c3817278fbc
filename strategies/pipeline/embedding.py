"""The embedding's two copies under multi-token prediction across pipeline stages, kept in step.

The first stage embeds the input ids; the last stage's MTP modules embed the ids k ahead
(strategies/pipeline/split.py), with a copy of the same embedding (same name `embed.weight`, same initial
values). As Megatron does for its shared embedding, after the gradients are reduced over each stage's
replicas the two copies' gradients are summed over the embedding group -- the first and the last stage's
rank of each pipeline group, `ParallelLayout.embedding_ranks` -- so both hold the gradient one process
computes (the sum of what its two uses contribute) and take the identical update (they start equal: the
last stage's copy is the first stage's, broadcast at setup). The gradient norm counts
the embedding once: the last stage leaves its copy out (`counted`). Checkpoints hold it once too (one
key, saved by both stages with the same value; a resume loads it into both).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from strategies.optim.grad_reduce import local_tensor
from strategies.topology import LayoutMesh


class EmbeddingCopies:
    """This rank's part in keeping the embedding's copies in step (built by every rank, collectively).

    `embed`: the rank's embedding module, None where it holds none; `topology`: the layout (P > 1).
    `sum_grads()` (after the gradients are reduced, before the norm) sums the copies' gradients over the
    embedding group; `counted(param)` says whether a parameter's gradient counts in the global norm.
    """

    def __init__(self, embed: nn.Module | None, topology: LayoutMesh) -> None:
        layout = topology.layout
        self.embed = embed
        self.group: Any = None
        self.first = layout.coordinates(topology.rank("world")).pp == 0
        # every rank creates every pair's group, in the same order (torch's new_group is collective)
        for ranks in [layout.embedding_ranks(g[0]) for g in layout.all_groups("pp")]:
            group = topology.group("pp") if len(ranks) == layout.pp else dist.new_group(ranks)
            if topology.rank("world") in ranks:
                self.group = group
        if embed is not None and self.group is not None:
            # the copies start equal: a model built on the meta device initialises each stage's modules
            # on their own (Megatron, too, makes the copies equal at the start)
            src = topology.group_ranks("pp")[0]
            dist.broadcast(local_tensor(embed.weight.data), src=src, group=self.group)

    def sum_grads(self) -> None:
        """Sum the copies' (reduced) gradients over the embedding group, in place: both then hold the same
        bits (a sum of two is the same in either order)."""
        if self.embed is None or self.group is None:
            return
        grad = self.embed.weight.grad
        assert grad is not None, "the embedding took no gradient on a stage that holds it"
        dist.all_reduce(local_tensor(grad), op=dist.ReduceOp.SUM, group=self.group)

    def counted(self, param: Any) -> bool:
        """Whether `param`'s gradient counts in the global gradient norm: all but the last stage's copy of
        the embedding (the first stage's counts it)."""
        return self.first or self.embed is None or param is not self.embed.weight
