"""The model's parameters as the optimizer sees them: names, shapes and param groups, in its order.

Read from `MulaConfig.parameter_shapes` (the module's `named_parameters()` order, checked against the
real module in tests/test_config.py) and split into param groups by the same `no_decay` rule as
`MulaLightningModule.param_groups`, so the planner sees exactly the order in which `EPShardedAdamW`
registers parameters, and therefore lays out exactly the same flat buckets. Nothing is built or
allocated, and torch is not imported: `mula plan` stays fast for the 220B model.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

from mula.config import MulaConfig
from mula.param_names import is_expert_param, is_no_decay

# the LightningModule holds the Mula model as `.model`: the optimizer's names carry this prefix
_MODULE_PREFIX = "model."


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the full (unsliced) model: optimizer name, shape, param group, layer."""

    name: str
    shape: tuple[int, ...]
    group: int
    layer: int | None  # the block index, None for the embedding, final norm and LM head

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @functools.cached_property
    def is_expert(self) -> bool:
        """Stacked expert weights [num_experts, ...]: sliced over the EP group, sharded over EDP."""
        return is_expert_param(self.name)


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def model_parameters(config: MulaConfig, no_decay: tuple[str, ...] = ("embed.weight",)) -> list[ParamSpec]:
    """Every trainable parameter of `config`'s model in the sharded optimizer's registration order."""
    return list(_cached(tuple(sorted(dataclasses.asdict(config).items())), tuple(no_decay)))


@functools.lru_cache(maxsize=16)
def _cached(config_items: tuple, no_decay: tuple[str, ...]) -> tuple[ParamSpec, ...]:
    shapes = MulaConfig(**dict(config_items)).parameter_shapes()
    # param_groups: decayed parameters (group 0), then those matching no_decay (group 1, when named)
    groups = [[(n, s) for n, s in shapes if not is_no_decay(n, no_decay)]]
    if no_decay:
        groups.append([(n, s) for n, s in shapes if is_no_decay(n, no_decay)])
    out = []
    for gi, group in enumerate(groups):
        for name, shape in group:
            match = _LAYER.search("." + name)
            out.append(ParamSpec(_MODULE_PREFIX + name, shape, gi, int(match.group(1)) if match else None))
    return tuple(out)
