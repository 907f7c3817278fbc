"""What code outside the model may rely on about MoE layers: which parameters are experts, where the layers are.

The strategy (expert slicing, gradient domains, sharded checkpoints), the sharded optimizer (which
state goes to the expert-data-parallel group) and the callbacks (expert load) all need these two
answers; they import them from here instead of each testing attribute or name patterns of their own.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from mula.model.moe.layer import MoELayer
from mula.model.param_names import EXPERTS_MODULE, is_expert_param

__all__ = ["EXPERTS_MODULE", "is_expert_param", "iter_moe_layers", "num_global_experts"]


def iter_moe_layers(model: nn.Module) -> Iterator[tuple[str, MoELayer]]:
    """(qualified name, layer) of every MoE layer in ``model``, in module order."""
    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            yield name, module


def num_global_experts(model: nn.Module) -> int | None:
    """Experts per MoE layer in the full model (None for a dense model)."""
    counts = {int(layer.router.num_experts) for _, layer in iter_moe_layers(model)}
    if len(counts) > 1:
        raise ValueError(f"MoE layers disagree on the number of experts: {sorted(counts)}.")
    return counts.pop() if counts else None
