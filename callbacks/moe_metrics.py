"""Expert-parallel and optimizer metrics, logged once per optimizer step.

* `moe/a2a_bytes`: bytes this rank sent to other ranks in all-to-all exchanges during the step
  (token rows and counts, forward and backward, all micro-batches). 0 without expert parallelism.
  A MoE layer recomputed by activation checkpointing sends its forward rows again in backward:
  that traffic is real and counted.
* `moe/load_imbalance_global`: max over mean tokens per expert of the step's tokens on *all* ranks
  (summed over ranks and micro-batches), averaged over MoE layers. The LightningModule's own
  `moe/load_imbalance` is the same ratio for this rank's micro-batch; `ExpertLoad` logs it per layer.
  The counts are the module's `step_expert_counts`, rows by global layer index, so pipeline stages,
  each holding some layers, add up correctly.
* `moe/dropped_fraction` and `moe/layer_{i}/dropped_fraction` (models with a `capacity_factor`), on
  logging steps: the fraction of the routed choices the expert capacity dropped since the previous
  logged step, over all ranks and micro-batches (all layers together, and block i's MoE layer), from
  the layers' running tallies (`mula.model.moe.dropping`: summed on the device, one all-reduce when logged).
* the optimizer's own `metrics()` (the EP-aware sharded optimizer reports `optim/state_bytes`,
  `optim/step_ms`, `optim/grad_norm`, ...); for another optimizer `optim/state_bytes` counts this
  rank's parameters plus their optimizer state.

`XPUMoEStrategy` adds this callback itself unless the Trainer already has one.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
from torch.distributed.tensor import DTensor
from typing_extensions import override

from mula.model.moe import MeteredDispatcher, iter_moe_layers
from mula.model.moe.balancing import all_reduce_sum
from mula.training.lightning_compat import ends_optimizer_step, logs_train_step
from mula.training.module import MulaLightningModule, mula_module
from mula.training.strategy_contract import ShardedOptimizer


class MoEMetrics(L.Callback):
    """Logs moe/a2a_bytes, moe/load_imbalance_global and optimizer metrics every optimizer step.

    Args:
        load_imbalance: also log the global load imbalance, from the step's counts on all ranks that
            `MulaLightningModule` all-reduces once per step (`step_expert_counts`; no collective here).
    """

    def __init__(self, load_imbalance: bool = True) -> None:
        self.load_imbalance = load_imbalance
        self._layers: list[torch.nn.Module] = []
        self._dropped = DroppedWindow()

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Find the MoE layers (their dispatchers count the all-to-all bytes)."""
        self._layers = [layer for _, layer in iter_moe_layers(pl_module)]

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        """The step's forward and backward passes are done: log and reset the MoE counters."""
        if not self._layers:
            return
        sent = 0
        for layer in self._layers:
            if isinstance(layer.dispatcher, MeteredDispatcher):
                sent += int(layer.dispatcher.bytes_sent)
                layer.dispatcher.bytes_sent = 0
        pl_module.log("moe/a2a_bytes", float(sent), on_step=True, on_epoch=False, sync_dist=False)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        """After an optimizer step: log the global load imbalance and the optimizer's metrics."""
        module = mula_module(pl_module)
        counts = None if module is None else module.step_expert_counts
        if self.load_imbalance and counts is not None and ends_optimizer_step(trainer):
            ratio = counts.float().max(dim=1).values / counts.float().mean(dim=1).clamp_min(1e-9)
            pl_module.log("moe/load_imbalance_global", ratio.mean(), on_step=True, on_epoch=False)
        if module is not None and ends_optimizer_step(trainer) and logs_train_step(trainer):
            window = self._dropped.take(module)
            if window is not None:
                pl_module.log(
                    "moe/dropped_fraction", fraction(window.sum(dim=0)), on_step=True, on_epoch=False
                )
                for i, dropped in zip(moe_blocks(module), fraction(window)):
                    pl_module.log(f"moe/layer_{i}/dropped_fraction", dropped, on_step=True, on_epoch=False)
        if not trainer.optimizers or trainer.global_step == 0:
            return
        optimizer = trainer.optimizers[0]
        if isinstance(optimizer, ShardedOptimizer):
            values = optimizer.metrics()
        else:
            values = {"optim/state_bytes": float(_state_bytes(optimizer))}
        for key, value in values.items():
            pl_module.log(key, float(value), on_step=True, on_epoch=False, sync_dist=False)


def dropped_totals(module: MulaLightningModule) -> torch.Tensor | None:
    """[MoE layers, 2] fp32 (dropped, choices) of every rank since each layer was built, rows by MoE
    layer (`MulaConfig.moe_layer_row`: a pipeline stage fills its blocks' rows, the all-reduce the rest);
    None without a capacity. A collective: every rank calls it at the same step."""
    config = module.config
    if not config.is_moe or config.capacity_factor is None:
        return None
    totals = torch.zeros(config.num_moe_layers, 2, device=module.device)
    for name, layer in iter_moe_layers(module.model):  # names "layers.<block>.mlp"
        totals[config.moe_layer_row(int(name.split(".")[1]))] = layer.drops.totals(module.device)
    return all_reduce_sum(totals)


def fraction(tally: torch.Tensor) -> torch.Tensor:
    """dropped / choices of a [..., 2] (dropped, choices) tally (0 where nothing was routed)."""
    return tally[..., 0] / tally[..., 1].clamp_min(1.0)


def moe_blocks(module: MulaLightningModule) -> range:
    """The block index of each MoE layer row (an MoE model's dense first blocks have none)."""
    return range(
        module.config.num_dense_layers, module.config.num_dense_layers + module.config.num_moe_layers
    )


class DroppedWindow:
    """What the MoE layers' capacities dropped since the previous `take` (`dropped_totals` differences)."""

    def __init__(self) -> None:
        self._seen: torch.Tensor | None = None

    def take(self, module: MulaLightningModule) -> torch.Tensor | None:
        """[MoE layers, 2] (dropped, choices) since the previous call (one all-reduce), or None."""
        totals = dropped_totals(module)
        if totals is None:
            return None
        window = totals if self._seen is None else totals - self._seen
        self._seen = totals
        return window


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters plus optimizer state tensors held by this rank (unsharded optimizers); a
    tensor-parallel DTensor counts its local shard, not the global tensor."""
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            total += _local_bytes(p)
            for value in optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    total += _local_bytes(value)
    return total


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()
