"""Expert load you can see: per-layer metrics, `moe_load.csv` and a heatmap, from the step's global counts.

The counts are `MulaLightningModule.step_expert_counts`: tokens per expert of each MoE layer over the
optimizer step's micro-batches on all ranks, all-reduced once per step by the module (it needs them
for the router bias anyway), so this callback adds no collective. Layers are named by block index
(an MoE model's dense first blocks, `num_dense_layers`, have no counts). Every `log_every_n_steps` steps:

* `moe/layer_{i}/load_imbalance`: max / mean tokens per expert of layer i in the step;
* `moe/layer_{i}/dead_experts`: experts of layer i that received no token in any step of the logging
  window (the steps since the previous logged step);
* with an expert capacity (`capacity_factor`), rank 0 appends to `moe_dropped.csv` (step, layer,
  dropped_fraction) the fraction of each MoE layer's choices dropped since the previous logged step, over
  all ranks (`callbacks.moe_metrics.DroppedWindow`; `MoEMetrics` logs the same as metrics);
* rank 0 appends the step's counts to `moe_load.csv` (step, layer, expert, tokens) next to
  `metrics.csv`, and every `plot_every_n_steps` steps and at the end of training redraws
  `moe_load.png` there (`mula.commands.report.plot_expert_load`) and logs it to W&B as an image.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.loggers import WandbLogger
from typing_extensions import override

from callbacks.moe_metrics import DroppedWindow, fraction, moe_blocks
from mula.commands.report import DROPPED_COLUMNS, DROPPED_FILE, LOAD_COLUMNS, LOAD_FILE, plot_expert_load
from mula.training.lightning_compat import ends_optimizer_step, logs_train_step
from mula.training.module import mula_module

HEATMAP_FILE = "moe_load.png"


class ExpertLoad(L.Callback):
    """Per-layer load metrics, per-expert token counts on disk, and a load heatmap.

    Args:
        plot_every_n_steps: Redraw the heatmap (and log it to W&B) every this many optimizer steps,
            at a logged step; it is always drawn at the end of training. 0: only at the end.
    """

    def __init__(self, plot_every_n_steps: int = 1000) -> None:
        if plot_every_n_steps < 0:
            raise ValueError(f"plot_every_n_steps must be >= 0, got {plot_every_n_steps}.")
        self.plot_every_n_steps = plot_every_n_steps
        self._window: torch.Tensor | None = None  # [layers, E] counts since the last logged step
        self._dir: Path | None = None
        self._last_plotted = -1
        self._dropped = DroppedWindow()

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Resolve the directory of metrics.csv (`trainer.log_dir` is a collective: every rank asks)."""
        if stage == "fit":
            log_dir = trainer.log_dir
            self._dir = Path(log_dir if log_dir is not None else trainer.default_root_dir)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        """After an optimizer step: add its counts to the window; on logged steps, log and write them."""
        module = mula_module(pl_module)
        counts = None if module is None else module.step_expert_counts
        if module is None or counts is None or not ends_optimizer_step(trainer):
            return  # a dense model, or mid-accumulation (the step's counts are not complete yet)
        self._window = counts if self._window is None else self._window + counts
        if not logs_train_step(trainer):
            return
        window, self._window = self._window, None
        step_counts = counts.float()
        imbalance = step_counts.max(dim=1).values / step_counts.mean(dim=1).clamp_min(1e-9)
        dead = (window == 0).sum(dim=1)
        # row r is the r-th MoE block, block first + r
        first = module.config.num_dense_layers
        for r in range(counts.shape[0]):
            i = first + r
            pl_module.log(f"moe/layer_{i}/load_imbalance", imbalance[r], on_step=True, on_epoch=False)
            pl_module.log(f"moe/layer_{i}/dead_experts", dead[r].float(), on_step=True, on_epoch=False)
        dropped = self._dropped.take(module)  # a collective: every rank, at every logged step
        if trainer.is_global_zero and self._dir is not None:
            # the step index metrics.csv gives this step's row (Lightning logs optimizer step n as n - 1)
            self._append(trainer.global_step - 1, counts.cpu(), first)
            if dropped is not None:
                self._append_dropped(trainer.global_step - 1, fraction(dropped).cpu(), moe_blocks(module))
            every = self.plot_every_n_steps
            if every and trainer.global_step - max(self._last_plotted, 0) >= every:
                self._plot(trainer)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Draw the final heatmap."""
        if trainer.is_global_zero and self._dir is not None and self._last_plotted != trainer.global_step:
            self._plot(trainer)

    def _append(self, step: int, counts: torch.Tensor, first: int) -> None:
        rows = (
            (step, layer, expert, tokens)
            for layer, row in enumerate(counts.tolist(), start=first)
            for expert, tokens in enumerate(row)
        )
        _append_csv(self._dir / LOAD_FILE, LOAD_COLUMNS, rows)

    def _append_dropped(self, step: int, fractions: torch.Tensor, blocks: range) -> None:
        rows = ((step, layer, value) for layer, value in zip(blocks, fractions.tolist()))
        _append_csv(self._dir / DROPPED_FILE, DROPPED_COLUMNS, rows)

    def _plot(self, trainer: L.Trainer) -> None:
        load_csv = self._dir / LOAD_FILE
        if not load_csv.is_file():
            return
        png = plot_expert_load(load_csv, self._dir / HEATMAP_FILE)
        self._last_plotted = trainer.global_step
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(key="moe/expert_load", images=[str(png)], step=trainer.global_step)


def _append_csv(path: Path, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """Append `rows` to the CSV file `path`, writing the header `columns` first when the file is new or
    empty."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(columns)
        writer.writerows(rows)
