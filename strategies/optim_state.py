"""Distributed checkpoints of ``EPShardedAdamW``: its state as a dict ``torch.distributed.checkpoint`` saves.

Per parameter (global name) the fp32 master weights, exp_avg and exp_avg_sq are 1-D tensors over
the flattened *global* parameter (expert parameters in global expert order), each rank contributing
the pieces its shards hold, so a checkpoint saved at one (W, E) layout loads at any other.

The pieces are irregular (bucket packing and alignment decide where a parameter is cut, and a rank
may hold none of a parameter), which DTensor's even ``Shard(0)`` placements cannot express; they are
therefore described with ``ShardedTensor`` metadata, DCP's format for arbitrary 1-D chunks. That
deprecated API is used only here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from strategies.flat_buffers import ParamEntry

if TYPE_CHECKING:
    from strategies.sharded_optimizer import EPShardedAdamW

_KINDS = ("master", "exp_avg", "exp_avg_sq")


def sharded_state_dict(opt: EPShardedAdamW) -> dict[str, Any]:
    """``opt``'s state for DCP: per parameter a ShardedTensor per kind, the step count and the param
    groups. Local shards are views of the live buffers, so ``dcp.load`` into this dict loads in
    place; then call ``load_sharded_state_dict``."""
    if not opt.options.ep_aware and opt.topology.ep_size > 1:
        raise ValueError("Checkpointing the EP-unaware comparison layout is not supported.")
    opt.wait_for_params()
    state: dict[str, Any] = {}
    for entry in opt.entries:
        shards = _global_shards(opt, entry)
        state[entry.name] = {kind: _sharded_tensor(opt, getattr(opt, kind), shards, entry) for kind in _KINDS}
    # Param groups keyed by index (strings), not a list of dicts: if DCP ever falls back to its
    # pre-2.4 key format (it does when a saved key is missing here), the keys stay the same.
    groups = {}
    for i, group in enumerate(opt.param_groups):
        g = {k: v for k, v in group.items() if k != "params"}
        g["param_names"] = [opt.name_of(p) for p in group["params"]]
        groups[str(i)] = g
    return {"state": state, "param_groups": groups, "step": opt.step_count.detach().clone()}


def load_sharded_state_dict(opt: EPShardedAdamW, state_dict: dict[str, Any]) -> None:
    """Copy what ``sharded_state_dict`` produced (after ``dcp.load`` filled it, possibly at another
    layout) into ``opt``: param-group hyperparameters, step count and the state shards."""
    groups = state_dict.get("param_groups")
    if isinstance(groups, dict):
        groups = [groups.get(str(i)) for i in range(len(groups))]
    if groups is None or len(groups) != len(opt.param_groups) or None in groups:
        raise ValueError("The optimizer checkpoint has a different number of param groups.")
    for mine, saved in zip(opt.param_groups, groups):
        names = [opt.name_of(p) for p in mine["params"]]
        if list(saved["param_names"]) != names:
            raise ValueError(
                "The optimizer checkpoint's param groups name other parameters than this model's."
            )
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
    shards = saved.local_shards() if hasattr(saved, "local_shards") else None
    if shards is None:
        raise ValueError(
            f"Optimizer state for {entry.name} is not a ShardedTensor from sharded_state_dict()."
        )
    by_offset = {s.metadata.shard_offsets[0]: s.tensor for s in shards}
    for offset, seg in opt.local_segments(entry):
        t = by_offset.get(seg.global_start)
        if t is None or t.numel() != seg.length:
            raise ValueError(f"Optimizer state for {entry.name} does not match this layout's shards.")
        dst = buf[offset + seg.shard_start : offset + seg.shard_start + seg.length]
        if dst.data_ptr() != t.data_ptr():
            dst.copy_(t)


def _global_shards(opt: EPShardedAdamW, entry: ParamEntry) -> list[tuple[int, int, int]]:
    """(world rank, global offset, length) of every piece of ``entry`` over the whole world. The
    layout is the same on every rank of a domain (and across EP ranks for experts), so it is
    computed locally."""
    b = opt.buckets[opt.reducer.slots[entry.index].bucket]
    t = opt.topology
    out = []
    for rank in range(t.world_size):
        ep_rank, edp_rank = rank % t.ep_size, rank // t.ep_size
        dom_rank = rank if entry.domain == "dense" else edp_rank
        base = ep_rank * entry.numel if entry.domain == "expert" else 0
        pieces = [s for s in b.segments(dom_rank) if s.slot.entry.index == entry.index]
        # A rank holding nothing of this parameter gets an empty shard: DCP drops ShardedTensors
        # without local shards from a rank's plan, and a missing key derails its loading.
        out.extend((rank, base + s.param_start, s.length) for s in pieces)
        # It sits at the end of the tensor: DCP de-duplicates chunks by (key, offset) across
        # ranks, so an empty chunk at a real chunk's offset could replace that chunk.
        if not pieces:
            out.append((rank, entry.global_numel, 0))
    return out


def _sharded_tensor(
    opt: EPShardedAdamW, buf: Tensor, shards: list[tuple[int, int, int]], entry: ParamEntry
) -> Any:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    dev = buf.device
    metas = [ShardMetadata([off], [n], f"rank:{r}/{dev}") for r, off, n in shards]
    local = []
    segments = opt.local_segments(entry)
    for offset, seg in segments:
        lo = offset + seg.shard_start
        meta = next(
            m for (r, off, _), m in zip(shards, metas) if r == opt.topology.rank and off == seg.global_start
        )
        local.append(Shard(buf[lo : lo + seg.length], meta))
    if not segments:
        meta = next(m for (r, _, _), m in zip(shards, metas) if r == opt.topology.rank)
        local.append(Shard(buf[:0], meta))
    md = ShardedTensorMetadata(metas, torch.Size([entry.global_numel]), TensorProperties(dtype=buf.dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, md)
