"""The parts of a training step that are neither the model's compute nor communication: the optimizer
update's elementwise passes and the training loop's fixed work per step and per micro-batch.

* The optimizer update (`update_bytes`): bytes its passes over memory move on the pipeline rank that
  moves the most. The sharded AdamW (strategies/optim/) on its shard of n elements (padding included,
  the exact flat layout of `mula.plan.memory`): the global norm reads the gradient shard (reduce dtype),
  torch's fused AdamW reads master weights, gradient, exp_avg and exp_avg_sq and writes master,
  exp_avg and exp_avg_sq (fp32, the gradient in its reduce dtype), the gather copies the new master
  shard into the parameters' flat buffer (fp32 read, parameters' dtype written), and `zero_grad`
  writes the whole gradient buffer (full buckets under ZeRO-1, the shard under ZeRO-2); with optimizer
  offload only the buckets whose state stays on the device count (the host's update overlaps backward,
  docs/offload.md, and is not priced). With `model.optimizer: muon` the update adds Newton-Schulz
  (`newton_schulz_flops`: 3 matmuls per iteration of every matrix the rank orthogonalises) at the
  calibrated bf16 compute rate. Replicated
  torch AdamW (`shard_optimizer: false`, and a one-device run without XPUMoEStrategy) is not fused:
  torch's default is its single-tensor loop on CPU and its foreach kernels on CUDA and XPU, the same
  eight passes over every local parameter in the parameters' dtype, 20 words an element (decoupled
  decay: parameter read and written; exp_avg's lerp: 3; exp_avg_sq's mul and addcmul: 2 + 3; the
  denominator's sqrt, division and eps: 2 + 2 + 2; the parameter's addcdiv: 4); its gradients are
  freed, not zeroed. Priced at the calibrated elementwise bandwidth (`mula calibrate`); a machine file
  without one leaves the update out (it is a few milliseconds at HBM bandwidth).
* The loop's fixed work (`loop_seconds`): what Lightning's loop, hooks, logging and `zero_grad` cost
  per optimizer step and per micro-batch (training batch) beyond the model's forward and backward and
  the update, measured by `mula calibrate` on a model too small to compute anything
  (`mula.calibrate.loop`), plus the step's small collective: the all-reduce of the global gradient
  norm and non-finite count, priced at the all-reduce's latency (the loss sums' all-reduce runs once
  per logging interval, `log_every_n_steps`, and is left out).
"""

from __future__ import annotations

from typing import Any

from mula.layout.flat_buffers import matrix_owners
from mula.model.config import MulaConfig
from mula.model.param_names import muon_matrix_shape
from mula.plan.calibrated import collective_seconds
from mula.plan.layout import Layout
from mula.plan.machines import Machine
from mula.plan.memory import optimizer_entries, sharded_buckets, stage_params, stage_state
from mula.plan.parameters import model_parameters

# fused AdamW per element: master, gradient, exp_avg, exp_avg_sq read; master, exp_avg, exp_avg_sq written
_ADAMW_FP32_WORDS = 6  # the fp32 words besides the gradient's read
_TORCH_ADAMW_WORDS = 20  # torch.optim.AdamW's eight unfused passes per element (module docstring)
# the step's small all-reduce: the gradient norm with the non-finite count (strategies/optimizer_step.py)
STEP_ALL_REDUCES = 1


def update_bytes(config: MulaConfig, layout: Layout) -> float:
    """Bytes the optimizer step's elementwise passes move on the pipeline rank that moves the most
    (module docstring)."""
    worst = 0.0
    for held in layout.stage_holdings(config):
        _, tensors, grads, device_state, _, _, _ = stage_state(
            config, layout, tuple(held.blocks), held.first, held.last
        )
        if layout.shard_optimizer:
            # fp32 master + exp_avg + exp_avg_sq of the owned shard on the device (with offload, the
            # tail buckets': the host updates the rest during backward, docs/offload.md); Muon's
            # elements (8 state bytes: master, momentum) move about as many words (its lerps, the bf16
            # update and the decayed master), counted at AdamW's
            n = device_state // 12 if layout.optimizer != "muon" else _owned_elements(config, layout, held)
            rb = layout.reduce_bytes
            moved = n * (rb + _ADAMW_FP32_WORDS * 4 + rb + 4 + layout.param_bytes) + grads
        else:
            n = tensors // layout.param_bytes
            moved = n * _TORCH_ADAMW_WORDS * layout.param_bytes
        worst = max(worst, float(moved))
    return worst


def _owned_elements(config: MulaConfig, layout: Layout, held: Any) -> int:
    """Elements of one rank's optimizer shards (padding included) on the stage of `held`."""
    params = stage_params(
        model_parameters(config, tuple(layout.no_decay), layout.optimizer), held.blocks, held.first, held.last
    )
    return sum(b.shard_numel for b in sharded_buckets(params, layout))


def newton_schulz_flops(config: MulaConfig, layout: Layout) -> float:
    """Newton-Schulz FLOPs per optimizer step (`model.optimizer: muon`) on the rank that runs the most.

    One iteration on an [m, n] matrix with a = min(m, n), b = max(m, n) is three matmuls on its wide
    side: X X^T (2 a^2 b), the Gram matrix's square (2 a^3) and its product with X (2 a^2 b). Replicated,
    a rank runs it for every matrix it holds; sharded (strategies/optim/sharded_muon.py), for the matrices
    it owns (`matrix_owners`: the dense domain's busiest rank plus the expert domain's)."""
    if layout.optimizer != "muon":
        return 0.0
    steps = layout.muon_ns_steps

    def flops(rows: int, cols: int) -> int:
        a, b = min(rows, cols), max(rows, cols)
        return steps * (4 * a * a * b + 2 * a**3)

    params = model_parameters(config, tuple(layout.no_decay), layout.optimizer)
    worst = 0.0
    for held in layout.stage_holdings(config):
        mine = stage_params(params, held.blocks, held.first, held.last)
        if not layout.shard_optimizer:  # the rank's local tensors, as the optimizer sees them
            total = 0
            for p, entry in zip(mine, optimizer_entries(mine, layout)):
                if p.muon:
                    rows, cols = muon_matrix_shape(p.name, entry.shape)
                    total += entry.numel // (rows * cols) * flops(rows, cols)
            worst = max(worst, float(total))
            continue
        buckets = sharded_buckets(mine, layout)
        loads: dict[str, dict[int, int]] = {}
        for index, tasks in matrix_owners(buckets).items():
            domain = loads.setdefault(buckets[index].domain, {})
            for t in tasks:
                domain[t.owner] = domain.get(t.owner, 0) + flops(t.rows, t.cols)
        worst = max(worst, float(sum(max(d.values()) for d in loads.values())))
    return worst


def update_seconds(machine: Machine, nbytes: float) -> float:
    """Seconds of the update's `nbytes` at the calibrated elementwise bandwidth (0 without one)."""
    gbps = (machine.calibration or {}).get("elementwise_gbps")
    return nbytes / (float(gbps) * 1e9) if gbps else 0.0


def loop_seconds(machine: Machine, layout: Layout) -> float:
    """The training loop's fixed seconds per optimizer step: the calibrated per-step and per-micro-batch
    work (Lightning sees one batch per step under pipeline stages, the schedule runs the micro-batches)
    and the step's small all-reduces over the world. 0 on a machine file without the loop's calibration."""
    loop = (machine.calibration or {}).get("loop_s")
    if not loop:
        return 0.0
    batches = 1 if layout.pp_size > 1 else max(1, layout.micro_batches)
    small = collective_seconds(
        machine, "all_reduce", layout.world_size, layout.world_size > machine.tiles_per_node, 0.0,
        STEP_ALL_REDUCES, machine.intra_node_gbps * 1e9,
    )  # fmt: skip
    return float(loop["step"]) + batches * float(loop["batch"]) + small
