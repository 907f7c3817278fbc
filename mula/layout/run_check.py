"""One validation of a training run: what its strategy, `mula fit`, `mula plan` and the layout registry ask.

A run is refused for its layout (`ParallelLayout.validate`: sizes, schedule, stage split, experts,
heads, batch split, ZeRO stage, micro-batches) and for what the layout meets elsewhere: sequence
parallelism without T, a sequence C ranks cannot split, half-precision weights without fp32 masters,
Muon where it cannot run. `check_run` applies every rule of `mula.layout.rules` in the order a run meets
them, so `XPUMoEStrategy.setup`, `mula fit`'s checks before training, `mula plan`
(`mula.plan.layout.check_runnable`) and the registry of layout features (`mula.layout.features.refusal`)
accept and refuse the same runs with the same sentence. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mula.layout.parallel_layout import ParallelLayout
from mula.layout.rules import (
    check_master_weights,
    check_optimizer,
    check_sequence_parallel,
    check_sequence_split,
)


@dataclass(frozen=True)
class RunSettings:
    """What the rules judge of a run: its `layout` (W may be None), the model `config` (a `MulaConfig`, or
    None for the layout alone), tokens per sequence `seq_len`, the step's `global_batch` and
    `micro_batch` (sequences) and `micro_batches` per data-parallel rank, the trainer's `precision`,
    whether the optimizer keeps `fp32_masters` (the sharded optimizer; `strategy`: the strategy's class
    name, for the sentence), the sharded optimizer's `zero_stage` (None: not sharded) and `offload`,
    `model.optimizer` and `sequence_parallel`. None: not known (not checked)."""

    layout: ParallelLayout
    config: Any = None
    seq_len: int | None = None
    global_batch: int | None = None
    micro_batch: int | None = None
    micro_batches: int | None = None
    precision: str = "32-true"
    fp32_masters: bool = False
    strategy: str = "XPUMoEStrategy"
    zero_stage: int | None = None
    offload: bool = False
    optimizer: str = "adamw"
    sequence_parallel: bool = False


def check_run(run: RunSettings) -> None:
    """Raise the one ValueError sentence of the first rule `run` breaks (module docstring)."""
    tp = run.layout.tp
    check_sequence_parallel(run.sequence_parallel, tp)
    if run.seq_len is not None:
        check_sequence_split(run.seq_len, run.layout.cp)
    check_master_weights(run.precision, run.fp32_masters, run.strategy)
    check_optimizer(run.optimizer, tp, run.offload)
    run.layout.validate(
        run.config, zero_stage=run.zero_stage, global_batch=run.global_batch, micro_batch=run.micro_batch,
        micro_batches=run.micro_batches,
    )  # fmt: skip
