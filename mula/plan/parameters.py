"""The model's parameters as the optimizer sees them: names, shapes and param groups, in its order.

Built from the real module on the meta device (nothing is allocated), through
`MulaLightningModule.param_groups`, so the planner sees exactly the order in which `EPShardedAdamW`
registers parameters, and therefore lays out exactly the same flat buckets.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

import torch

from mula.config import MulaConfig
from mula.moe import is_expert_param


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
    from mula.module import MulaLightningModule  # Lightning import: only when a plan is made

    config = MulaConfig(**dict(config_items))
    with torch.device("meta"):
        module = MulaLightningModule(config, no_decay=list(no_decay))
        module.configure_model()
    names = {id(p): n for n, p in module.named_parameters()}
    out = []
    for gi, group in enumerate(module.param_groups()):
        for p in group["params"]:
            name = names[id(p)]
            match = _LAYER.search("." + name)
            out.append(ParamSpec(name, tuple(p.shape), gi, int(match.group(1)) if match else None))
    return tuple(out)
