"""`mula plan --search` with tensor parallelism: T (and sequence parallelism) among the candidates
where the strategy runs it, within a node, and every listed layout one the strategy accepts."""

from __future__ import annotations

from pathlib import Path

from mula import MulaConfig
from mula.plan import plan_memory
from mula.plan.machines import load_machine
from mula.plan.search import candidate_layouts, search_layouts
from mula.plan.settings import plan_inputs
from strategies import XPUMoEStrategy

AURORA = load_machine("aurora")  # 12 tiles per node
ROOT = Path(__file__).resolve().parents[1]


def _inputs(config: str):
    trainer = {"strategy": "xpu_moe", "precision": "bf16-mixed"}
    data = {"global_batch_size": 48, "seq_len": 256, "micro_batch_size": 1}
    return plan_inputs(trainer, {"config": config}, data, machine=AURORA, nodes=1)


def test_search_tries_tensor_parallel_sizes_the_strategy_runs() -> None:
    inputs = _inputs("mula-tiny-dense")  # 4 heads: T = 1, 2, 4 (T = 8 does not divide them)
    layouts = candidate_layouts(inputs)
    assert {(lay.tp_size, lay.sequence_parallel) for lay in layouts} == {
        (1, False), (2, False), (2, True), (4, False), (4, True)
    }  # fmt: skip
    rows = search_layouts(inputs, limit=10_000)
    assert {row["T"] for row in rows} == {1, 2, 4}
    for lay in layouts:
        if lay.tp_size > 1:
            # the strategy accepts the layout as planned (torch AdamW, no ZeRO stage, no bf16 weights)
            XPUMoEStrategy(
                tensor_parallel_size=lay.tp_size, sequence_parallel=lay.sequence_parallel,
                shard_optimizer=lay.shard_optimizer, pipeline_parallel_size=lay.pp_size,
                context_parallel_size=lay.cp_size,
            )  # fmt: skip
            assert lay.replica_size * lay.tp_size * lay.pp_size == AURORA.tiles_per_node
            # C context-parallel peers read the same samples: the batch is over the data ranks
            assert lay.micro_batches * lay.micro_batch * lay.dp_size == 48
    fastest = {}
    for row in rows:
        fastest.setdefault(row["T"], row)
    for t, row in fastest.items():  # the rows are the plan of their layout
        match = [
            lay for lay in layouts
            if (lay.tp_size, lay.sequence_parallel, lay.micro_batch, lay.checkpointing, lay.ep_size, lay.pp_size)
            == (t, row["SP"], row["micro_batch"], row["checkpointing"], row["E"], row["P"])
            and (lay.precision == "bf16-true") == row["bf16_weights"] and lay.zero_stage == row["zero_stage"]
            and (lay.cp_size, lay.offload) == (row["C"], row["offload"])
        ]  # fmt: skip
        assert round(plan_memory(inputs.config, match[0]).total / 1e9, 2) == row["total_gb"]


def test_search_offers_tensor_parallelism_for_moe_models() -> None:
    """MoE layers run under TP (tokens split, experts whole): the search offers T > 1 for MoE models too,
    with expert parallelism beside it (T x E ranks)."""
    layouts = candidate_layouts(_inputs("mula-tiny-moe"))
    assert {lay.tp_size for lay in layouts} > {1}
    assert any(lay.tp_size > 1 and lay.ep_size > 1 for lay in layouts)


FRONTIER_RECIPES = {
    "mula-gpt-22b": (22.4, 32),
    "mula-gpt-175b": (175.2, 128),
    "mula-gpt-1t": (1009.2, 384),
}  # billions, nodes


def test_frontier_machine_and_dense_gpt_presets() -> None:
    """frontier.yaml: 8 GCDs of 64 GB and 191.5 TFLOP/s per node; the presets have the paper's shapes."""
    frontier = load_machine("frontier")
    assert (frontier.tiles_per_node, frontier.memory_per_tile_gb, frontier.peak_bf16_tflops) == (8, 64, 191.5)
    for name, (layers, hidden, heads) in {
        "mula-gpt-22b": (48, 6144, 64),
        "mula-gpt-175b": (96, 12288, 96),
        "mula-gpt-1t": (128, 25600, 160),
    }.items():
        config = MulaConfig.from_name(name)
        assert (config.num_layers, config.hidden_size, config.num_heads, config.num_experts) == (
            layers,
            hidden,
            heads,
            0,
        )
        assert round(config.num_params() / 1e9, 1) == FRONTIER_RECIPES[name][0]
        assert config.intermediate_size % 8 == 0 and config.num_heads % 8 == 0  # T = 8 (a node) splits them


def test_frontier_recipes_fit_as_mula_plan_says(capsys) -> None:
    """Each Frontier recipe is planned on its nodes of frontier.yaml and fits a 64 GB GCD (docs/scaling.md)."""
    import json

    from mula.cli import main

    for name, (_, nodes) in FRONTIER_RECIPES.items():
        recipe = ROOT / "recipes" / "frontier" / f"{name}.yaml"
        main(["plan", "-c", str(recipe), "--machine=frontier", "--format=json"])
        result = json.loads(capsys.readouterr().out)
        assert result["fits"], name
        assert result["layout"]["world_size"] == nodes * 8


def test_search_offers_tensor_parallelism_inside_pipeline_stages() -> None:
    """T x P layouts (each stage split over its TP group) are candidates, each one the layout accepts."""
    layouts = [
        lay for lay in candidate_layouts(_inputs("mula-tiny-dense")) if lay.tp_size > 1 and lay.pp_size > 1
    ]
    # 12 tiles, 2 blocks: P = 2 with T = 2 (3 data-parallel ranks); T = 4 x P = 2 does not divide 12
    assert {(lay.tp_size, lay.pp_size) for lay in layouts} == {(2, 2)}
    for lay in layouts:
        lay.parallel.validate(_inputs("mula-tiny-dense").config)
