"""The memory and step-time planner behind `mula plan` and the start-of-run memory check of `mula fit`.

`plan_memory(config, layout)` predicts per-rank bytes (`mula.plan.memory`); `Layout` describes the
run (`mula.plan.layout`); `layout_from_settings` builds it from a parsed recipe (`mula.plan.settings`).
"""

from mula.plan.layout import Layout
from mula.plan.memory import COMPONENTS, MemoryPlan, plan_memory

__all__ = ["COMPONENTS", "Layout", "MemoryPlan", "plan_memory"]
