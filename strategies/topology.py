"""Process groups of a parallel layout, all taken from one named `DeviceMesh`.

`mula.layout.parallel_layout.ParallelLayout` says where every rank sits (rank order, innermost first: TP,
CP, EP, pipeline stage, expert-data parallel); `build_mesh` turns it into one `DeviceMesh` with dimensions
("edp", "pp", "ep", "cp", "tp"; "cp" only when C > 1) and `topology_from_layout` takes every group from it:

    TP group     mesh "tp"       T consecutive ranks splitting every dense layer (one node's fabric);
                                 they read the same data, so they are NOT data-parallel ranks
    CP group     mesh "cp"       C ranks (T apart) each holding 1/C of every sequence: the attention's
                                 head all-to-alls (strategies/context_parallel.py); they read the same
                                 samples but replicate the parameters, so for gradients and optimizer
                                 shards they count as data-parallel ranks (the stage and EDP groups
                                 below include them), for the data not (`XPUMoEStrategy.data_parallel_*`)
    EP group     mesh "ep"       E consecutive ranks: the all-to-all of tokens (one node's fabric)
    EDP group    mesh "edp"      ranks holding the same experts of the same stage: expert gradients
                 (x "cp")        are averaged here, never over the whole world
    stage group  ("edp", "ep"    the W / (P * T) ranks replicating a stage's dense parameters (the same
                  [, "cp"])      TP shards): gradients are reduced here, over no TP rank
                 flattened "dp"  (`world_group`: the stage's data-parallel world)
    PP group     mesh "pp"       one rank per stage: activations, the global gradient norm
    world        all flattened   what checkpoints of the sharded optimizer are laid over

With W = 8, E = 4, P = 1: EP groups [0..3], [4..7]; EDP groups [0, 4], [1, 5], ... Local expert j
on EP rank p is global expert p * E_local + j (`ParallelLayout.experts_of`).

`world_size`, `rank` and `world_group` of a topology describe its stage's replicas (stage-local rank
(edp * E + ep) * C + cp, W / (P * T) ranks: the data-parallel world, with its CP peers); `stage_ranks`
maps local ranks to global ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mula.layout.parallel_layout import Holdings, ParallelLayout


@dataclass
class ExpertParallelTopology:
    """This rank's place in the layout and the process groups it communicates in.

    Groups are None when running without torch.distributed (a single process); code paths then skip
    communication because every group has size 1. `layout` and `mesh` are the job's `ParallelLayout`
    and `DeviceMesh` (None when built by hand or without a process group); `stage_mesh` and
    `world_mesh` are the mesh's flattened stage and world dimensions; `tp_*` this rank's tensor-parallel
    group (T = 1: none).
    """

    world_size: int
    rank: int
    ep_size: int
    edp_size: int
    ep_rank: int
    edp_rank: int
    ep_group: Any = None
    edp_group: Any = None
    world_group: Any = None
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: Any = None  # this rank's pipeline group (one rank per stage), None when P = 1
    stage_ranks: list[int] | None = None  # global rank of each stage-local rank; None: the identity
    layout: ParallelLayout | None = None
    mesh: Any = None
    stage_mesh: Any = None
    world_mesh: Any = None
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None  # this rank's tensor-parallel group, None when T = 1
    tp_mesh: Any = None  # the mesh's "tp" dimension (what DTensor parameters are laid over), None when T = 1
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: Any = None  # this rank's context-parallel group, None when C = 1

    @property
    def stage_layout(self) -> ParallelLayout:
        """The layout of this rank's stage replicas alone (its W / (P x T) ranks, E, C): where stage-local
        ranks sit."""
        return ParallelLayout(world_size=self.world_size, ep=self.ep_size, cp=self.cp_size)

    @property
    def global_rank(self) -> int:
        """This rank's global rank."""
        return self.to_global(self.rank)

    def holdings(self, config: Any) -> Holdings:
        """The stages, blocks and experts this rank holds of a model `config` (`num_layers`,
        `num_experts`): `ParallelLayout.rank_holdings` of the job's layout."""
        layout = self.layout or self.stage_layout
        return layout.rank_holdings(self.global_rank, config.num_layers, config.num_experts)

    def to_global(self, local_rank: int) -> int:
        """The global rank of a rank of this (stage's) data-parallel world."""
        return local_rank if self.stage_ranks is None else self.stage_ranks[local_rank]

    def world_ranks(self) -> list[int]:
        """Global ranks of this (stage's) data-parallel world, in local-rank order."""
        return [self.to_global(r) for r in range(self.world_size)]

    def local_expert_range(self, num_experts: int) -> range:
        """Global indices of the experts this rank holds (contiguous block of num_experts / ep_size)."""
        return self.stage_layout.experts_of(self.rank, num_experts)

    def ep_group_ranks(self) -> list[int]:
        """Global ranks of this rank's EP group, in EP-rank order."""
        return [self.to_global(r) for r in self.stage_layout.group_ranks("ep", self.rank)]

    def edp_group_ranks(self) -> list[int]:
        """Global ranks of this rank's EDP group (with its CP peers, which hold the same experts), in
        EDP-rank order."""
        return [self.to_global(r) for r in self.stage_layout.group_ranks("edp_cp", self.rank)]


def _device_type() -> str:
    """The device type of the default process group's collectives: cpu for gloo (and the fake
    backend), else this machine's accelerator."""
    if dist.get_backend() in ("gloo", "fake") or not torch.accelerator.is_available():
        return "cpu"
    return torch.accelerator.current_accelerator().type  # type: ignore[union-attr]


def build_mesh(layout: ParallelLayout, device_type: str) -> Any:
    """The job's one `DeviceMesh` over `MESH_DIMS` (collective: every rank calls it, over any
    initialised backend), with its stage ("dp") and "world" dimensions flattened.

    Returns (mesh, stage_mesh, world_mesh, edp_mesh): edp_mesh is "edp" with its CP peers flattened
    ("edp_cp") when C > 1, else the mesh's "edp".
    """
    from torch.distributed.device_mesh import init_device_mesh

    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"The layout has {layout.world_size} ranks but the process group has {dist.get_world_size()}."
        )
    mesh = init_device_mesh(device_type, layout.mesh_shape(), mesh_dim_names=layout.mesh_dims())
    # flattened dimensions are kept as returned (torch deprecates slicing them from the root mesh)
    if layout.cp > 1:
        stage_mesh = mesh["edp", "ep", "cp"]._flatten("dp")
        edp_mesh = mesh["edp", "cp"]._flatten("edp_cp")
    else:
        stage_mesh, edp_mesh = mesh["edp", "ep"]._flatten("dp"), mesh["edp"]
    world_mesh = mesh._flatten("world")
    return mesh, stage_mesh, world_mesh, edp_mesh


def topology_from_layout(layout: ParallelLayout, device_type: str | None = None) -> ExpertParallelTopology:
    """This rank's topology with every process group taken from `build_mesh(layout)`.

    Collective: every rank must call it. Without an initialised process group this describes a
    single process (W = 1) and requires E = P = 1.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if layout.world_size != 1:
            raise ValueError(
                f"A layout of {layout.world_size} ranks needs an initialised process group; this is one process."
            )
        return ExpertParallelTopology(
            world_size=1, rank=0, ep_size=1, edp_size=1, ep_rank=0, edp_rank=0, layout=layout
        )
    mesh, stage_mesh, world_mesh, edp_mesh = build_mesh(layout, device_type or _device_type())
    rank = dist.get_rank()
    where = layout.coordinates(rank)
    return ExpertParallelTopology(
        world_size=layout.replica_size,
        rank=layout.stage_local_rank(rank),
        ep_size=layout.ep,
        edp_size=layout.edp_size * layout.cp,
        ep_rank=where.ep,
        edp_rank=where.edp * layout.cp + where.cp,
        ep_group=mesh.get_group("ep"),
        edp_group=edp_mesh.get_group(),
        world_group=stage_mesh.get_group(),
        pp_size=layout.pp,
        pp_rank=where.pp,
        pp_group=mesh.get_group("pp") if layout.pp > 1 else None,
        stage_ranks=None if layout.pp == layout.tp == 1 else layout.group_ranks("stage", rank),
        cp_size=layout.cp,
        cp_rank=where.cp,
        cp_group=mesh.get_group("cp") if layout.cp > 1 else None,
        layout=layout,
        mesh=mesh,
        stage_mesh=stage_mesh,
        world_mesh=world_mesh,
        tp_size=layout.tp,
        tp_rank=where.tp,
        tp_group=mesh.get_group("tp") if layout.tp > 1 else None,
        tp_mesh=mesh["tp"] if layout.tp > 1 else None,
    )


def build_topology(ep_size: int, pp_size: int = 1, device_type: str | None = None) -> ExpertParallelTopology:
    """`topology_from_layout` of the layout (W from the process group, or 1 without one, E, P)
    that tests and benchmarks describe by its sizes alone."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return topology_from_layout(ParallelLayout(world_size=world, ep=ep_size, pp=pp_size), device_type)


def reduce_over_stages(tensor: Any, topology: ExpertParallelTopology, op: Any = None) -> Any:
    """Sum (or `op`) a per-stage total over the pipeline group, in place: every stage then holds the
    whole model's value (e.g. the squared gradient norm). A no-op with one stage."""
    if topology.pp_size > 1:
        dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM, group=topology.pp_group)
    return tensor


def gather_groups_over_stages(
    groups: list[dict[str, Any]], topology: ExpertParallelTopology
) -> list[dict[str, Any]]:
    """Optimizer param groups (hyperparameters plus "param_names") of the whole model: per group
    index, the hyperparameters of the first stage that has it and the names of every stage, in stage
    order. What a checkpoint records, so that any stage of any layout can check itself against it
    (collective over the pipeline group; the identity with one stage)."""
    if topology.pp_size == 1:
        return groups
    every: list[Any] = [None] * topology.pp_size
    dist.all_gather_object(every, groups, group=topology.pp_group)
    merged: list[dict[str, Any]] = []
    for stage_groups in every:
        for i, group in enumerate(stage_groups):
            if i == len(merged):
                merged.append({**group, "param_names": []})
            merged[i]["param_names"] = [*merged[i]["param_names"], *group["param_names"]]
    return merged


def names_cover(saved: list[list[str]], mine: list[list[str]]) -> bool:
    """True if every param group of `mine` is, in order, part of the same group of `saved` (a stage's
    groups hold some of the whole model's parameters, an unsplit model's all of them)."""
    if len(saved) < len(mine):
        return False
    for theirs, ours in zip(saved, mine):
        wanted = set(ours)
        if [n for n in theirs if n in wanted] != list(ours):
            return False
    return True
