"""The expert capacity rule's arithmetic, torch-free: what the MoE layer, its dispatchers and the planner
(`mula.plan`) agree on. The rule itself, and the routing plan that applies it, are
`mula.model.kernels.capacity`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mula.model.config_checks import DROP_POLICIES


@dataclass(frozen=True)
class Capacity:
    """How many choices an expert keeps (`factor`, the capacity factor) and which (`policy`, one of
    DROP_POLICIES): see `mula.model.kernels.capacity`."""

    factor: float
    policy: str = "probs"

    def __post_init__(self) -> None:
        if not self.factor > 0.0 or self.policy not in DROP_POLICIES:
            raise ValueError(
                f"A capacity needs a positive factor and a drop policy in {DROP_POLICIES}, got "
                f"{self.factor!r} and {self.policy!r}."
            )

    def slots(self, num_tokens: int, top_k: int, num_experts: int) -> int:
        """C = ceil(N * K / E * factor), the rows each expert takes for N = `num_tokens` tokens (never more
        than N: a token chooses an expert once)."""
        return min(math.ceil(num_tokens * top_k / num_experts * self.factor), num_tokens)


def capacity_of(config: Any) -> Capacity | None:
    """The capacity a `MulaConfig` asks for (`capacity_factor`, `drop_policy`), or None (dropless)."""
    if config.capacity_factor is None or not config.is_moe:
        return None
    return Capacity(config.capacity_factor, config.drop_policy)
