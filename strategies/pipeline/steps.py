"""The Lightning side of pipeline stages in `XPUMoEStrategy` (a mixin, kept apart from the EP code).

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

from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from mula.layout.rules import micro_batches_per_step
from strategies.pipeline.schedule import PipelineRunner
from strategies.pipeline.split import split_model


class PipelineSteps:
    """Training, validation and backward hooks of a strategy with pipeline stages (no-ops at P = 1).

    Expects the host strategy to set `layout` (its `ParallelLayout`), `topology` (that layout's mesh),
    `pipeline_microbatches`, `sequence_parallel`, `_pipeline` (None) and to provide
    `block_backward_sync` and `last_backward_sync`.
    """

    _pipeline: PipelineRunner | None

    @property
    def consumes_whole_step(self) -> bool:
        """With pipeline stages a training batch is the whole step's per-rank batch (read by the data module)."""
        return self.layout.pp > 1

    def _split_into_stages(self, module: Any) -> None:
        """Keep this rank's pipeline stages of the model (validated first) and build their runner."""
        topo = self.topology
        assert topo is not None
        model = getattr(module, "model", None)
        if model is None or not hasattr(model, "layers"):
            raise ValueError(
                "pipeline_parallel_size > 1 needs a MulaLightningModule (a model with `layers`)."
            )
        if self._pipeline is not None:
            return  # Lightning calls setup again for validate/test after fit
        split_model(model, topo.holdings(model.config))
        self._pipeline = PipelineRunner(
            module, topo, self.root_device, self.sequence_parallel, last_backward_sync=self.last_backward_sync
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """With pipeline stages: one schedule step over the whole step's batch, returning the step's
        global mean loss on every rank (what the loggers and the anomaly guard see)."""
        if self._pipeline is None:
            return super().training_step(*args, **kwargs)
        batch = args[0] if args else kwargs["batch"]
        module = self.lightning_module
        # gradients are zero: the previous optimizer_step ended by zeroing them
        with self.precision_plugin.train_step_context(), self.block_backward_sync():
            sums, count = self._pipeline.step(batch, self._microbatches_per_step(batch))
        module.set_batch_shape(batch.shape[0], batch.shape[1] - 1)  # the step's tokens, for throughput
        module.record_step_losses(sums, count)
        module.log("train/lr", self.optimizers[0].param_groups[0]["lr"])
        total = self.reduce(torch.cat([sums[:1], sums.new_tensor([count])]), reduce_op="sum")
        return total[0] / total[1]

    def _microbatches_per_step(self, batch: Tensor) -> int:
        """The pipeline's micro-batches in this step: the batch's rows over the data module's
        `micro_batch_size` (or `pipeline_microbatches`, set by whoever feeds other data)."""
        if self.pipeline_microbatches is not None:
            return self.pipeline_microbatches
        datamodule = getattr(self.lightning_module.trainer, "datamodule", None)
        micro = getattr(datamodule, "micro_batch_size", None)
        if micro is None:
            raise ValueError(
                "pipeline_parallel_size > 1 needs the micro-batch size: train with a MulaDataModule, or set "
                "the strategy's pipeline_microbatches to the micro-batches per step."
            )
        return micro_batches_per_step(batch.shape[0], 1, micro)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """With pipeline stages: the batch's cross-entropy through the stages, counted on the last."""
        if self._pipeline is None:
            return super().validation_step(*args, **kwargs)
        return self._pipelined_eval(args[0] if args else kwargs["batch"])

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """With pipeline stages: as `validation_step`."""
        if self._pipeline is None:
            return super().test_step(*args, **kwargs)
        return self._pipelined_eval(args[0] if args else kwargs["batch"])

    def _pipelined_eval(self, batch: Tensor) -> None:
        assert self._pipeline is not None
        with self.precision_plugin.val_step_context():
            ce, tokens = self._pipeline.evaluate(batch)
        # other stages add weight 0: torchmetrics' sync over all ranks then averages the last stage's
        self.lightning_module.val_loss.update(ce, weight=tokens)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The pipeline step already ran backward: run the hooks around it (the strategy's
        `optimizer_step` reduces the gradients)."""
        if self._pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        return self.precision_plugin.post_backward(closure_loss, module)
