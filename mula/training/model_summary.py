"""The model summary `mula fit` prints when training starts: Lightning's, with the model's real FLOPs.

Lightning counts a summary's FLOPs by running the module's `example_input_array` through it under torch's
`FlopCounterMode`. `MulaLightningModule` has none (a forward of a model split over ranks, stages or
tensor shards is no one process's to run at start-up), so Lightning printed `Total FLOPs: 0`, and 0 for
the model's row: a wrong figure. `StepFlopsSummary` shows instead the training FLOPs of one optimizer
step (forward and backward of the global batch, `MulaConfig.flops_per_token`: the count MFU divides by),
in the model's row and in the total, and says so in one line under the table.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary import get_human_readable_count
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from mula.data import MulaDataModule
from mula.training.module import MulaLightningModule

MODEL_ROW = "model"  # the attribute MulaLightningModule holds its `Mula` in: the summary's row name


def step_flops(trainer: L.Trainer, pl_module: L.LightningModule) -> tuple[int, int] | None:
    """(training FLOPs of one optimizer step, its tokens) of a `MulaLightningModule` trained on a
    `MulaDataModule` (its global batch of `seq_len` tokens each); None otherwise."""
    data = trainer.datamodule
    if not isinstance(pl_module, MulaLightningModule) or not isinstance(data, MulaDataModule):
        return None
    return pl_module.flops(data.global_batch_size, data.seq_len), data.global_batch_size * data.seq_len


class StepFlopsSummary(ModelSummary):
    """Lightning's model summary (its rich table when rich is installed, as Lightning picks), whose FLOPs
    are the model's training FLOPs per optimizer step (module docstring); anything else as Lightning's.

    `mula fit` installs it unless the recipe turns the summary off (`trainer.enable_model_summary: false`)
    or names a model summary of its own among the callbacks.
    """

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        super().__init__(max_depth, **summarize_kwargs)
        self.flops: tuple[int, int] | None = None

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.flops = step_flops(trainer, pl_module)
        super().on_fit_start(trainer, pl_module)

    @override
    def summarize(  # type: ignore[override]  (Lightning's is a staticmethod; this one reads self.flops)
        self,
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int = 0,
        **summarize_kwargs: Any,
    ) -> None:
        columns = dict(summary_data)
        if self.flops is not None and "FLOPs" in columns:  # (Lightning 2.6 on; 2.5 shows no FLOPs)
            for i, name in enumerate(columns["Name"]):
                if name == MODEL_ROW:
                    columns["FLOPs"][i] = get_human_readable_count(self.flops[0])
                elif name.startswith(MODEL_ROW + "."):  # deeper rows (max_depth > 1): not counted per layer
                    columns["FLOPs"][i] = "n/a"
            total_flops = self.flops[0]
        render = RichModelSummary if importlib.util.find_spec("rich") is not None else ModelSummary
        args = (summary_data, total_parameters, trainable_parameters, model_size, total_training_modes)
        if "total_flops" in inspect.signature(render.summarize).parameters:
            render.summarize(*args, total_flops=total_flops, **summarize_kwargs)
        else:
            render.summarize(*args, **summarize_kwargs)
        if self.flops is not None:
            rank_zero_info(
                f"FLOPs per optimizer step: {get_human_readable_count(self.flops[0])} (forward and backward of "
                f"{self.flops[1]:,} tokens, MulaConfig.flops_per_token: what MFU divides by)"
            )
