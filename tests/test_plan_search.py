"""`mula plan --search` over context parallelism and optimizer offload: C among the candidates where the
layout rules accept it (C x T dividing a node, the heads and the sequence split by C), offload on and
off, each row the plan of its layout (device and host bytes), host memory per node respected."""

from __future__ import annotations

import dataclasses

from mula.plan import plan_memory
from mula.plan.layout import check_runnable
from mula.plan.machines import load_machine
from mula.plan.search import candidate_layouts, search_layouts
from mula.plan.settings import plan_inputs

AURORA = load_machine("aurora")  # 12 tiles per node


def _inputs(seq_len: int = 256, machine=AURORA, config: str = "mula-tiny-dense", nodes: int = 1):
    trainer = {"strategy": "xpu_moe", "precision": "bf16-mixed"}  # no asynchronous checkpoint: host 0
    data = {"global_batch_size": 12 * nodes, "seq_len": seq_len, "micro_batch_size": 1}
    return plan_inputs(trainer, {"config": config}, data, machine=machine, nodes=nodes)


def _layout_of(layouts, row):
    """The candidate a search row describes."""
    return next(
        lay for lay in layouts
        if (lay.ep_size, lay.pp_size, lay.tp_size, lay.sequence_parallel, lay.cp_size, lay.micro_batch,
            lay.checkpointing, lay.zero_stage, lay.precision == "bf16-true", lay.offload)
        == (row["E"], row["P"], row["T"], row["SP"], row["C"], row["micro_batch"], row["checkpointing"],
            row["zero_stage"], row["bf16_weights"], row["offload"])
    )  # fmt: skip


def test_search_tries_the_context_parallel_sizes_a_node_and_the_heads_allow() -> None:
    inputs = _inputs()
    layouts = candidate_layouts(inputs)
    # 4 heads on 12-tile nodes: C = 2 and 4 (3, 6 and 12 do not divide the heads; 8 does not divide 12)
    assert {lay.cp_size for lay in layouts} == {1, 2, 4}
    for lay in layouts:
        assert lay.cp_size == 1 or AURORA.tiles_per_node % (lay.cp_size * lay.tp_size) == 0  # inside a node
        check_runnable(inputs.config, lay, inputs.global_batch)  # what mula plan / mula fit accept
        assert lay.micro_batches * lay.micro_batch * lay.dp_size == inputs.global_batch
    # a sequence C does not split is not a candidate at that C
    odd = _inputs(seq_len=254)
    assert {lay.cp_size for lay in candidate_layouts(odd)} == {1, 2}
    # one device per node (GH200): no context parallelism inside a node
    assert {lay.cp_size for lay in candidate_layouts(_inputs(machine=load_machine("gh200")))} == {1}
    # T = 8 on 12-tile nodes (24 ranks) stays a candidate without CP (C = 1), but no C > 1 goes beside it
    wide = {(lay.tp_size, lay.cp_size) for lay in candidate_layouts(_inputs(config="mula-7b-a1b", nodes=2))}
    assert (8, 1) in wide and not any(t * c > 12 or 12 % (t * c) for t, c in wide if c > 1)


def test_search_rows_give_c_offload_and_the_plans_device_and_host_bytes() -> None:
    inputs = _inputs()
    layouts = candidate_layouts(inputs)
    rows = search_layouts(inputs, limit=100_000)
    assert {r["C"] for r in rows} == {1, 2, 4} and {r["offload"] for r in rows} == {False, True}
    for row in rows:
        plan = plan_memory(inputs.config, _layout_of(layouts, row))
        assert row["total_gb"] == round(plan.total / 1e9, 2) and row["host_gb"] == round(
            plan.host_bytes / 1e9, 2
        )
        assert (row["host_gb"] > 0) == row["offload"]  # the offloaded optimizer, nothing else here
    # at equal step time the layout without offload comes first (its host update is not priced)
    for a, b in zip(rows, rows[1:]):
        assert a["step_time_s"] <= b["step_time_s"]
        if a["step_time_s"] == b["step_time_s"]:
            assert a["offload"] <= b["offload"]


def test_search_needs_context_parallelism_when_one_rank_cannot_hold_the_sequence() -> None:
    """A device that holds the sequence's activations only split over C ranks: every listed layout has
    C > 1, and the smallest one at C = 1 is over the device."""
    inputs = _inputs(seq_len=4096)
    layouts = candidate_layouts(inputs)
    smallest = {
        c: min(plan_memory(inputs.config, lay).total for lay in layouts if lay.cp_size == c) for c in (1, 4)
    }
    assert smallest[4] < smallest[1]
    inputs.device_bytes = (smallest[1] + smallest[4]) // 2
    rows = search_layouts(inputs, limit=100_000)
    assert rows and all(r["C"] > 1 for r in rows)


def test_search_keeps_the_offloaded_optimizer_within_the_nodes_host_memory() -> None:
    inputs = _inputs()
    assert any(r["offload"] for r in search_layouts(inputs, limit=100_000))  # 1 TB per Aurora node
    offloaded = [lay for lay in candidate_layouts(inputs) if lay.offload]
    least = min(plan_memory(inputs.config, lay).host_bytes for lay in offloaded) * AURORA.tiles_per_node
    small = dataclasses.replace(AURORA, host_memory_per_node_gb=0.99 * least / 1e9)
    rows = search_layouts(_inputs(machine=small), limit=100_000)
    assert rows and not any(r["offload"] for r in rows)


def test_search_tries_pipelines_as_deep_as_the_model() -> None:
    """A 1T dense model fits a 64 GB GCD only at 16 or more stages: the search tries every power of two up
    to one block per stage, and offers the 1T Frontier recipe's own layout (T=8 + SP, P=16, full)."""
    frontier = load_machine("frontier")
    trainer = {"strategy": "xpu_moe", "precision": "bf16-true", "num_nodes": 384}
    data = {"global_batch_size": 3072, "seq_len": 2048, "micro_batch_size": 1}
    inputs = plan_inputs(trainer, {"config": "mula-gpt-1t"}, data, machine=frontier, nodes=384)
    layouts = candidate_layouts(inputs)
    assert {lay.pp_size for lay in layouts} == {1, 2, 4, 8, 16, 32, 64, 128}  # 128 layers
    recipe = [
        lay for lay in layouts
        if (lay.pp_size, lay.tp_size, lay.sequence_parallel, lay.checkpointing, lay.micro_batch, lay.offload)
        == (16, 8, True, "full", 1, False) and lay.zero_stage == 1 and lay.precision == "bf16-true"
    ]  # fmt: skip
    assert recipe and plan_memory(inputs.config, recipe[0]).total <= inputs.device_bytes
    shallow = [lay for lay in layouts if lay.pp_size <= 8]
    assert all(plan_memory(inputs.config, lay).total > inputs.device_bytes for lay in shallow)
