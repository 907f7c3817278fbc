"""`mula calibrate`'s timings of the strategy's own code on each rank of its job: the small model split
by the tensor-, context- and expert-parallel functions (`splits`), and the sharded AdamW reducing its
gradients over a group (`reduction`). They live beside the code they time and import it directly;
`mula calibrate` reaches them through the strategy class it is named, as a recipe names its
`trainer.strategy` (`XPUMoEStrategy.calibration()`, `mula.calibrate.strategy`).
"""

from strategies.calibrate.reduction import reduction_seconds
from strategies.calibrate.splits import split_training_seconds


class Calibration:
    """What `mula calibrate` times of the strategy on each rank (a
    `mula.calibrate.strategy.StrategyCalibration`). It holds no state, so it pickles by name to the
    job's spawned ranks."""

    split_training_seconds = staticmethod(split_training_seconds)
    reduction_seconds = staticmethod(reduction_seconds)
