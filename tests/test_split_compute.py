"""The compute factor of a TP, CP or EP split from a calibration (mula/plan/split_compute.py) and its use by
the step-time model; the measurement itself runs in tests/test_calibrate.py."""

from __future__ import annotations

import dataclasses

import pytest

from mula.model.config import MulaConfig
from mula.plan import Layout
from mula.plan.machines import load_machine
from mula.plan.split_compute import layout_split_factor, split_factor
from mula.plan.split_volumes import (
    context_parallel_router_calls,
    context_parallel_sends,
    tensor_parallel_sends,
)
from mula.plan.step_time import step_time

CALL, BETA = 1e-3, 2e-9  # a functional call's price, every collective's seconds per bus byte
OVERRIDES = {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_experts": 8, "top_k": 2}
SHAPE = {"num_layers": 2, "micro_batch": 2, "seq_len": 64}


def _machine(splits: dict) -> object:
    curve = {"alpha_s": 1e-4, "beta_s_per_byte": BETA, "max_error": 0.0}
    kinds = ("all_to_all", "reduce_scatter", "all_gather", "all_reduce", "send_recv")
    calibration = {
        "model": "mula-tiny-moe", "overrides": OVERRIDES, "model_tflops": {"float32": 0.05, "bfloat16": 0.1},
        "functional_call_s": {2: CALL}, "collectives": {"intra": {k: {2: curve} for k in kinds}},
        "split_training_s": {"float32": splits},
    }  # fmt: skip
    return dataclasses.replace(
        load_machine("aurora"), tiles_per_node=4, device_type="cpu", calibration=calibration
    )


def _small() -> MulaConfig:
    return MulaConfig.from_name("mula-tiny-moe", **{**OVERRIDES, "num_layers": 2})


def test_the_factor_is_the_split_time_less_its_collectives_over_the_share():
    machine = _machine({
        "tp": {2: {"whole": 0.02, "split": 0.08, **SHAPE}},
        "cp": {2: {"whole": 0.02, "split": 0.04, **SHAPE}},
    })  # fmt: skip
    small = _small()
    layout = Layout(world_size=2, tp_size=2, micro_batch=2, seq_len=64)
    nbytes, calls = tensor_parallel_sends(small, layout, [0, 1], True, True, partial_grads=False)
    assert split_factor(machine, "tp", 2, 4) == pytest.approx((0.08 - calls * CALL - BETA * nbytes) / 0.01)
    layout = Layout(world_size=2, cp_size=2, micro_batch=2, seq_len=64)
    nbytes, calls = context_parallel_sends(small, layout, [0, 1])
    calls += context_parallel_router_calls(small, layout, [0, 1])
    assert split_factor(machine, "cp", 2, 4) == pytest.approx((0.04 - calls * CALL - BETA * nbytes) / 0.01)
    # nothing measured: no factor (another kind, another dtype, no group)
    assert split_factor(machine, "tp_sp", 2, 4) == split_factor(machine, "tp", 2, 2) == 1.0
    assert split_factor(machine, "tp", 1, 4) == 1.0


def test_a_split_is_never_priced_below_its_share_and_experts_share_nothing():
    fast = _machine({"tp": {2: {"whole": 0.02, "split": 0.001, **SHAPE}}})
    assert split_factor(fast, "tp", 2, 4) == 1.0
    ep = _machine({"ep": {2: {"whole": 0.02, "split": 0.05, **SHAPE}}})
    factor = split_factor(ep, "ep", 2, 4)  # a rank computes its own micro-batch: whole, not whole / 2
    assert 1.0 < factor < 0.05 / 0.02


def test_step_time_multiplies_a_split_ranks_compute_by_its_factors():
    splits = {
        "tp": {2: {"whole": 0.02, "split": 0.08, **SHAPE}},
        "cp": {2: {"whole": 0.02, "split": 0.04, **SHAPE}},
        "ep": {2: {"whole": 0.02, "split": 0.05, **SHAPE}},
    }
    machine, bare = _machine(splits), _machine({})
    config = MulaConfig.from_name("mula-tiny-moe", **OVERRIDES)
    for layout, kinds in (
        (Layout(world_size=2, tp_size=2, micro_batch=2, seq_len=64, micro_batches=2), ("tp",)),
        (Layout(world_size=2, cp_size=2, micro_batch=2, seq_len=64, micro_batches=2), ("cp",)),
        (
            Layout(world_size=4, tp_size=2, ep_size=2, micro_batch=2, seq_len=64, micro_batches=2),
            ("tp", "ep"),
        ),
    ):
        factor = 1.0
        for kind in kinds:
            factor *= split_factor(machine, kind, 2, 4)
        assert factor > 1 and layout_split_factor(machine, layout) == pytest.approx(factor)
        t, plain = step_time(config, layout, machine, 8), step_time(config, layout, bare, 8)
        assert t.compute_s == pytest.approx(factor * plain.compute_s)
        assert (
            t.tensor_parallel_s == plain.tensor_parallel_s
            and t.context_parallel_s == plain.context_parallel_s
        )
