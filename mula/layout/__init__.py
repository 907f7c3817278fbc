"""The parallel layout, torch-free and shared by the planner and the strategy: `ParallelLayout`
(`parallel_layout.py`: every dimension's size, rank <-> coordinates, groups, what a rank holds), the
rules a layout must satisfy (`rules.py`), the sharded optimizer's options (`sharding_options.py`) and
its flat-buffer bookkeeping (`flat_buffers.py`).
"""

from mula.layout.parallel_layout import ParallelLayout

__all__ = ["ParallelLayout"]
