"""Expert-parallel and optimizer metrics, logged once per optimizer step.

* `moe/a2a_bytes`: bytes this rank sent to other ranks in all-to-all exchanges during the step
  (token rows and counts, forward and backward, all micro-batches). 0 without expert parallelism.
  A MoE layer recomputed by activation checkpointing sends its forward rows again in backward:
  that traffic is real and counted.
* `moe/load_imbalance_global`: max over mean tokens per expert of the step's tokens on *all* ranks
  (summed over ranks and micro-batches), averaged over MoE layers. The LightningModule's own
  `moe/load_imbalance` is the same ratio for this rank's micro-batch. Layers are counted by their
  global index (`layers.<i>`), so pipeline stages, each holding some layers, add up correctly.
* the optimizer's own `metrics()` (the EP-aware sharded optimizer reports `optim/state_bytes`,
  `optim/step_ms`, `optim/grad_norm`, ...); for another optimizer `optim/state_bytes` counts this
  rank's parameters plus their optimizer state.

`XPUMoEStrategy` adds this callback itself unless the Trainer already has one.
"""

from __future__ import annotations

import re
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist

from mula.moe import iter_moe_layers


class MoEMetrics(L.Callback):
    """Logs moe/a2a_bytes, moe/load_imbalance_global and optimizer metrics every optimizer step.

    Args:
        load_imbalance: also all-reduce the per-step expert counts (one tiny all-reduce per step)
            to log the global load imbalance.
    """

    def __init__(self, load_imbalance: bool = True) -> None:
        self.load_imbalance = load_imbalance
        self._counts: torch.Tensor | None = None
        self._hooks: list[Any] = []
        self._layers: list[torch.nn.Module] = []
        self._rows: list[int] = []
        self._num_rows = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Attach forward hooks that collect each MoE layer's tokens per expert."""
        named = list(iter_moe_layers(pl_module))
        self._layers = [layer for _, layer in named]
        self._rows = _global_rows([name for name, _ in named])
        # the same number of rows on every rank (they are all-reduced): the whole model's layers
        num_layers = getattr(getattr(pl_module, "config", None), "num_layers", None)
        self._num_rows = max([*self._rows, (num_layers or 0) - 1], default=-1) + 1
        if self.load_imbalance:
            for row, layer in zip(self._rows, self._layers):
                self._hooks.append(layer.register_forward_hook(self._make_hook(row)))

    def _make_hook(self, index: int):
        def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            counts = getattr(output[1], "tokens_per_expert", None) if isinstance(output, tuple) else None
            if counts is None or not torch.is_grad_enabled():  # training steps only
                return
            if torch._C._current_graph_task_id() != -1:
                # a forward run inside backward is activation checkpointing's recompute: counted already
                return
            if self._counts is None:
                self._counts = torch.zeros(
                    self._num_rows, counts.numel(), dtype=torch.long, device=counts.device
                )
            self._counts[index] += counts.detach()

        return hook

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        """The step's forward and backward passes are done: log and reset the MoE counters."""
        if not self._layers:
            return
        sent = 0
        for layer in self._layers:
            sent += int(getattr(layer.dispatcher, "bytes_sent", 0))
            if hasattr(layer.dispatcher, "bytes_sent"):
                layer.dispatcher.bytes_sent = 0
        pl_module.log("moe/a2a_bytes", float(sent), on_step=True, on_epoch=False, sync_dist=False)
        if self._counts is not None:
            counts = self._counts.clone()
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(counts)
            ratio = counts.float().max(dim=1).values / counts.float().mean(dim=1).clamp_min(1e-9)
            pl_module.log("moe/load_imbalance_global", ratio.mean(), on_step=True, on_epoch=False)
            self._counts.zero_()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        """After an optimizer step: log the optimizer's metrics (step time, state bytes, ...)."""
        if not trainer.optimizers or trainer.global_step == 0:
            return
        optimizer = trainer.optimizers[0]
        if hasattr(optimizer, "metrics"):
            values = optimizer.metrics()
        else:
            values = {"optim/state_bytes": float(_state_bytes(optimizer))}
        for key, value in values.items():
            pl_module.log(key, float(value), on_step=True, on_epoch=False, sync_dist=False)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Remove the forward hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def _global_rows(names: list[str]) -> list[int]:
    """Each MoE layer's global block index (`...layers.<i>...`), or its position when names have none."""
    found = [re.search(r"(?:^|\.)layers\.(\d+)\.", name) for name in names]
    if all(found):
        return [int(m.group(1)) for m in found]  # type: ignore[union-attr]
    return list(range(len(names)))


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters plus optimizer state tensors held by this rank (unsharded optimizers)."""
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            total += p.numel() * p.element_size()
            for value in optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    total += value.numel() * value.element_size()
    return total
