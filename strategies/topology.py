"""The mesh of a parallel layout: its process groups, all taken from one named `DeviceMesh`.

`mula.layout.parallel_layout.ParallelLayout` is the numbers and says where every rank sits (rank order,
innermost first: TP, CP, EP, pipeline stage, expert-data parallel); `build_mesh` turns it into one
`DeviceMesh` with dimensions ("edp", "pp", "ep", "cp", "tp"; "cp" only when C > 1) and
`topology_from_layout` takes every group from it into a `LayoutMesh`, keyed by the layout's dimension
names (`DIMS`):

    "tp"       mesh "tp"         T consecutive ranks splitting every dense layer (one node's fabric);
                                 they read the same data, so they are NOT data-parallel ranks
    "cp"       mesh "cp"         C ranks (T apart) each holding 1/C of every sequence: the attention's
                                 head all-to-alls (strategies/context_parallel.py); they read the same
                                 samples but replicate the parameters, so for gradients and optimizer
                                 shards they count as replicas ("replica" and "edp_cp" include them),
                                 for the data not ("dp")
    "ep"       mesh "ep"         E consecutive ranks: the all-to-all of tokens (one node's fabric)
    "edp"      mesh "edp"        ranks holding the same experts of the same stage and CP index
    "edp_cp"   "edp" x "cp"      the EDP group with its CP peers: expert gradients are averaged here,
               flattened         never over the whole world
    "replica"  ("edp", "ep"      the W / (P * T) ranks replicating a stage's dense parameters (the same
                [, "cp"])        TP shards): gradients are reduced and optimizer state sharded here
               flattened
    "dp"       (no group)        the W / (P * T * C) ranks reading different data
    "pp"       mesh "pp"         one rank per stage: activations, the global gradient norm
    "world"    all flattened     what checkpoints of the sharded optimizer are laid over

With W = 8, E = 4, P = 1: EP groups [0..3], [4..7]; EDP groups [0, 4], [1, 5], ... Local expert j
on EP rank p is global expert p * E_local + j (`ParallelLayout.experts_of`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mula.layout.parallel_layout import Holdings, ParallelLayout
from mula.torch_compat import flatten_mesh


class LayoutMesh:
    """This rank's place in a `ParallelLayout` and the process groups and meshes of its dimensions.

    Every accessor takes one of the layout's dimension names (`mula.layout.parallel_layout.DIMS`: "tp",
    "cp", "ep", "pp", "edp", "edp_cp", "replica", "dp", "world") and means what the layout means by it:
    `size(dim)` is `layout.size(dim)`, `rank(dim)` this rank's index in its group along `dim`
    (`layout.group_rank`), `group_ranks(dim)` that group's global ranks, `group(dim)` its process group
    and `mesh(dim)` its `DeviceMesh` (`mesh()`: the job's whole mesh).

    A group is None where this rank does not communicate along `dim`: one process (no
    torch.distributed), a size-1 "tp", "cp" or "pp" (its callers skip the collective), "dp" (no
    collective runs over the data readers alone), or a mesh built by hand for some groups only
    (calibration, tests). Hand-built meshes number ranks within their layout, which is then the
    process group's whole world or, over a subgroup, the subgroup's ranks.
    """

    def __init__(
        self,
        layout: ParallelLayout,
        rank: int = 0,
        *,
        groups: dict[str, Any] | None = None,
        meshes: dict[str, Any] | None = None,
        root: Any = None,
    ) -> None:
        self.layout = layout
        self._rank = rank
        self._groups = dict(groups or {})
        self._meshes = dict(meshes or {})
        self._root = root
        layout.coordinates(rank)  # refuses a rank outside the layout (or a layout without W)

    def size(self, dim: str) -> int:
        """Ranks of a group along `dim` (the layout's)."""
        return self.layout.size(dim)

    def rank(self, dim: str) -> int:
        """This rank's index in its group along `dim`; "world": its global rank."""
        return self.layout.group_rank(dim, self._rank)

    def group(self, dim: str) -> Any:
        """The process group of this rank's group along `dim`, None where it does not communicate."""
        return self._groups.get(dim)

    def mesh(self, dim: str | None = None) -> Any:
        """The `DeviceMesh` of `dim` (a mesh dimension, or "replica", "edp_cp", "world" flattened);
        without `dim` the job's whole mesh. None without one."""
        if dim is None or dim in self._meshes:
            return self._root if dim is None else self._meshes[dim]
        if self._root is not None and dim in self._root.mesh_dim_names:
            return self._root[dim]
        return None

    def group_ranks(self, dim: str) -> list[int]:
        """Global ranks of this rank's group along `dim`, in group order (`rank(dim)` indexes it)."""
        return self.layout.group_ranks(dim, self._rank)

    def holdings(self, config: Any) -> Holdings:
        """The stages, blocks and experts this rank holds of a model `config` (`num_layers`,
        `num_experts`): `ParallelLayout.rank_holdings`."""
        return self.layout.rank_holdings(self._rank, config.num_layers, config.num_experts, config.mtp_depth)

    def local_expert_range(self, num_experts: int) -> range:
        """Global indices of the experts this rank holds (a contiguous run of num_experts / E)."""
        return self.layout.experts_of(self._rank, num_experts)


def _device_type() -> str:
    """The device type of the default process group's collectives: cpu for gloo (and the fake
    backend), else this machine's accelerator."""
    if dist.get_backend() in ("gloo", "fake") or not torch.accelerator.is_available():
        return "cpu"
    return torch.accelerator.current_accelerator().type  # type: ignore[union-attr]


def build_mesh(layout: ParallelLayout, device_type: str) -> tuple[Any, dict[str, Any]]:
    """The job's one `DeviceMesh` over `layout.mesh_dims()` (collective: every rank calls it, over any
    initialised backend) and its flattened dimensions: {"replica": a stage's replicas, "edp_cp": the
    EDP group with its CP peers (the mesh's "edp" when C = 1), "world": every rank}.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"The layout has {layout.world_size} ranks but the process group has {dist.get_world_size()}."
        )
    mesh = init_device_mesh(device_type, layout.mesh_shape(), mesh_dim_names=layout.mesh_dims())
    # flattened dimensions are kept as returned (torch deprecates slicing them from the root mesh)
    if layout.cp > 1:
        flat = {
            "replica": flatten_mesh(mesh["edp", "ep", "cp"], "replica"),
            "edp_cp": flatten_mesh(mesh["edp", "cp"], "edp_cp"),
        }
    else:
        flat = {"replica": flatten_mesh(mesh["edp", "ep"], "replica"), "edp_cp": mesh["edp"]}
    flat["world"] = flatten_mesh(mesh, "world")
    return mesh, flat


def topology_from_layout(layout: ParallelLayout, device_type: str | None = None) -> LayoutMesh:
    """This rank's `LayoutMesh` with every process group taken from `build_mesh(layout)`.

    Collective: every rank must call it. Without an initialised process group this describes a
    single process (W = 1).
    """
    if not (dist.is_available() and dist.is_initialized()):
        if layout.world_size != 1:
            raise ValueError(
                f"A layout of {layout.world_size} ranks needs an initialised process group; this is one process."
            )
        return LayoutMesh(layout)
    mesh, flat = build_mesh(layout, device_type or _device_type())
    groups = {dim: m.get_group() for dim, m in flat.items()}
    # "ep" and "edp" always (the expert paths read them at any E); "tp", "cp", "pp" only when split
    groups.update(ep=mesh.get_group("ep"), edp=mesh.get_group("edp"))
    groups.update({dim: mesh.get_group(dim) for dim in ("tp", "cp", "pp") if layout.size(dim) > 1})
    return LayoutMesh(layout, dist.get_rank(), groups=groups, meshes=flat, root=mesh)


def build_topology(ep_size: int, pp_size: int = 1, device_type: str | None = None) -> LayoutMesh:
    """`topology_from_layout` of the layout (W from the process group, or 1 without one, E, P)
    that tests and benchmarks describe by its sizes alone."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return topology_from_layout(ParallelLayout(world_size=world, ep=ep_size, pp=pp_size), device_type)


def reduce_over_stages(tensor: Any, topology: LayoutMesh, op: Any = None) -> Any:
    """Sum (or `op`) a per-stage total over the pipeline group, in place: every stage then holds the
    whole model's value (e.g. the squared gradient norm). A no-op with one stage."""
    if topology.size("pp") > 1:
        dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM, group=topology.group("pp"))
    return tensor


def gather_groups_over_stages(groups: list[dict[str, Any]], topology: LayoutMesh) -> list[dict[str, Any]]:
    """Optimizer param groups (hyperparameters plus "param_names") of the whole model: per group
    index, the hyperparameters of the first stage that has it and the names of every stage, in stage
    order, each once (the embedding's copy on the last stage under multi-token prediction is the first
    stage's parameter: strategies/pipeline/embedding.py). What a checkpoint records, so that any stage of any layout can check itself against it
    (collective over the pipeline group; the identity with one stage)."""
    if topology.size("pp") == 1:
        return groups
    every: list[Any] = [None] * topology.size("pp")
    dist.all_gather_object(every, groups, group=topology.group("pp"))
    merged: list[dict[str, Any]] = []
    for stage_groups in every:
        for i, group in enumerate(stage_groups):
            if i == len(merged):
                merged.append({**group, "param_names": []})
            seen = set(merged[i]["param_names"])
            merged[i]["param_names"] = [
                *merged[i]["param_names"],
                *(n for n in group["param_names"] if n not in seen),
            ]
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
