"""One parallel layout: rank coordinates, groups and holdings, and the planner and the strategy
accepting and refusing the same layouts with the same sentence (no process is started)."""

from __future__ import annotations

import itertools
import random

import pytest

from mula.layout.parallel_layout import Coordinates, ParallelLayout
from mula.layout.rules import check_batch_split, check_zero_stage
from mula.model.config import MulaConfig
from mula.plan.settings import plan_inputs
from strategies import XPUMoEStrategy

SIZES = [
    (w, e, p) for w in (1, 2, 3, 4, 6, 8, 12, 16) for e in (1, 2, 3, 4) for p in (1, 2, 4) if w % (e * p) == 0
]


@pytest.mark.parametrize(("world", "ep", "pp"), SIZES)
def test_coordinates_round_trip_and_groups_partition_the_ranks(world: int, ep: int, pp: int) -> None:
    layout = ParallelLayout(world_size=world, ep=ep, pp=pp)
    seen = set()
    for rank in range(world):
        c = layout.coordinates(rank)
        assert layout.rank(c.edp, c.pp, c.ep) == rank
        seen.add((c.edp, c.pp, c.ep))
        # DESIGN.md's order: EP innermost, then the stage, data parallel outermost
        assert rank == c.edp * pp * ep + c.pp * ep + c.ep
        assert layout.group_rank("replica", rank) == c.edp * ep + c.ep
    assert len(seen) == world
    sizes = {
        "ep": ep,
        "edp": world // (pp * ep),
        "pp": pp,
        "replica": world // pp,
        "dp": world // pp,
        "world": world,
    }
    for dim, size in sizes.items():
        assert layout.size(dim) == size
        groups = layout.all_groups(dim)
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(world))  # each rank in exactly one
        for rank in range(world):
            assert layout.group_ranks(dim, rank)[layout.group_rank(dim, rank)] == rank
    for rank in range(world):  # an EP group is consecutive ranks; a stage group shares the stage
        ep_ranks = layout.group_ranks("ep", rank)
        assert ep_ranks == list(range(ep_ranks[0], ep_ranks[0] + ep))
        assert {layout.coordinates(r).pp for r in layout.group_ranks("replica", rank)} == {
            layout.coordinates(rank).pp
        }
        assert {layout.coordinates(r).pp for r in layout.group_ranks("pp", rank)} == set(range(pp))


def test_coordinates_of_a_known_layout() -> None:
    # Aurora-like: W = 24, E = 12, P = 2 -> one EDP index; rank 17 is stage 1, EP rank 5
    layout = ParallelLayout(world_size=24, ep=12, pp=2)
    assert layout.coordinates(17) == Coordinates(edp=0, pp=1, ep=5)
    assert (layout.stage_size, layout.dp_size, layout.edp_size) == (12, 12, 1)
    assert layout.group_ranks("edp", 5) == [5]
    assert ParallelLayout(world_size=8, ep=4).all_groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="rank 8 is not one of the 8 ranks"):
        ParallelLayout(world_size=8, ep=4).coordinates(8)


def test_rank_holdings_blocks_and_experts() -> None:
    # looped placement of P x V = 4 stages of [3, 2, 2, 1] blocks over P = 2: stages (0, 2) and (1, 3)
    looped = ParallelLayout(
        world_size=2, pp=2, schedule="interleaved-1f1b", virtual_stages=2, stage_layers=(3, 2, 2, 1)
    )
    zero, one = looped.rank_holdings(0, 8), looped.rank_holdings(1, 8)
    assert (zero.stages, zero.blocks, zero.first, zero.last) == ((0, 2), [0, 1, 2, 5, 6], True, False)
    assert (one.stages, one.blocks, one.first, one.last) == ((1, 3), [3, 4, 7], False, True)
    assert zero.blocks_per_stage == (range(0, 3), range(5, 7))
    assert zero.experts == range(0)  # a dense model
    # an even split puts the remainder on the first stages
    assert [h.blocks for h in map(ParallelLayout(world_size=2, pp=2).rank_holdings, (0, 1), (7, 7))] == [
        [0, 1, 2, 3],
        [4, 5, 6],
    ]
    # experts: EP rank p holds p * n / E ... (p + 1) * n / E - 1 of every MoE block
    flat = ParallelLayout(world_size=8, ep=4)
    assert [flat.rank_holdings(r, 2, 16).experts for r in (0, 6)] == [range(0, 4), range(8, 12)]
    # W = 8, P = 2, E = 2: rank 6 = (edp 1, stage 1, EP rank 0)
    piped = ParallelLayout(world_size=8, ep=2, pp=2)
    held = piped.rank_holdings(6, 4, 8)
    assert (held.stages, held.blocks, held.experts, held.first, held.last) == (
        (1,),
        [2, 3],
        range(0, 4),
        False,
        True,
    )
    with pytest.raises(ValueError, match="6 experts, which is not divisible by expert_parallel_size=4"):
        flat.rank_holdings(0, 2, 6)
    with pytest.raises(ValueError, match="fewer than its 4 pipeline stages"):
        ParallelLayout(world_size=4, pp=4).rank_holdings(0, 3)


def _planner(world: int, init_args: dict, overrides: dict, global_batch: int, micro: int) -> str:
    """What `mula plan` says about a recipe with these settings: "ok" or its sentence."""
    trainer = {
        "devices": world,
        "accelerator": "cpu",
        "strategy": {"class_path": "strategies.XPUMoEStrategy", "init_args": init_args},
    }
    data = {"micro_batch_size": micro, "global_batch_size": global_batch, "seq_len": 16}
    try:
        plan_inputs(trainer, {"config": "mula-tiny-moe", "overrides": overrides}, data)
    except ValueError as error:
        return str(error)
    return "ok"


def _strategy(world: int, init_args: dict, overrides: dict, global_batch: int, micro: int) -> str:
    """What a run with these settings stops with, in the order a run meets the checks: the strategy's
    arguments, its layout in setup_environment, the data module's batch split, the optimizer's ZeRO
    stage, the pipeline schedule's micro-batches at the first step."""
    try:
        strategy = XPUMoEStrategy(**init_args)
        config = MulaConfig.from_name("mula-tiny-moe", **overrides)
        layout = strategy.parallel_layout(world, config)
        check_batch_split(global_batch, layout.dp_size, micro)  # MulaDataModule.setup
        if strategy.shard_optimizer:  # XPUMoEStrategy's optimizer setup
            check_zero_stage(strategy.layout.pp, strategy.optimizer_options.get("zero_stage", 1))
        layout.check_micro_batches(global_batch // (layout.dp_size * micro))  # PipelineRunner
    except ValueError as error:
        return str(error)
    return "ok"


def _cases(n: int) -> list[tuple]:
    """`n` layouts drawn (fixed seed) from sizes, schedules, splits, batches and models."""
    space = list(
        itertools.product(
            (1, 2, 3, 4, 6, 8, 12, 16),  # W
            (1, 2, 3, 4),  # E
            (1, 1, 2, 3, 4),  # P
            ("1f1b", "interleaved-1f1b", "gpipe"),
            (1, 1, 2),  # virtual stages
            (None, None, "uneven"),  # stage layers
            (1, 2),  # micro-batch
            (4, 8, 24),  # global batch
            ((4, 8), (3, 6), (8, 8), (4, 0)),  # (layers, experts); 0: dense
            (1, 2),  # ZeRO stage
            (False, False, False, True),  # tied embeddings
        )
    )
    return random.Random(0).sample(space, n)


def test_planner_and_strategy_accept_and_refuse_the_same_layouts() -> None:
    verdicts = []
    for w, e, p, schedule, v, split, micro, batch, (layers, experts), zero, tied in _cases(800):
        stage_layers = None if split is None else [1] * (p * v - 1) + [layers - (p * v - 1)]
        init_args = {
            "expert_parallel_size": e,
            "pipeline_parallel_size": p,
            "pipeline_schedule": schedule,
            "pipeline_virtual_stages": v,
            "pipeline_stage_layers": stage_layers,
            "optimizer_options": {"zero_stage": zero},
        }
        overrides = {"num_layers": layers, "num_experts": experts, "tie_embeddings": tied}
        if experts == 0:
            overrides.update(top_k=0)
        planner = _planner(w, init_args, overrides, batch, micro)
        strategy = _strategy(w, init_args, overrides, batch, micro)
        assert planner == strategy, (w, init_args, overrides, batch, micro)
        verdicts.append(planner)
    # the sample covers accepted layouts and most rules
    assert 40 < verdicts.count("ok") < len(verdicts) - 300, verdicts.count("ok")
    rules = {
        "is not divisible by pipeline_parallel_size", "is larger than the world size",
        "is not divisible by expert_parallel_size", "which is not divisible by expert_parallel_size",
        "needs pipeline_schedule 'interleaved-1f1b'", "needs pipeline_parallel_size > 1",
        "pipeline_stage_layers", "tie_embeddings", "global_batch_size", "zero_stage=2",
        "micro-batches per step", "needs an MoE model",
    }  # fmt: skip
    missing = {rule for rule in rules if not any(rule in v for v in verdicts)}
    assert not missing, missing


def test_strategy_defaults_are_the_planners() -> None:
    """The planner reads XPUMoEStrategy's defaults from its signature: a recipe with a bare
    `strategy: xpu_moe` plans the layout the strategy builds."""
    trainer = {"devices": 4, "accelerator": "cpu", "strategy": "xpu_moe"}
    layout = plan_inputs(trainer, {"config": "mula-tiny-moe"}, {"global_batch_size": 8}).layout
    strategy = XPUMoEStrategy()
    assert layout.parallel == strategy.parallel_layout(4)
    assert layout.shard_optimizer is strategy.shard_optimizer


def test_search_skips_more_stages_than_ranks() -> None:
    """`mula plan --search` on 2 ranks meets P = 4 and 8: refused layouts, not a division by zero."""
    from mula.plan.search import candidate_layouts

    trainer = {"devices": 2, "accelerator": "cpu", "strategy": "xpu_moe"}
    inputs = plan_inputs(trainer, {"config": "mula-tiny-moe"}, {"global_batch_size": 8})
    layouts = candidate_layouts(inputs)
    assert layouts and {layout.pp_size for layout in layouts} <= {1, 2}
