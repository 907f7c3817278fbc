"""Apply expert parallelism to a plain (single-device) Mula model from the outside.

Every MoE layer (`mula.model.moe.iter_moe_layers`) gets its stacked expert
weights sliced to this rank's block of global experts and its dispatcher replaced by an
`AllToAllDispatcher` over the EP group. The model code itself never changes, and the kept slices are
exactly the single-process model's experts p*E_local ... (p+1)*E_local - 1 (build full, then slice).
"""

from __future__ import annotations

import torch
from torch import nn

from mula.model.moe import GroupedExperts, LocalDispatcher, iter_moe_layers, num_global_experts
from strategies.experts.all_to_all import AllToAllDispatcher
from strategies.topology import LayoutMesh


@torch.no_grad()
def apply_expert_parallel(model: nn.Module, topology: LayoutMesh) -> int | None:
    """Slice experts to this rank's global block and install all-to-all dispatchers. Returns E_total.

    Idempotent: a layer already holding E_total / ep_size experts with an `AllToAllDispatcher` is
    left alone (Lightning may call setup again for validate/test after fit).
    """
    total = num_global_experts(model)
    if total is None:
        return None
    local = topology.local_expert_range(total)  # refuses E that does not divide the experts
    for _, layer in iter_moe_layers(model):
        if isinstance(layer.dispatcher, AllToAllDispatcher):
            continue
        experts = layer.experts
        for pname, param in list(experts.named_parameters(recurse=False)):
            if param.shape[0] != total:
                raise ValueError(
                    f"Expert parameter {pname} has leading dimension {param.shape[0]}, expected {total} experts."
                )
            if topology.size("ep") > 1:
                # clone() so the full stack's storage is freed instead of kept alive by a view
                sliced = param.data[local.start : local.stop].clone()
                setattr(experts, pname, nn.Parameter(sliced, requires_grad=param.requires_grad))
        if isinstance(experts, GroupedExperts):
            experts.num_experts = len(local)
        if topology.size("ep") > 1:
            # the experts' kernels, as before
            backend = layer.dispatcher.backend if isinstance(layer.dispatcher, LocalDispatcher) else "auto"
            layer.dispatcher = AllToAllDispatcher(
                total, topology.size("ep"), topology.rank("ep"), topology.group("ep"), backend, layer.capacity
            )
    return total
