"""One layout record (issue 39): the strategy's `ParallelLayout`, its mesh (`LayoutMesh`, built over gloo)
and the planner's `Layout` of the same settings agree on every size they name, and on every group.

A size named `<dim>_size` (or `size(dim)`) means `ParallelLayout.size(dim)` wherever it appears.
"""

from __future__ import annotations

import pytest
from dist_helpers import run_distributed

from mula.layout.parallel_layout import DIMS, ParallelLayout
from mula.plan.layout import Layout
from strategies import XPUMoEStrategy

WORLD = 4
# (E, P, T, C): each dimension above 1 alone and the pairs the strategy runs (C with T and P together
# is refused by the layout)
SIZES = [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2),
         (2, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2), (1, 2, 2, 1), (1, 2, 1, 2), (1, 1, 2, 2)]  # fmt: skip


def _layout(ep: int, pp: int, tp: int, cp: int, world: int = WORLD) -> ParallelLayout:
    return ParallelLayout(world_size=world, ep=ep, pp=pp, tp=tp, cp=cp)


def _mesh_record(rank: int, world: int) -> list[dict]:
    """Per layout of `SIZES`: this rank's mesh sizes, ranks and group members, as the mesh has them."""
    import torch.distributed as dist

    from strategies.topology import topology_from_layout

    out = []
    for sizes in SIZES:
        mesh = topology_from_layout(_layout(*sizes, world), "cpu")
        groups = {d: mesh.group(d) for d in DIMS}
        out.append({
            "size": {d: mesh.size(d) for d in DIMS},
            "rank": {d: mesh.rank(d) for d in DIMS},
            "group_ranks": {d: mesh.group_ranks(d) for d in DIMS},
            "members": {d: dist.get_process_group_ranks(g) for d, g in groups.items() if g is not None},
            "group_rank": {d: dist.get_rank(g) for d, g in groups.items() if g is not None},
            "world_mesh": dist.get_process_group_ranks(mesh.mesh("world").get_group()),
        })  # fmt: skip
    return out


def _named_sizes(record: object) -> dict[str, int]:
    """Every size `record` names `<dim>_size` for a dimension of `DIMS`, keyed by the dimension."""
    return {d: getattr(record, f"{d}_size") for d in DIMS if hasattr(record, f"{d}_size")}


@pytest.mark.parametrize(("ep", "pp", "tp", "cp"), SIZES)
def test_the_planner_and_the_strategy_name_the_same_sizes(ep: int, pp: int, tp: int, cp: int) -> None:
    layout = _layout(ep, pp, tp, cp)
    sizes = {d: layout.size(d) for d in DIMS}
    assert (sizes["ep"], sizes["pp"], sizes["tp"], sizes["cp"], sizes["world"]) == (ep, pp, tp, cp, WORLD)
    assert sizes["replica"] == WORLD // (pp * tp) and sizes["dp"] == WORLD // (pp * tp * cp)
    assert sizes["edp"] == sizes["dp"] // ep and sizes["edp_cp"] == sizes["edp"] * cp
    assert _named_sizes(layout) == {d: sizes[d] for d in _named_sizes(layout)}
    assert set(_named_sizes(layout)) == {"dp", "edp", "replica", "world"}
    plan = Layout(world_size=WORLD, ep_size=ep, pp_size=pp, tp_size=tp, cp_size=cp)
    assert plan.parallel == layout
    named = _named_sizes(plan)
    assert named == {d: sizes[d] for d in named}
    assert set(named) == {"ep", "pp", "tp", "cp", "replica", "dp", "edp_cp", "world"}
    strategy = XPUMoEStrategy(
        expert_parallel_size=ep, pipeline_parallel_size=pp, tensor_parallel_size=tp, context_parallel_size=cp
    )
    assert strategy.parallel_layout(WORLD) == layout
    assert (strategy.layout.ep, strategy.tensor_parallel_size) == (ep, tp)
    assert not hasattr(strategy, "expert_parallel_size")  # the layout holds the sizes, not the strategy


def test_every_rank_of_the_mesh_sits_where_the_layout_says() -> None:
    for rank, records in enumerate(run_distributed(_mesh_record, WORLD)):
        for sizes, got in zip(SIZES, records):
            layout = _layout(*sizes)
            case = (sizes, rank)
            assert got["size"] == {d: layout.size(d) for d in DIMS}, case
            assert got["rank"] == {d: layout.group_rank(d, rank) for d in DIMS}, case
            groups = {d: layout.group_ranks(d, rank) for d in DIMS}
            assert got["group_ranks"] == groups, case
            assert all(groups[d][got["rank"][d]] == rank for d in DIMS), case
            # every process group the mesh made holds the layout's ranks, this one at its layout index
            assert got["members"] == {d: groups[d] for d in got["members"]}, case
            assert got["group_rank"] == {d: got["rank"][d] for d in got["group_rank"]}, case
            split = {d for d in ("tp", "cp", "pp") if layout.size(d) > 1}
            assert set(got["members"]) == {"ep", "edp", "edp_cp", "replica", "world"} | split, case
            assert got["world_mesh"] == list(range(WORLD))


def test_the_world_size_waits_for_the_process_group() -> None:
    """The strategy validates its layout once when built; the one rule needing W runs when W is known."""
    strategy = XPUMoEStrategy(expert_parallel_size=3)
    assert strategy.layout.world_size is None
    with pytest.raises(ValueError, match="world size is not known yet"):
        _ = strategy.layout.dp_size
    with pytest.raises(ValueError, match="world size 4 is not divisible by expert_parallel_size=3"):
        strategy.parallel_layout(4)
    assert strategy.parallel_layout(6).dp_size == 6
    with pytest.raises(
        ValueError, match="pipeline_virtual_stages=2 needs pipeline_schedule 'interleaved-1f1b'"
    ):
        XPUMoEStrategy(pipeline_parallel_size=2, pipeline_virtual_stages=2)
