"""What code outside the model may rely on about MoE layers: which parameters are experts, where the layers are.

The strategy (expert slicing, gradient domains, sharded checkpoints), the sharded optimizer (which
state goes to the expert-data-parallel group) and the callbacks (expert load) all need these two
answers; they import them from here instead of each testing attribute or name patterns of their own.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from mula.moe.layer import MoELayer

EXPERTS_MODULE = "experts"  # the attribute of `MoELayer` that holds the stacked expert weights


def is_expert_param(name: str) -> bool:
    """True for a parameter (or state-dict entry) that belongs to an MoE layer's stacked experts.

    Expert tensors are the ones below a module named ``experts`` (``layers.3.mlp.experts.gate_up``),
    whatever prefix a wrapper adds (``model.``, ``_orig_mod.``, an optimizer-state key). They are split
    over the expert-parallel group; every other parameter is replicated.
    """
    return EXPERTS_MODULE in name.split(".")[:-1]


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
