"""Prices from a calibrated machine file (`mula calibrate`): each collective by its own measured
latency and bandwidth at the nearest measured group size, compute at the model shapes' measured rate.

Without a calibration the step-time model falls back to the machine file's two bandwidths and its
assumed `compute_mfu` (mula.plan.step_time).
"""

from __future__ import annotations

import math
from typing import Any

from mula.calibrate.fit import Curve
from mula.plan.machines import Machine


def nearest_group(sized: dict, group: int) -> Any:
    """The key of `sized` (measurements per group size) nearest `group` in log2."""
    return min(sized, key=lambda g: abs(math.log2(int(g)) - math.log2(group)))


def curve(machine: Machine, kind: str, group: int, inter: bool) -> Curve | None:
    """The measured curve of collective `kind` (mula.calibrate.measure.COLLECTIVES) for a group of
    `group` ranks inside a node or across nodes (`inter`), at the nearest measured group size (in
    log2); inter-node curves fall back to intra-node ones on a one-node calibration. None when the
    machine is not calibrated."""
    if not machine.calibration:
        return None
    scopes = machine.calibration.get("collectives", {})
    sized = (scopes.get("inter") or {}).get(kind) if inter else None
    sized = sized or (scopes.get("intra") or {}).get(kind)
    if not sized:
        return None
    entry = sized[nearest_group(sized, max(group, 2))]
    return Curve(entry["alpha_s"], entry["beta_s_per_byte"], entry.get("max_error", 0.0))


def collective_seconds(
    machine: Machine,
    kind: str,
    group: int,
    inter: bool,
    bus_bytes: float,
    calls: float,
    bytes_per_s: float,
    slowdown: float = 1.0,
) -> float:
    """Seconds for `calls` calls of `kind` moving `bus_bytes` in total: the calibrated alpha + beta
    curve, else `bus_bytes / bytes_per_s` (the machine file's bandwidth, no latency); the bandwidth
    term `slowdown` times slower (contention on the global links, `Machine.cross_group_slowdown`)."""
    if group <= 1 or (bus_bytes == 0 and calls == 0):
        return 0.0
    measured = curve(machine, kind, group, inter)
    if measured is None:
        return slowdown * bus_bytes / bytes_per_s
    return calls * measured.alpha_s + slowdown * measured.beta_s_per_byte * bus_bytes


def compute_flops_per_s(
    machine: Machine, compute_bytes: int, forward: bool = False, head: bool = False
) -> float:
    """One rank's training FLOP/s in the compute dtype (`forward`: of a forward alone, what activation
    checkpointing runs again) of a block, or (`head`) of the rest of the model (embedding, final norm,
    LM head and loss, counted at the LM head's FLOPs): a calibrated machine's measured rate of whole
    forward + backward passes (everything that is not a matmul included), else of its matmuls alone,
    else the machine's peak bf16 FLOP/s times its assumed `compute_mfu`."""
    cal = machine.calibration or {}
    dtype = "bfloat16" if compute_bytes == 2 else "float32"
    training = cal.get("training_tflops", {}).get(dtype)
    if training:
        key = ("head_" if head and "head_step" in training else "") + ("forward" if forward else "step")
        return float(training[key]) * 1e12
    matmuls = cal.get("model_tflops", {}).get(dtype)
    if matmuls:
        return float(matmuls) * 1e12
    return machine.peak_bf16_tflops * 1e12 * machine.compute_mfu


def error_band(machine: Machine) -> float | None:
    """The largest relative residual of the calibration's fitted curves (None when not calibrated)."""
    if not machine.calibration:
        return None
    return float(machine.calibration.get("error_band", 0.0))


def functional_call_seconds(machine: Machine, group: int) -> float | None:
    """A small functional collective's measured seconds between computes (the price of each of the
    tensor- and context-parallel groups' calls, DTensor's and Ulysses'), at the nearest measured group
    size inside a node; None when the calibration has none (the collective's own latency prices them)."""
    sized = (machine.calibration or {}).get("functional_call_s")
    if not sized or group <= 1:
        return None
    return float(sized[nearest_group(sized, group)])


def node_calls_seconds(
    machine: Machine, kind: str, group: int, nbytes: float, calls: float, bytes_per_s: float
) -> float:
    """Seconds of a node-local group's functional collectives: `calls` at the calibrated functional call
    price (`functional_call_seconds`) plus the bytes at `kind`'s bandwidth, else `kind`'s own curve."""
    price = functional_call_seconds(machine, group)
    if price is None:
        return collective_seconds(machine, kind, group, False, nbytes, calls, bytes_per_s)
    return calls * price + collective_seconds(machine, kind, group, False, nbytes, 0.0, bytes_per_s)
