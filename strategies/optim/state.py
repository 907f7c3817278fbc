"""Distributed checkpoints of ``EPShardedAdamW``: its state as a dict ``torch.distributed.checkpoint`` saves.

Per parameter (global name) the fp32 master weights, exp_avg and exp_avg_sq (a Muon matrix's:
master and momentum_buffer, ``opt.state_kinds``) are 1-D tensors over
the flattened *global* parameter (expert parameters in global expert order), each rank contributing
the piece its shards hold, so a checkpoint saved at one (W, E) layout loads at any other. A
tensor-parallel parameter's pieces are its local shard's runs mapped into the global tensor
(``_pieces``), so one saved at one T loads at any other, T = 1 included.

Each is a DTensor ``Shard(0)`` over the job mesh's flattened world dimension (``topology.mesh("world")``). The pieces are irregular (bucket packing
and alignment decide where a parameter is cut, and a rank may hold none of it), which DTensor's even
chunks cannot express, so the local tensor is torch's ``LocalShardsWrapper`` (the local-shards
tensor DCP reads chunk offsets from, as torchrec uses it), holding views of the live buffers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from mula.layout.flat_buffers import ParamEntry, Segment
from mula.torch_compat import local_shape_and_global_offset, local_shards_wrapper_class
from strategies.topology import gather_groups_over_stages, names_cover

# `opt` below is an `EPShardedAdamW`, typed `Any`: sharded_optimizer.py imports this module, and importing
# the class back (even for type checking) would make the two one circle.


def sharded_state_dict(opt: Any) -> dict[str, Any]:
    """``opt``'s state for DCP: per parameter a global DTensor per kind, the step count and the param
    groups. Local shards are views of the live buffers, so ``dcp.load`` into this dict loads in
    place; then call ``load_sharded_state_dict``."""
    if not opt.options.ep_aware and opt.topology.size("ep") > 1:
        raise ValueError("Checkpointing the EP-unaware comparison layout is not supported.")
    opt.wait_for_params()
    mesh = opt.topology.mesh("world")  # None without a process group
    state: dict[str, Any] = {}
    for entry in opt.entries:
        state[entry.name] = {kind: _global_tensor(opt, kind, entry, mesh) for kind in opt.state_kinds(entry)}
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


def whole_state(opt: Any, kind: str = "master") -> dict[str, Tensor]:
    """Every parameter's whole flattened ``kind`` state (global name -> fp32 1-D tensor over the global
    parameter, experts in global order), the same on every rank: the pieces every rank owns written
    into place (a piece held by several ranks -- a tensor-parallel replicated weight's -- is one piece,
    as DCP keeps one chunk per offset). What a comparison of two layouts' optimizers reads (the fp32
    masters of a bf16-true run); it gathers the whole model's state as Python objects over the world, so
    it is for small models (tests, debugging), not for a checkpoint."""
    opt.wait_for_params()
    mine: dict[str, tuple[int, list[tuple[int, Tensor]]]] = {}
    for entry in opt.entries:
        if kind in opt.state_kinds(entry):
            pieces = [(start, p.detach().to("cpu", torch.float32)) for p, start in _pieces(opt, entry, kind)]
            mine[entry.name] = (_global_numel(opt, entry), pieces)
    ranks: list[Any] = [mine]
    if opt.topology.mesh("world") is not None:  # pipeline stages hold different parameters
        ranks = [None] * torch.distributed.get_world_size(opt.topology.group("world"))
        torch.distributed.all_gather_object(ranks, mine, group=opt.topology.group("world"))
    out: dict[str, Tensor] = {}
    for theirs in ranks:
        for name, (numel, pieces) in theirs.items():
            whole = out.setdefault(name, torch.zeros(numel, dtype=torch.float32))
            for start, piece in pieces:
                whole[start : start + piece.numel()] = piece
    return out


def load_sharded_state_dict(opt: Any, state_dict: dict[str, Any]) -> None:
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
        for kind in opt.state_kinds(entry):
            if kind not in saved:
                raise ValueError(
                    f"The optimizer checkpoint has no {kind} for parameter {entry.name} (saved by another "
                    "optimizer: model.optimizer must be the one the checkpoint was trained with)."
                )
            _copy_in(opt, entry, saved[kind], kind)


def _copy_in(opt: Any, entry: ParamEntry, saved: Any, kind: str) -> None:
    local = saved.to_local() if isinstance(saved, DTensor) else saved
    if isinstance(local, local_shards_wrapper_class()):
        by_offset = {o[0]: t for t, o in zip(local.local_shards(), local.local_offsets())}
    elif isinstance(local, Tensor) and local.numel() == _global_numel(opt, entry):
        by_offset = {0: local}
    else:
        raise ValueError(f"Optimizer state for {entry.name} is not a tensor from sharded_state_dict().")
    whole = by_offset.get(0) if len(by_offset) == 1 else None
    for piece, start in _pieces(opt, entry, kind):
        t = by_offset.get(start)
        if t is None and whole is not None and whole.numel() == _global_numel(opt, entry):
            t = whole[start : start + piece.numel()]  # one process: the whole tensor
        if t is None or t.numel() != piece.numel():
            raise ValueError(f"Optimizer state for {entry.name} does not match this layout's shards.")
        if piece.data_ptr() != t.data_ptr():
            piece.copy_(t)


def _global_tensor(opt: Any, kind: str, entry: ParamEntry, mesh: Any) -> Any:
    """``entry``'s flattened global state as a DTensor over the world whose local part is this rank's
    pieces (views of ``buf``), or a plain view when there is no process group (one rank holds all)."""
    pieces = _pieces(opt, entry, kind)
    buf = opt.master  # (an empty view of it stands in for a rank holding nothing)
    if mesh is None:
        return buf[:0] if not pieces else pieces[0][0]
    from torch.distributed.tensor import DTensor, Shard

    numel = _global_numel(opt, entry)
    offsets = [(start,) for _, start in pieces]
    chunks = [piece for piece, _ in pieces]
    if not pieces:
        # A rank holding nothing of this parameter still contributes a chunk: DCP drops a key without
        # local chunks from a rank's plan, and a missing key derails its loading. It sits at the end
        # of the tensor: DCP de-duplicates chunks by (key, offset) across ranks, so an empty chunk at
        # a real chunk's offset could replace that chunk.
        chunks, offsets = [buf[:0]], [(numel,)]
    local = local_shards_wrapper_class()(chunks, offsets)
    size = torch.Size([numel])
    return DTensor.from_local(local, mesh, [Shard(0)], shape=size, stride=(1,), run_check=False)


def _global_numel(opt: Any, entry: ParamEntry) -> int:
    """Elements of ``entry``'s global parameter: a tensor-parallel parameter's whole tensor."""
    p = opt.param_of(entry)
    return p.numel() if isinstance(p, DTensor) else entry.global_numel


def _pieces(opt: Any, entry: ParamEntry, kind: str) -> list[tuple[Tensor, int]]:
    """(view of the ``kind`` state buffer holding it, offset in the flattened global parameter) of every run of ``entry``'s state
    this rank owns, each contiguous in both. A tensor-parallel parameter's local shard is a box of the
    global tensor: its flat ranges are cut where the box's rows leave the global tensor's
    (``_tp_runs``), so a row-split weight (Shard(1)) gives one piece per row of the local shard."""
    p = opt.param_of(entry)
    runs = _tp_runs(p) if isinstance(p, DTensor) else None
    out: list[tuple[Tensor, int]] = []
    for offset, seg in opt.local_segments(entry):
        buf, at = opt.state_buffer(kind, offset)
        view = buf[_range(at, seg)]
        if runs is None:
            out.append((view, seg.global_start))
            continue
        length, start_of = runs
        pos = seg.param_start
        while pos < seg.param_start + seg.length:
            run, within = divmod(pos, length)
            n = min(length - within, seg.param_start + seg.length - pos)
            out.append((view[pos - seg.param_start : pos - seg.param_start + n], start_of(run) + within))
            pos += n
    return out


def _tp_runs(p: Any) -> tuple[int, Any]:
    """For a DTensor parameter: (L, start) where the local shard's flattened elements come in runs of L
    contiguous in the flattened global tensor too, run k starting at global flat offset start(k).

    The local shard is the box [offset, offset + local shape) of the global tensor; let j be the last
    dimension where the box is narrower than the tensor. Dimensions after j are whole, so each index
    of the dimensions before j gives one run of prod(local shape[j:]) elements."""
    shape = tuple(p.shape)
    local, origin = local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    narrower = [d for d in range(len(shape)) if local[d] != shape[d]]
    j = narrower[-1] if narrower else 0
    length = math.prod(local[j:])
    outer, strides = local[:j], [math.prod(shape[d + 1 :]) for d in range(len(shape))]

    def start(run: int) -> int:
        flat = sum(origin[d] * strides[d] for d in range(len(shape)))
        for d in reversed(range(len(outer))):
            run, index = divmod(run, outer[d])
            flat += index * strides[d]
        return flat

    return max(length, 1), start


def _range(offset: int, seg: Segment) -> slice:
    """Where ``seg`` of a bucket whose shard starts at ``offset`` lies in the flat state buffers."""
    return slice(offset + seg.shard_start, offset + seg.shard_start + seg.length)
