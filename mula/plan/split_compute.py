"""What splitting a model over tensor-, context- or expert-parallel ranks costs its compute, from a
calibration.

A rank of a T-way tensor-parallel group computes 1/T of every matmul, but at a lower rate than the whole
model's: smaller matmuls, DTensor's work on every operation (sharding rules, redistributions, the
wrappers around each functional collective) and the layers it does not split. Ulysses (C-way context
parallelism) packs and unpacks q, k, v and the output around its all-to-alls. Expert parallelism keeps
each rank's tokens but permutes them around its all-to-alls, whose calls block between computes.
`mula calibrate` times the same small model (`strategies.calibrate.splits`) whole and split by the strategy's
own functions on each group size of a node, forward + backward interleaved (`split_training_s`). Their
ratio less the split's collectives, priced as the planner prices them (`mula.plan.split_volumes`,
`node_calls_seconds`), is the split's compute factor:

    factor = (split seconds - its collectives' seconds) / (whole seconds / share)

where share is the group size for TP and CP (a rank computes 1/T or 1/C of the micro-batch) and 1 for
experts (a rank computes its own micro-batch); `mula.plan.step_time` multiplies a split rank's compute
by it. At least 1: a split never makes a
rank's share cheaper than its share of the whole (a measured factor below 1 means the collectives were
priced higher than they cost, and the prediction keeps that error rather than hiding it here). A layout
with several splits multiplies their factors. Without a calibration (or one measured without splits,
or at another dtype) the factor is 1.
"""

from __future__ import annotations

import dataclasses

from mula.model.config import MulaConfig
from mula.plan.calibrated import nearest_group, node_calls_seconds
from mula.plan.layout import Layout
from mula.plan.machines import Machine
from mula.plan.split_volumes import (
    context_parallel_router_calls,
    context_parallel_sends,
    expert_all_to_all_sends,
    tensor_parallel_sends,
)

SPLIT_KINDS = ("tp", "tp_sp", "cp", "ep")  # tensor parallel, with sequence parallelism, Ulysses, experts


def _collective_seconds(machine: Machine, kind: str, group: int, measured: dict, dtype: str) -> float:
    """The measured split's own collectives (one micro-batch's forward + backward of the small model
    `measured` describes), priced as `step_time` prices a layout's."""
    cal = machine.calibration or {}
    config = dataclasses.replace(
        MulaConfig.from_name(cal["model"], **(cal.get("overrides") or {})),
        num_layers=int(measured["num_layers"]),
    )
    layout = Layout(
        world_size=group, tp_size=group if kind in ("tp", "tp_sp") else 1, sequence_parallel=kind == "tp_sp",
        cp_size=group if kind == "cp" else 1, ep_size=group if kind == "ep" else 1,
        micro_batch=int(measured["micro_batch"]), seq_len=int(measured["seq_len"]),
        precision="bf16-true" if dtype == "bfloat16" else "32-true", device_type=machine.device_type,
    )  # fmt: skip
    blocks = list(range(config.num_layers))
    intra = machine.intra_node_gbps * 1e9
    if kind == "ep":
        nbytes, calls = expert_all_to_all_sends(config, layout, blocks)
        return node_calls_seconds(machine, "all_to_all", group, nbytes, calls, intra)
    if kind == "cp":
        nbytes, calls = context_parallel_sends(config, layout, blocks)
        calls += context_parallel_router_calls(config, layout, blocks)
        return node_calls_seconds(machine, "all_to_all", group, nbytes, calls, intra)
    nbytes, calls = tensor_parallel_sends(config, layout, blocks, True, True, partial_grads=False)
    return node_calls_seconds(machine, "all_reduce", group, nbytes, calls, intra)


def split_factor(machine: Machine, kind: str, group: int, compute_bytes: int) -> float:
    """The compute factor of a `kind` split (`SPLIT_KINDS`) over `group` ranks, at the nearest measured
    group size (module docstring); 1 without a measurement."""
    if group <= 1:
        return 1.0
    cal = machine.calibration or {}
    dtype = "bfloat16" if compute_bytes == 2 else "float32"
    sized = (cal.get("split_training_s") or {}).get(dtype, {}).get(kind, {})
    if not sized:
        return 1.0
    key = nearest_group(sized, group)
    measured, g = sized[key], int(key)
    own = float(measured["split"]) - _collective_seconds(machine, kind, g, measured, dtype)
    share = 1 if kind == "ep" else g
    return max(1.0, own / (float(measured["whole"]) / share))


def layout_split_factor(machine: Machine, layout: Layout) -> float:
    """The compute factor of `layout`'s splits: its TP's (with or without sequence parallelism), its CP's
    and its experts' (an EP group wider than a node at the nearest size measured inside one), multiplied."""
    tp = "tp_sp" if layout.sequence_parallel else "tp"
    cb = layout.compute_bytes
    factor = split_factor(machine, tp, layout.tp_size, cb) * split_factor(machine, "cp", layout.cp_size, cb)
    return factor * split_factor(machine, "ep", layout.ep_size, cb)
