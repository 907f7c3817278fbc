"""The sharded optimizer's reducer overhead from a calibration (mula/plan/grad_reduction.py) and its use by
the step-time model; the measurement itself runs in tests/test_calibrate.py."""

from __future__ import annotations

import dataclasses

import pytest

from mula.model.config import MulaConfig
from mula.plan import Layout
from mula.plan.grad_reduction import (
    optimizer_volumes,
    overhead_per_byte,
    reduction_overhead_seconds,
    sharded_buckets,
)
from mula.plan.machines import load_machine
from mula.plan.memory import stage_params
from mula.plan.parameters import model_parameters
from mula.plan.step_overheads import update_bytes
from mula.plan.step_time import step_time

ALPHA = 1e-3  # every collective's latency; no bandwidth term, so a round's price is its calls x ALPHA
GBPS = 10.0  # the update's elementwise bandwidth
OVERRIDES = {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_experts": 8, "top_k": 2}
SHAPE = {"num_layers": 2, "micro_batch": 2, "seq_len": 64, "micro_batches": 2, "bucket_bytes": 1e6}


def _machine(reductions: dict | None) -> object:
    curve = {"alpha_s": ALPHA, "beta_s_per_byte": 0.0, "max_error": 0.0}
    kinds = ("all_to_all", "reduce_scatter", "all_gather", "all_reduce", "send_recv")
    calibration = {
        "model": "mula-tiny-moe", "overrides": OVERRIDES, "model_tflops": {"float32": 0.05, "bfloat16": 0.1},
        "collectives": {"intra": {k: {2: curve} for k in kinds}}, "elementwise_gbps": GBPS,
    }  # fmt: skip
    if reductions is not None:
        calibration["grad_reduction_s"] = {"float32": reductions}
    return dataclasses.replace(
        load_machine("aurora"), tiles_per_node=4, device_type="cpu", calibration=calibration
    )


def _small() -> MulaConfig:
    return MulaConfig.from_name("mula-tiny-moe", **{**OVERRIDES, "num_layers": 2})


def _reduce_calls(layout: Layout) -> int:
    """Reduce-scatters of one round of the measured small model (all-gathers of its step): one per bucket
    shared by the group."""
    held = stage_params(model_parameters(_small(), tuple(layout.no_decay)), [0, 1], True, True)
    return sum(b.group_size > 1 for b in sharded_buckets(held, layout))


MEASURED = {
    1: {2: {"plain": 0.050, "reduced": 0.070, **SHAPE}},
    2: {2: {"plain": 0.050, "reduced": 0.090, **SHAPE}},
}


def test_the_overhead_is_the_reduced_step_less_plain_and_the_collectives_per_byte_and_micro_batch():
    machine = _machine(MEASURED)
    calls = _reduce_calls(Layout(world_size=2, micro_batch=2, seq_len=64, micro_batches=2))
    assert calls == 2  # the dense bucket and the experts' bucket
    # ZeRO-1 reduces once per step, ZeRO-2 after each of the two micro-batches; then the update and gather
    for stage, rounds in ((1, 1), (2, 2)):
        measured = MEASURED[stage][2]
        layout = Layout(
            world_size=2, micro_batch=2, seq_len=64, micro_batches=2, shard_optimizer=True, zero_stage=stage,
            collectives="native", device_type="cpu",
        )  # fmt: skip
        update = update_bytes(_small(), layout) / (GBPS * 1e9)
        assert update > 0
        own = measured["reduced"] - measured["plain"] - (rounds + 1) * calls * ALPHA - update
        assert overhead_per_byte(machine, measured, stage, 2, "float32") == pytest.approx(own / (2 * 1e6))
    # a reducer measured faster than its priced collectives adds nothing (the pricing error stays visible)
    fast = {"plain": 0.050, "reduced": 0.051, **SHAPE}
    assert overhead_per_byte(machine, fast, 1, 2, "float32") == 0.0


def test_a_layout_pays_the_overhead_per_byte_of_its_buckets_and_micro_batch():
    machine = _machine(MEASURED)
    layout = Layout(
        world_size=8, micro_batch=2, seq_len=64, micro_batches=4, shard_optimizer=True, zero_stage=2
    )
    per_byte = overhead_per_byte(machine, MEASURED[2][2], 2, 2, "float32")  # 8 ranks: the nearest size, 2
    assert per_byte > 0
    assert reduction_overhead_seconds(machine, layout, 3e6) == pytest.approx(per_byte * 4 * 3e6)
    # no data-parallel group, replicated AdamW, no measurement, or another dtype: nothing
    assert (
        reduction_overhead_seconds(machine, Layout(world_size=2, tp_size=2, shard_optimizer=True), 3e6) == 0.0
    )
    assert reduction_overhead_seconds(machine, dataclasses.replace(layout, shard_optimizer=False), 3e6) == 0.0
    assert reduction_overhead_seconds(_machine(None), layout, 3e6) == 0.0
    assert reduction_overhead_seconds(machine, dataclasses.replace(layout, precision="bf16-true"), 3e6) == 0.0


def test_step_time_adds_the_overhead_of_the_rank_buckets_to_the_gradient_reduction():
    config = MulaConfig.from_name("mula-tiny-moe", **OVERRIDES)
    layout = Layout(
        world_size=2, micro_batch=2, seq_len=64, micro_batches=2, shard_optimizer=True, zero_stage=2
    )
    with_it, without = _machine(MEASURED), _machine(None)
    held = stage_params(model_parameters(config, tuple(layout.no_decay)), range(4), True, True)
    nbytes = optimizer_volumes(held, layout)[4]
    # the padded buckets in the reduction's dtype (fp32)
    assert nbytes == sum(b.numel for b in sharded_buckets(held, layout)) * 4 > 0
    added = (
        step_time(config, layout, with_it, 8).grad_sync_s - step_time(config, layout, without, 8).grad_sync_s
    )
    assert added == pytest.approx(reduction_overhead_seconds(with_it, layout, nbytes)) and added > 0
    # replicated AdamW's buckets are not the sharded reducer's
    assert optimizer_volumes(held, dataclasses.replace(layout, shard_optimizer=False))[4] == 0.0
