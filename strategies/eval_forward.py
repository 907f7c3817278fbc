"""Downstream evaluation of a model laid out by `XPUMoEStrategy`: one forward across its ranks.

`SpreadForward` is the strategy's implementation of `mula.downstream.lm.SpreadModel`, what
`MulaLM` needs to score documents with a model whose experts (E), pipeline stages (P), tensor
shards (T) or sequence slices (C) live on other ranks, without gathering it anywhere:

* documents are split over the data-parallel ranks (`data_parallel_rank`/`_size`/`_group`: the
  ranks reading different data, layout dimension "dp"); the P x T x C ranks sharing a data-parallel
  index receive the same documents and so run the same batches;
* `logits` runs the model as training does: the plain forward (experts exchange tokens all-to-all,
  tensor-parallel logits gathered over the vocabulary) or forward-only through the pipeline stages
  (`PipelineRunner.logits`, the validation path); the logits exist on the last stage only. Under
  context parallelism each rank of a "cp" group forwards its slice of the batch (the model's
  `SequenceShard`, as a training step takes it; the batch right-padded to a length C x T-with-SP
  divides) and the slices' logits are gathered over the group in sequence order;
* `share` sends the last stage's per-request scores to the other stages of its pipeline group;
* `any_active` is the lock step: one MAX all-reduce over all ranks before each forward, so a rank
  whose share of the documents is done keeps forwarding dummy batches while others still score.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from strategies.pipeline.schedule import PipelineRunner
from strategies.topology import LayoutMesh


class SpreadForward:
    """Forward passes of one evaluation across the ranks of a strategy's layout (`mula.downstream.lm.SpreadModel`).

    Args:
        model: this rank's part of the model (the whole `Mula` when P = 1, its stages' modules otherwise).
        topology: the strategy's topology (its data-parallel world, pipeline group).
        pipeline: the strategy's `PipelineRunner` when P > 1, else None.
        device: this rank's device.
        sequence_split: ranks a CP rank's slice of the sequence is split over (T with sequence
            parallelism, else 1). Batches are padded on the right to a multiple of it times C (token 0,
            a valid id), which a causal model never attends to from the real positions; the padded
            positions' logits are dropped.
    """

    def __init__(
        self,
        model: nn.Module,
        topology: LayoutMesh,
        pipeline: PipelineRunner | None,
        device: Any,
        sequence_split: int = 1,
    ) -> None:
        self.model, self.topology, self.pipeline = model, topology, pipeline
        self.sequence_split = sequence_split
        self.device = torch.device(device)
        # context parallelism: this rank's slice of every sequence (`Mula.sequence_shard`, set by
        # `apply_context_parallel`), the logits gathered over its "cp" group
        self.context_parallel = topology.size("cp")
        self.shard = model.sequence_shard if self.context_parallel > 1 else None
        self.data_parallel_rank = topology.rank("dp")
        self.data_parallel_size = topology.size("dp")
        self.data_parallel_group = _data_parallel_group(topology) if topology.size("dp") > 1 else None
        distributed = dist.is_available() and dist.is_initialized()
        self._world = dist.get_world_size() if distributed else 1
        # the global rank of the last stage in this rank's pipeline group: where the logits are
        self._last_stage = (
            dist.get_global_rank(topology.group("pp"), topology.size("pp") - 1)
            if pipeline is not None
            else None
        )

    def any_active(self, active: bool) -> bool:
        """Whether any rank of the job has a batch to forward now (a MAX all-reduce over all ranks)."""
        if self._world == 1:
            return active
        flag = torch.tensor([int(active)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def logits(self, tokens: Tensor) -> Tensor | None:
        """The model's forward of `tokens` [B, T], run by the ranks holding its parts together: the
        logits [B, T, V] where the LM head is (whole, also under tensor parallelism), else None."""
        width = tokens.shape[1]
        pad = -width % (self.sequence_split * self.context_parallel)
        if pad:
            tokens = torch.nn.functional.pad(tokens, (0, pad))
        if self.shard is not None:  # this CP rank's contiguous slice, as a training step takes it
            tokens = self.shard.take(tokens)
        if self.pipeline is not None:  # with TP too: the last stage's TP ranks hold vocabulary-split logits
            logits = self.pipeline.logits(tokens)
            if logits is None:
                return None
        else:
            logits = self.model(tokens).logits
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits  # split over the vocabulary
        if self.shard is not None:  # the C slices, in sequence order (group rank c holds slice c)
            parts = [torch.empty_like(logits) for _ in range(self.context_parallel)]
            dist.all_gather(parts, logits.contiguous(), group=self.topology.group("cp"))
            logits = torch.cat(parts, dim=1)
        return logits[:, :width]

    def close(self) -> None:
        """The evaluation is over: release the pipeline's forward-only schedules of its batch shapes."""
        if self.pipeline is not None:
            self.pipeline.release_eval_schedules()

    def share(self, scores: Tensor) -> Tensor:
        """The last pipeline stage's `scores` on every stage of its pipeline group (as is without stages)."""
        if self._last_stage is None:
            return scores
        scores = scores.contiguous()
        dist.broadcast(scores, src=self._last_stage, group=self.topology.group("pp"))
        return scores


def _data_parallel_group(topology: LayoutMesh) -> Any:
    """The process group of this rank's data-parallel ranks ("dp": the ranks of its stage, TP and CP
    index reading different data, ordered as `topology.rank("dp")` counts them). Without context
    parallelism that is the "replica" group; with it, the job mesh's ("edp", "ep") dimensions flattened
    (collective on first use; torch keeps the flattened mesh, so later evaluations reuse its group)."""
    if topology.size("cp") == 1:
        return topology.group("replica")
    from mula.torch_compat import flatten_mesh

    root = topology.mesh()
    if root is None:
        raise ValueError("Downstream evaluation with context_parallel_size > 1 needs the job's device mesh.")
    return flatten_mesh(root["edp", "ep"], "dp").get_group()


def spread_forward(
    model: Any, topology: Any, pipeline: Any, device: torch.device, split: int, sharded_optimizer: Any
) -> SpreadForward:
    """The `SpreadForward` of a set-up `XPUMoEStrategy` over its LightningModule's `model` (laid out over
    `topology`, its stages run by the `PipelineRunner` `pipeline` or None, on `device`, sequences split
    `split` ways), once the parameters are in place (the `sharded_optimizer`'s overlapped all-gathers,
    if any, may still be in flight)."""
    if sharded_optimizer is not None:
        sharded_optimizer.wait_for_params()
    return SpreadForward(model, topology, pipeline, device, split)
