"""Distributed checkpoints of ``EPShardedAdamW``: its state as a dict ``torch.distributed.checkpoint`` saves.

Per parameter (global name) the fp32 master weights, exp_avg and exp_avg_sq are 1-D tensors over
the flattened *global* parameter (expert parameters in global expert order), each rank contributing
the piece its shards hold, so a checkpoint saved at one (W, E) layout loads at any other.

Each is a DTensor ``Shard(0)`` over the job mesh's flattened world dimension (``topology.world_mesh``). The pieces are irregular (bucket packing
and alignment decide where a parameter is cut, and a rank may hold none of it), which DTensor's even
chunks cannot express, so the local tensor is torch's ``LocalShardsWrapper`` (the local-shards
tensor DCP reads chunk offsets from, as torchrec uses it), holding views of the live buffers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from mula.flat_buffers import ParamEntry, Segment
from strategies.topology import gather_groups_over_stages, names_cover

if TYPE_CHECKING:
    from strategies.optim.sharded_optimizer import EPShardedAdamW

_KINDS = ("master", "exp_avg", "exp_avg_sq")


def sharded_state_dict(opt: EPShardedAdamW) -> dict[str, Any]:
    """``opt``'s state for DCP: per parameter a global DTensor per kind, the step count and the param
    groups. Local shards are views of the live buffers, so ``dcp.load`` into this dict loads in
    place; then call ``load_sharded_state_dict``."""
    if not opt.options.ep_aware and opt.topology.ep_size > 1:
        raise ValueError("Checkpointing the EP-unaware comparison layout is not supported.")
    opt.wait_for_params()
    mesh = opt.topology.world_mesh  # None without a process group
    state: dict[str, Any] = {}
    for entry in opt.entries:
        state[entry.name] = {kind: _global_tensor(opt, getattr(opt, kind), entry, mesh) for kind in _KINDS}
    # Param groups keyed by index (strings), not a list of dicts: if DCP ever falls back to its
    # pre-2.4 key format (it does when a saved key is missing here), the keys stay the same.
    mine = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "param_names": [opt.name_of(p) for p in g["params"]],
        }
        for g in opt.param_groups
    ]
    groups = {str(i): g for i, g in enumerate(gather_groups_over_stages(mine, opt.topology))}
    return {"state": state, "param_groups": groups, "step": opt.step_count.detach().clone()}


def load_sharded_state_dict(opt: EPShardedAdamW, state_dict: dict[str, Any]) -> None:
    """Copy what ``sharded_state_dict`` produced (after ``dcp.load`` filled it, possibly at another
    layout) into ``opt``: param-group hyperparameters, step count and the state shards."""
    groups = state_dict.get("param_groups")
    if isinstance(groups, dict):
        groups = [groups.get(str(i)) for i in range(len(groups))]
    if groups is None or len(groups) < len(opt.param_groups) or None in groups:
        raise ValueError("The optimizer checkpoint has a different number of param groups.")
    names = [[opt.name_of(p) for p in g["params"]] for g in opt.param_groups]
    if not names_cover([list(g["param_names"]) for g in groups], names):
        raise ValueError("The optimizer checkpoint's param groups name other parameters than this model's.")
    for mine, saved in zip(opt.param_groups, groups):
        for k, v in saved.items():
            if k not in ("params", "param_names"):
                mine[k] = tuple(v) if k == "betas" else v
    step = state_dict["step"]
    opt.step_count.copy_(step if isinstance(step, Tensor) else torch.tensor(float(step)))
    for entry in opt.entries:
        saved = state_dict["state"].get(entry.name)
        if saved is None:
            raise ValueError(f"The optimizer checkpoint has no state for parameter {entry.name}.")
        for kind in _KINDS:
            _copy_in(opt, entry, saved[kind], getattr(opt, kind))


def _copy_in(opt: EPShardedAdamW, entry: ParamEntry, saved: Any, buf: Tensor) -> None:
    local = saved.to_local() if hasattr(saved, "to_local") else saved
    if isinstance(local, Tensor) and hasattr(local, "local_shards"):
        by_offset = {o[0]: t for t, o in zip(local.local_shards(), local.local_offsets())}
    elif isinstance(local, Tensor) and local.numel() == entry.global_numel:
        by_offset = {0: local}
    else:
        raise ValueError(f"Optimizer state for {entry.name} is not a tensor from sharded_state_dict().")
    for offset, seg in opt.local_segments(entry):
        t = by_offset.get(seg.global_start)
        if t is None or t.numel() != seg.length:
            raise ValueError(f"Optimizer state for {entry.name} does not match this layout's shards.")
        dst = buf[_range(offset, seg)]
        if dst.data_ptr() != t.data_ptr():
            dst.copy_(t)


def _global_tensor(opt: EPShardedAdamW, buf: Tensor, entry: ParamEntry, mesh: Any) -> Any:
    """``entry``'s flattened global state as a DTensor over the world whose local part is this rank's
    pieces (views of ``buf``), or a plain view when there is no process group (one rank holds all)."""
    segments = opt.local_segments(entry)
    if mesh is None:
        return buf[:0] if not segments else buf[_range(*segments[0])]
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    pieces = [buf[_range(o, s)] for o, s in segments]
    offsets = [(s.global_start,) for _, s in segments]
    if not segments:
        # A rank holding nothing of this parameter still contributes a chunk: DCP drops a key without
        # local chunks from a rank's plan, and a missing key derails its loading. It sits at the end
        # of the tensor: DCP de-duplicates chunks by (key, offset) across ranks, so an empty chunk at
        # a real chunk's offset could replace that chunk.
        pieces, offsets = [buf[:0]], [(entry.global_numel,)]
    local = LocalShardsWrapper(pieces, offsets)
    size = torch.Size([entry.global_numel])
    return DTensor.from_local(local, mesh, [Shard(0)], shape=size, stride=(1,), run_check=False)


def _range(offset: int, seg: Segment) -> slice:
    """Where ``seg`` of a bucket whose shard starts at ``offset`` lies in the flat state buffers."""
    return slice(offset + seg.shard_start, offset + seg.shard_start + seg.length)
