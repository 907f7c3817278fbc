"""The steps of `XPUMoEStrategy.setup` that lay the LightningModule's model out on this rank.

Each is applied from outside the model, in the order `setup` calls them: a meta-built model
materialised on the device with its own init, the tensor-parallel and context-parallel splits, and the
replicas made identical (as DDP does). Pipeline stages and expert slicing come before them
(`strategies/pipeline/steps.py`, `strategies/experts/expert_parallel.py`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mula.model.moe import is_expert_param
from mula.model.transformer import Mula
from mula.training.module import mula_module
from strategies.context_parallel import apply_context_parallel
from strategies.optim.grad_reduce import local_tensor
from strategies.tensor_parallel import apply_tensor_parallel
from strategies.topology import LayoutMesh


def materialize(module: nn.Module, device: torch.device) -> None:
    """Meta-built model: allocate on the device and initialise with the model's own init."""
    for child in module.children():
        if not any(p.is_meta for p in child.parameters()):
            continue
        if not hasattr(child, "reset_parameters"):
            raise ValueError(
                f"{type(child).__name__} was built on the meta device but has no reset_parameters()."
            )
        child.to_empty(device=device)
        child.reset_parameters()


def _mula_model(module: nn.Module) -> Mula | None:
    """The `Mula` of a MulaLightningModule (built), else None."""
    mula = mula_module(module)
    return mula.model if mula is not None and isinstance(mula.model, Mula) else None


def split_tensors(module: nn.Module, topology: LayoutMesh, sequence_parallel: bool) -> None:
    """Split the model over this rank's TP group (once: Lightning calls setup again after fit)."""
    model = _mula_model(module)
    if model is None:
        raise ValueError("tensor_parallel_size > 1 needs a MulaLightningModule (a `Mula` model).")
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        apply_tensor_parallel(model, topology.mesh("tp"), sequence_parallel)


def split_sequences(module: nn.Module, topology: LayoutMesh) -> None:
    """Make the model hold this rank's slice of every sequence (Ulysses attention over its CP group)."""
    model = _mula_model(module)
    if model is None:
        raise ValueError("context_parallel_size > 1 needs a MulaLightningModule (a `Mula` model).")
    topo = topology
    apply_context_parallel(model, topo.group("cp"), topo.rank("cp"), topo.size("cp"), topo.size("tp"))


@torch.no_grad()
def sync_replicas(module: nn.Module, topology: LayoutMesh) -> None:
    """Make replicas identical, as DDP does: dense from rank 0, experts from EDP rank 0."""
    topo = topology
    if topo.size("replica") == 1:
        return
    edp_src = topo.group_ranks("edp_cp")[0]
    for name, tensor in module.state_dict(keep_vars=True).items():
        if is_expert_param(name):
            if topo.size("edp_cp") > 1:
                dist.broadcast(tensor.data, src=edp_src, group=topo.group("edp_cp"))
        else:  # from the first data-parallel rank of this stage (rank 0 when P = T = 1)
            dist.broadcast(
                local_tensor(tensor.data), src=topo.group_ranks("replica")[0], group=topo.group("replica")
            )
