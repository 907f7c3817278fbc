"""What `mula calibrate` asks of the strategy whose splits and optimizer it times, and how it finds it.

Two of the job's measurements run the strategy's own code on each rank: the small model split by its
tensor-, context- and expert-parallel functions, and its sharded AdamW reducing over a group. That code
lives beside the strategy (`strategies/calibrate/`), which imports what it uses directly. `mula` never
imports a strategy module: `mula calibrate --strategy` names the strategy class as a recipe's
`trainer.strategy` does (a class path, default the recipes' `strategies.XPUMoEStrategy`), and the class's
`calibration()` returns a `StrategyCalibration`.
"""

from __future__ import annotations

import pydoc
from typing import Any, Protocol, runtime_checkable

import torch

from mula.model.config import MulaConfig


class StrategyCalibration(Protocol):
    """The strategy's timings on one rank of a `mula calibrate` job; every rank of `group` calls each
    (this rank its `group_rank`-th of `group_size`). Picklable: it travels to the job's spawned ranks."""

    def split_training_seconds(
        self, config: MulaConfig, kind: str, micro_batch: int, seq_len: int, dtype: torch.dtype,
        device: torch.device, group: Any, group_rank: int, group_size: int, reps: int,
    ) -> dict[str, float]:  # fmt: skip
        """{"whole": s, "split": s, "num_layers", "micro_batch", "seq_len"}: one micro-batch's forward +
        backward of the small model whole and split `kind` (a `mula.plan.split_compute.SPLIT_KINDS`
        kind) over `group`, timed in turns (`mula.plan.split_compute` reads it)."""
        ...

    def reduction_seconds(
        self, config: MulaConfig, micro_batch: int, seq_len: int, dtype: torch.dtype, device: torch.device,
        group: Any, group_rank: int, group_size: int, reps: int,
    ) -> dict[int, dict[str, float]]:  # fmt: skip
        """{ZeRO stage: {"plain": s, "reduced": s, "bucket_bytes", "micro_batches", ...}}: the small
        model's step without an optimizer and with the sharded AdamW reducing over `group`, timed in
        turns (`mula.plan.grad_reduction` reads it)."""
        ...


@runtime_checkable
class CalibratedStrategy(Protocol):
    """A strategy class `mula calibrate` can time (`strategies.XPUMoEStrategy` is one)."""

    @staticmethod
    def calibration() -> StrategyCalibration:
        """The timings of the strategy's own code on each rank of a `mula calibrate` job."""
        ...


def strategy_calibration(class_path: str) -> StrategyCalibration:
    """The timings of the strategy class `class_path` names (resolved as `mula fit` resolves a recipe's
    dotted `trainer.strategy`); one sentence when it names none, or a class `mula calibrate` cannot time."""
    cls = pydoc.locate(class_path)
    if not isinstance(cls, type):
        raise ValueError(
            f"--strategy {class_path!r} names no class; give a strategy's class path, as a recipe's "
            "trainer.strategy names it."
        )
    if not issubclass(cls, CalibratedStrategy):
        raise ValueError(
            f"--strategy {class_path}: {cls.__name__} has no calibration() giving what `mula calibrate` times "
            "of a strategy's splits and sharded optimizer (strategies.XPUMoEStrategy has)."
        )
    return cls.calibration()
