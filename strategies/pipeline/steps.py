"""The Lightning side of pipeline stages in `XPUMoEStrategy` (its `PipelineSteps` member, kept apart
from the EP code).

With P > 1 each optimizer step is one `PipelineRunner.step` inside `training_step`: the data module
hands over the step's whole per-rank batch (`consumes_whole_step`; Lightning accumulates nothing),
the schedule runs every forward and backward with gradient communication held back but for each
stage's last backward of the step, where its buckets start reducing (`last_backward_sync`: overlapped
with the rest of the schedule, the offloaded optimizer's host update with it), and the strategy's
`backward` only runs the hooks around backward; `optimizer_step` then reduces, checks,
clips, updates and zeroes as for any step. Gradients are zero when the schedule starts (the previous
step ended by zeroing them; Lightning's own zeroing between `training_step` and `backward` is not
done, see `XPUMoEStrategy.zeroes_grads_after_step`). The returned loss is the step's global mean on
every rank, so loggers and the anomaly guard see the same value everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from mula.data.datamodule import MulaDataModule
from mula.layout.rules import micro_batches_per_step
from mula.model.transformer import Mula
from mula.training.module import mula_module
from strategies.pipeline.schedule import PipelineRunner
from strategies.pipeline.split import split_model


def stage_model(module: Any) -> Any:
    """The model of `module` that pipeline stages split: a MulaLightningModule's `Mula`."""
    mula = mula_module(module)
    if mula is None or not isinstance(mula.model, Mula):
        raise ValueError("pipeline_parallel_size > 1 needs a MulaLightningModule (a model with `layers`).")
    return mula.model


def microbatches_per_step(batch: Tensor, pipeline_microbatches: int | None, trainer: Any) -> int:
    """The pipeline's micro-batches in this step: the batch's rows over the data module's
    `micro_batch_size` (or `pipeline_microbatches`, set by whoever feeds other data)."""
    if pipeline_microbatches is not None:
        return pipeline_microbatches
    datamodule = trainer.datamodule
    if not isinstance(datamodule, MulaDataModule):
        raise ValueError(
            "pipeline_parallel_size > 1 needs the micro-batch size: train with a MulaDataModule, or set "
            "the strategy's pipeline_microbatches to the micro-batches per step."
        )
    return micro_batches_per_step(batch.shape[0], 1, datamodule.micro_batch_size)


class PipelineSteps:
    """The training, evaluation and backward work of a strategy with pipeline stages (P > 1; a member
    of XPUMoEStrategy, built in its `setup`).

    Input, stated at construction: `runner`, the `PipelineRunner` over this rank's stages (`split`
    builds both: it keeps this rank's stages of the model and makes their runner). Each call takes the
    LightningModule and the precision plugin it runs under, and what else it needs of the strategy.
    `training_step` runs one schedule step over the step's whole batch and returns the step's global
    mean loss; `evaluate` runs a batch forward-only through the stages; `backward` only runs the
    precision plugin's hooks around the backward the schedule already ran.
    """

    def __init__(self, runner: PipelineRunner) -> None:
        self.runner = runner

    @classmethod
    def split(
        cls,
        module: Any,
        topology: Any,
        device: torch.device,
        sequence_parallel: bool,
        last_backward_sync: Callable[[], AbstractContextManager[None]],
    ) -> PipelineSteps:
        """Keep this rank's pipeline stages of `module`'s model (`topology`'s holdings; the model checked
        by `stage_model` first) and build their runner on `device`; `last_backward_sync` lets each stage's
        last backward of a step start its gradients' reduction."""
        model = stage_model(module)
        split_model(model, topology.holdings(model.config))
        runner = PipelineRunner(
            module, topology, device, sequence_parallel, last_backward_sync=last_backward_sync
        )
        return cls(runner)

    def training_step(
        self,
        batch: Tensor,
        module: Any,
        precision: Any,
        block_backward_sync: Callable[[], AbstractContextManager[None]],
        microbatches: Callable[[Tensor], int],
        sum_over_ranks: Callable[[Tensor], Tensor],
    ) -> Tensor:
        """One schedule step over the whole step's `batch` (`microbatches(batch)` micro-batches) with
        gradient communication held back (`block_backward_sync`), returning the step's global mean loss
        on every rank (`sum_over_ranks`: what the loggers and the anomaly guard see)."""
        # gradients are zero: the previous optimizer_step ended by zeroing them
        with precision.train_step_context(), block_backward_sync():
            sums, count = self.runner.step(batch, microbatches(batch))
        module.set_batch_shape(batch.shape[0], batch.shape[1] - 1)  # the step's tokens, for throughput
        module.record_step_losses(sums, count)
        module.log_learning_rate()
        total = sum_over_ranks(torch.cat([sums[:1], sums.new_tensor([count])]))
        return total[0] / total[1]

    def evaluate(self, batch: Tensor, module: Any, precision: Any) -> None:
        """The batch's cross-entropy through the stages, counted on the last (validation and test)."""
        with precision.val_step_context():
            ce, tokens, targets = self.runner.evaluate(batch)
        # other stages add weight 0: torchmetrics' sync over all ranks then averages the last stage's
        module.record_evaluation(ce, tokens, targets)

    def backward(self, closure_loss: Tensor, module: Any, precision: Any) -> Tensor:
        """The pipeline step already ran backward: run the hooks around it (the strategy's
        `optimizer_step` reduces the gradients)."""
        closure_loss = precision.pre_backward(closure_loss, module)
        return precision.post_backward(closure_loss, module)
