"""Driving `torch.distributed.pipelining` schedules over the stages of a split Mula model.

One `PipelineRunner.step` is one optimizer step's forward and backward: the rank's whole share of the
global batch goes in, torch's schedule cuts it into the step's micro-batches (the same micro-batches
gradient accumulation would run, in the same order) and runs them through the stages with GPipe,
1F1B or interleaved 1F1B. The last stage's loss per micro-batch is the module's loss divided by the
number of micro-batches (what Lightning's accumulation does), so gradients sum to the step's mean;
torch's own gradient scaling is therefore off (it would touch `.grad`, which the sharded optimizer
has already consumed).

Stage shapes are given statically (one micro-batch's meta tensors): torch then skips its metadata
warm-up, which would run a real forward and backward through the model and its gradient hooks.
Loss sums are fp32 with an explicit dtype (under bf16-true the default dtype is bf16, and every rank
must all-reduce the same dtype).
Validation batches and downstream evaluation's batches (one micro-batch each) run forward only
(`logits`), through a GPipe (one stage per rank) or looped-BFS (virtual stages) schedule of one
micro-batch over the same stage modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from mula.model.mtp import check_mtp_sequence, shifted_ids
from mula.model.transformer import router_losses
from mula.training.module import MulaLightningModule
from strategies.pipeline.split import MulaStage
from strategies.tensor_parallel import check_sequence_split
from strategies.topology import LayoutMesh

_EVAL_SCHEDULES_KEPT = 8  # forward-only schedules kept for reuse, by batch shape (most recent)

_SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
}


class _StepStage(PipelineStage):
    """A `PipelineStage` whose last backward of the step runs inside `last_backward_sync()`: the schedule
    knows which micro-batch's backward is a stage's last (`last_backward`, torch's hook for a data-parallel
    wrapper's gradient sync), so the stage's gradient buckets reduce while the other micro-batches and
    stages still run backward, and the offloaded optimizer's host updates start then too."""

    def __init__(self, *args: Any, last_backward_sync: Callable[[], Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._last_backward_sync = last_backward_sync

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("last_backward", False):
            return super().backward_one_chunk(*args, **kwargs)
        with self._last_backward_sync():
            return super().backward_one_chunk(*args, **kwargs)


class PipelineRunner:
    """This rank's pipeline stages of `module.model` (already split) and the schedule that runs them.

    Args:
        module: the `MulaLightningModule` (its `combine_losses` is the loss; its model is split by
            `split_model` into `topology.holdings(config)`).
        topology: the layout (`layout`: schedule, stages; `pp_group`).
        device: this rank's device.
        sequence_parallel: the stages' modules are (or will be) split over the TP group with sequence
            parallelism (`strategies.tensor_parallel.apply_tensor_parallel`): the hidden state sent
            between stages is then each rank's 1/T of the sequence.
        last_backward_sync: a context manager factory run around each stage's last backward of the step
            (the strategy's `last_backward_sync`: gradient reduction and the offloaded update start there);
            None: every backward only accumulates and the strategy reduces after the schedule.
    """

    def __init__(
        self,
        module: MulaLightningModule,
        topology: LayoutMesh,
        device: torch.device,
        sequence_parallel: bool = False,
        last_backward_sync: Callable[[], Any] | None = None,
    ) -> None:
        layout = topology.layout
        self.module, self.topology, self.layout, self.device = module, topology, layout, device
        self.schedule_name = layout.schedule
        self.sequence_parallel = sequence_parallel
        self.last_backward_sync = last_backward_sync
        self.num_stages = layout.num_stages
        model = module.model
        holdings = topology.holdings(model.config)
        self.stage_ids = list(holdings.stages)
        last = self.num_stages - 1
        self.stages = [
            MulaStage(model, holdings.main_blocks(i), s == 0, s == last)
            for i, s in enumerate(holdings.stages)
        ]
        self.mtp_depth = model.config.mtp_depth
        for stage in self.stages:  # expert counts by global block (router bias, ExpertLoad, MoEMetrics)
            stage.count_sink = module.add_expert_counts
            stage.seq_parts = topology.size("tp") if sequence_parallel else 1
        self.has_first = 0 in self.stage_ids
        self.has_last = last in self.stage_ids
        self._schedule: Any = None
        self._key: tuple[int, int, int] | None = None
        self._eval_schedules: dict[tuple[int, ...], Any] = {}
        self._n = 1
        self._sums: list[Tensor] = []
        self._eval_logits: list[Tensor] = []

    def step(self, batch: Tensor, n_microbatches: int) -> tuple[Tensor, int]:
        """Forward and backward of one optimizer step's batch [rows, T + 1] in `n_microbatches` (under
        context parallelism the stages run and send this CP rank's slice of every sequence).

        Returns this rank's summed [loss, ce, aux, z] over the micro-batches it computed the loss of,
        and their number (zeros and 0 on ranks without the last stage)."""
        rows = batch.shape[0]
        if rows % n_microbatches:
            raise ValueError(
                f"The step's batch of {rows} sequences per data-parallel rank does not split into "
                f"{n_microbatches} pipeline micro-batches."
            )
        # on every rank before any stage runs (the last stage's loss would stop alone, the others waiting)
        check_mtp_sequence(self.mtp_depth, batch.shape[1] - 1)
        inputs, targets = self._slice(batch)
        seq_len = inputs.shape[1]
        self._check_sequence(seq_len)
        self._ensure_schedule(n_microbatches, rows // n_microbatches, seq_len)
        self._n, self._sums = n_microbatches, []
        args = (inputs,) if self.has_first else ()
        # with multi-token prediction the loss function needs every id of the micro-batch (the ids k
        # ahead of the MTP modules): it gets the batch's rows and takes the targets from them
        target = (batch.contiguous() if self.mtp_depth else targets) if self.has_last else None
        self._schedule.step(*args, target=target, return_outputs=False)
        sums = (
            torch.stack(self._sums).sum(0)
            if self._sums
            else torch.zeros(5 if self.mtp_depth else 4, dtype=torch.float32, device=self.device)
        )
        count = len(self._sums)
        self._sums = []
        return sums, count

    def evaluate(self, batch: Tensor) -> tuple[Tensor, int, Tensor | None]:
        """Forward-only cross-entropy of a batch [rows, T + 1] as one micro-batch: (ce, target tokens, the
        targets ce is the mean over) on ranks with the last stage, (0, 0, None) elsewhere. Under context
        parallelism the cross-entropy is this CP rank's slice's, counted with the whole sequence's tokens
        (every CP rank the same weight, so the weighted mean over ranks is the sequence's)."""
        inputs, targets = self._slice(batch)
        logits = self.logits(inputs)
        if logits is None:
            return torch.zeros((), dtype=torch.float32, device=self.device), 0, None
        zero = torch.zeros((), dtype=torch.float32, device=logits.device)
        ce = self.module.combine_losses(logits, targets, zero, zero)[1]
        return ce.detach(), batch.shape[0] * (batch.shape[1] - 1), targets

    def logits(self, tokens: Tensor) -> Tensor | None:
        """Forward only, through every stage, of token ids [rows, T] as one micro-batch: the logits
        [rows, T, V] on the rank holding the last stage, None elsewhere. Every rank of the pipeline group
        calls it with the same shape (the stages' static shapes); the last few shapes' schedules are kept."""
        key = tuple(tokens.shape)
        self._check_sequence(key[1])
        schedule = self._eval_schedules.pop(key, None)
        if schedule is None:
            cls = ScheduleGPipe if len(self.stages) == 1 else ScheduleLoopedBFS
            stages = self._build_stages(*key)
            schedule = cls(stages[0] if len(stages) == 1 else stages, 1, loss_fn=self._keep_logits)
            while len(self._eval_schedules) >= _EVAL_SCHEDULES_KEPT:  # evaluation sees many shapes
                self._eval_schedules.pop(next(iter(self._eval_schedules)))
        self._eval_schedules[key] = schedule  # most recent last
        self._eval_logits = []
        args = (tokens,) if self.has_first else ()
        # the target only makes torch call the loss function on the last stage, which keeps the logits
        schedule.eval(*args, target=tokens if self.has_last else None)
        return self._eval_logits.pop() if self._eval_logits else None

    def release_eval_schedules(self) -> None:
        """Drop the forward-only schedules (and their stages' receive buffers), e.g. after an evaluation
        of many batch shapes during training."""
        self._eval_schedules.clear()

    def _slice(self, batch: Tensor) -> tuple[Tensor, Tensor]:
        """(inputs, targets) of a batch [rows, T + 1]: this CP rank's slice of each (the whole sequence
        without context parallelism); a sequence C does not divide is refused on every rank before any
        stage runs."""
        shard = self.module.model.sequence_shard
        # contiguous: torch's stages check the input strides against the example's (torch 2.11 does,
        # and a slice of [rows, T + 1] has a row stride of T + 1)
        return shard.take(batch[:, :-1]).contiguous(), shard.take(batch[:, 1:]).contiguous()

    def _check_sequence(self, seq_len: int) -> None:
        """On every rank before any stage runs (a stage's own check would leave the others waiting for
        its activations): tensor parallelism's sequence split must be even."""
        check_sequence_split(self.module.config, seq_len, self.topology.size("tp"), self.sequence_parallel)

    def _keep_logits(self, output: Any, target: Tensor) -> Tensor:
        logits = output[0] if isinstance(output, tuple) else output
        self._eval_logits.append(logits.detach())
        return torch.zeros((), dtype=torch.float32, device=logits.device)

    def _loss(self, output: Any, target: Tensor) -> Tensor:
        """The module's loss of one micro-batch on the last stage, scaled for the step's mean: as
        `MulaLightningModule._losses` computes it in one process, the MTP modules' (`mtp_depth`) included.

        With MTP, `target` is the micro-batch's token ids [B, T + 1] (whole sequences): the targets, the
        ids k ahead and the MTP targets are this CP rank's slices of them, and the MTP blocks' router
        sums join the main blocks' before the router losses are taken."""
        config = self.module.config
        outputs = list(output) if isinstance(output, tuple) else [output]
        logits = outputs.pop(0)
        router = outputs.pop(0) if config.is_moe else None
        mtp_logits: list[Tensor] = []
        batch = target
        if self.mtp_depth:
            shard = self.module.model.sequence_shard
            target = shard.take(batch[:, 1:])
            ids = [shard.take(shifted_ids(batch, k)) for k in range(1, self.mtp_depth + 1)]
            mtp = self.stages[-1].run_mtp(outputs.pop(0), router, ids)
            router, mtp_logits = mtp.router_sums, mtp.logits
        if router is not None:
            aux, z = router_losses(config, router)
        else:
            aux = z = torch.zeros((), dtype=torch.float32, device=logits.device)
        loss, ce = self.module.combine_losses(logits, target, aux, z)
        terms = [loss, ce, aux, z]
        if mtp_logits:
            mtp_loss = self.module.mtp_loss(mtp_logits, batch)
            loss = loss + config.mtp_loss_weight * mtp_loss
            terms = [loss, ce, aux, z, mtp_loss]
        self._sums.append(torch.stack(terms).detach().float())
        return loss / self._n

    def _ensure_schedule(self, n_microbatches: int, micro_batch: int, seq_len: int) -> None:
        key = (n_microbatches, micro_batch, seq_len)
        if self._schedule is not None and self._key == key:
            return
        self.layout.check_micro_batches(n_microbatches)
        stages = self._build_stages(micro_batch, seq_len)
        cls = _SCHEDULE_CLASSES[self.schedule_name]
        target = stages if self.schedule_name == "interleaved-1f1b" else stages[0]
        self._schedule = cls(target, n_microbatches, loss_fn=self._loss, scale_grads=False)
        self._key = key

    def _build_stages(self, micro_batch: int, seq_len: int) -> list[PipelineStage]:
        """torch's stages over this rank's stage modules, with static shapes for one micro-batch."""
        dtype = next(p.dtype for s in self.stages for p in s.parameters() if p.is_floating_point())
        stages = []
        for stage_id, mod in zip(self.stage_ids, self.stages):
            mod.sequence_shard = (
                self.module.model.sequence_shard
            )  # set by context parallelism after the split
            inputs, outputs = mod.example_io(micro_batch, seq_len, dtype, dtype)
            args = (mod, stage_id, self.num_stages, self.device)
            kwargs = {"input_args": inputs, "output_args": outputs, "group": self.topology.group("pp")}
            if self.last_backward_sync is None:
                stages.append(PipelineStage(*args, **kwargs))
            else:
                stages.append(_StepStage(*args, last_backward_sync=self.last_backward_sync, **kwargs))
        return stages
