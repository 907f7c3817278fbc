"""The activation-checkpointing levels a recipe may name (`model.activation_checkpointing`).

Torch-free, so that `mula plan` reads a level without importing the model; `mula.model.transformer` recomputes
the parts named here.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["CHECKPOINT_PARTS", "parse_activation_checkpointing"]

# Parts of a block that `activation_checkpointing` may recompute selectively ("full": the whole block).
CHECKPOINT_PARTS = ("moe", "attention", "norms")


def parse_activation_checkpointing(value: str | Sequence[str] | None) -> frozenset[str]:
    """The set of checkpointed parts for `value`: "none"/None (empty), "full", or a list of `CHECKPOINT_PARTS`."""
    if value is None or value == "none":
        return frozenset()
    if value == "full":
        return frozenset({"full"})
    parts = [value] if isinstance(value, str) else list(value)
    unknown = [p for p in parts if p not in CHECKPOINT_PARTS]
    if unknown or not parts:
        raise ValueError(
            f"activation_checkpointing must be 'none', 'full' or a list of {list(CHECKPOINT_PARTS)}, "
            f"got {value!r}."
        )
    return frozenset(parts)
