"""The sharded optimizer's gradient reduction in a step: the volumes of its collectives per round (the
flat buckets as strategies/optim/grad_reduce.py lays them out) and the reducer's own work beyond them.

The collectives' curves price what the reduce-scatters and all-gathers move. Around them the reducer
works on every micro-batch: it copies each gradient (scaled) into its bucket or adds it to what the
bucket holds, under ZeRO-2 into a bucket buffer allocated afresh every round, whose shard then lands by
an add, and a reduction in flight slows the backward it runs beside (gloo reduces on the cores that
compute). `mula calibrate` times it (`strategies.calibrate.reduction`): a small model's step of two
micro-batches without an optimizer and with the strategy's sharded AdamW at each ZeRO stage over a
group of a node (reducing, updating and gathering, as between two training steps). The difference less
what the planner prices of it -- the reduction's and the gather's collectives and the update's bytes --
per bucket byte and micro-batch, is the reducer's overhead:

    overhead per byte = (reduced seconds - plain seconds - rounds * one round's reduction
                         - the gather - the update) / (micro-batches * bucket bytes)

`reduction_overhead_seconds` charges a layout that many seconds per byte of its buckets and
micro-batch, at its ZeRO stage and the nearest measured group size (at least 0: where a device overlaps
the reduction with backward, the overlap already appears in the measurement, and a negative remainder
is the collectives' pricing error, kept rather than hidden here). Without a calibration (or one
measured without it, or at another dtype) the overhead is 0.
"""

from __future__ import annotations

import dataclasses

from mula.layout.flat_buffers import Bucket, plan_buckets
from mula.layout.muon_exchange import exchange_volume
from mula.model.config import MulaConfig
from mula.model.param_names import MUON_NS_DTYPES
from mula.plan.calibrated import collective_seconds, nearest_group
from mula.plan.layout import Layout
from mula.plan.machines import Machine
from mula.plan.memory import optimizer_entries, sharded_buckets, stage_params
from mula.plan.parameters import model_parameters
from mula.plan.step_overheads import update_bytes, update_seconds


def _ring(numel: int, elem_bytes: int, group: int) -> float:
    """Bus bytes of one reduce-scatter or all-gather of `numel` elements over `group` ranks."""
    return 0.0 if group <= 1 else numel * elem_bytes * (group - 1) / group


KindVolumes = dict[str, list[float]]  # collective kind (`mula.plan.collective_kinds.KINDS`) -> [bytes, calls]


def add_volume(volumes: KindVolumes, kind: str, nbytes: float, calls: float) -> None:
    """Add `calls` collectives of `kind` moving `nbytes` in all to `volumes` (nothing for no call)."""
    if calls:
        entry = volumes.setdefault(kind, [0.0, 0.0])
        entry[0] += nbytes
        entry[1] += calls


def muon_exchange(buckets: list[Bucket], layout: Layout) -> KindVolumes:
    """Sharded Muon's exchange per step (strategies/optim/sharded_muon.py) of a rank whose optimizer
    buckets are `buckets`, by collective kind: per Muon bucket with peers, one all-to-all of the update's
    slices to their matrices' owners and one of the orthogonalised slices back, in `muon_ns_dtype`; the
    bytes the busiest rank sends (`mula.layout.muon_exchange.exchange_volume`, which also counts the
    exchange's transient buffers). The one place that plans it: `optimizer_collectives` counts it with
    the gather."""
    out: KindVolumes = {}
    if layout.optimizer == "muon":
        volume = exchange_volume(buckets, MUON_NS_DTYPES[layout.muon_ns_dtype])
        add_volume(out, "all_to_all", volume.sent, volume.calls)
    return out


def optimizer_collectives(params: list, layout: Layout) -> tuple[KindVolumes, KindVolumes, float]:
    """(gradient reduction per round, parameter gather per step) of one rank holding `params`, by
    collective kind (bus bytes and calls), and the gradient bytes the sharded optimizer's buckets take
    (padding included, in the reduction's dtype: what its reducer writes every micro-batch; 0 for
    replicated AdamW), from one plan of the buckets. Sharded Muon's exchange (`muon_exchange`) counts
    with the gather."""
    reduce: KindVolumes = {}
    gather: KindVolumes = {}
    if not layout.shard_optimizer:
        # torch AdamW: every gradient (the local tensor-parallel shard) is all-reduced once, unpadded,
        # in the parameters' dtype, bucketed as the sharded optimizer would bucket it (grad_sync.py)
        entries = optimizer_entries(params, layout)
        dense = sum(e.numel for e in entries if e.domain == "dense")
        expert = sum(e.numel for e in entries if e.domain == "expert")
        pb = layout.param_bytes
        groups = {"dense": layout.replica_size, "expert": layout.edp_cp_size}
        calls = sum(b.group_size > 1 for b in plan_buckets(entries, groups, layout.bucket_numel, 1))
        ring = _ring(dense, pb, layout.replica_size) + _ring(expert, pb, layout.edp_cp_size)
        add_volume(reduce, "all_reduce", 2 * ring, calls)
        return reduce, gather, 0.0
    # the sharded optimizer's own buckets (strategies.optim.grad_reduce.make_domains): dense sharded over the
    # stage's ranks (EP-unaware: over EDP, the bucket all-reduced over the stage), experts over EDP
    buckets = sharded_buckets(params, layout)
    # gloo has no reduce-scatter / all-gather: "rooted" runs one reduce / broadcast per shard
    rooted = layout.collectives == "rooted"
    for b in buckets:
        shards = 0 if b.group_size == 1 else b.group_size if rooted else 1
        if b.domain == "dense" and not layout.ep_aware:
            # one all-reduce over the stage
            moved = 2 * _ring(b.numel, layout.reduce_bytes, layout.replica_size)
            add_volume(reduce, "all_reduce", moved, int(layout.replica_size > 1))
        else:
            kind = "reduce" if rooted else "reduce_scatter"
            add_volume(reduce, kind, _ring(b.numel, layout.reduce_bytes, b.group_size), shards)
        moved = _ring(b.numel, layout.param_bytes, b.group_size)
        add_volume(gather, "broadcast" if rooted else "all_gather", moved, shards)
    for kind, (nbytes, calls) in muon_exchange(buckets, layout).items():
        add_volume(gather, kind, nbytes, calls)
    held = float(sum(b.numel for b in buckets) * layout.reduce_bytes)
    return reduce, gather, held


def optimizer_volumes(params: list, layout: Layout) -> tuple[float, float, int, int, float]:
    """(gradient reduction, parameter gather) bus bytes per round of one rank holding `params`, the
    collective calls behind each (per round), and the gradient bytes the sharded optimizer's buckets take
    (`optimizer_collectives`, summed over the kinds of collective)."""
    reduce, gather, held = optimizer_collectives(params, layout)

    def total(volumes: KindVolumes, i: int) -> float:
        return sum(v[i] for v in volumes.values())

    return total(reduce, 0), total(gather, 0), int(total(reduce, 1)), int(total(gather, 1)), held


def reduction_overhead_seconds(machine: Machine, layout: Layout, nbytes: float) -> float:
    """The reducer's own seconds per step beyond its collectives (module docstring) for a rank whose
    buckets hold `nbytes`: the calibrated seconds per byte and micro-batch at the layout's ZeRO stage
    and nearest measured group size, times the step's micro-batches. 0 without a data-parallel group, a
    sharded optimizer or a measurement."""
    if not layout.shard_optimizer or layout.replica_size <= 1 or nbytes <= 0:
        return 0.0
    cal = machine.calibration or {}
    dtype = "bfloat16" if layout.compute_bytes == 2 else "float32"
    sized = (cal.get("grad_reduction_s") or {}).get(dtype, {}).get(layout.zero_stage, {})
    if not sized:
        return 0.0
    key = nearest_group(sized, layout.replica_size)
    per_byte = overhead_per_byte(machine, sized[key], layout.zero_stage, int(key), dtype)
    return per_byte * max(1, layout.micro_batches) * nbytes


def overhead_per_byte(machine: Machine, measured: dict, zero_stage: int, group: int, dtype: str) -> float:
    """Seconds per bucket byte and micro-batch of the reducer's own work, from one measurement of
    `strategies.calibrate.reduction` (module docstring), at least 0."""
    cal = machine.calibration or {}
    config = dataclasses.replace(
        MulaConfig.from_name(cal["model"], **(cal.get("overrides") or {})),
        num_layers=int(measured["num_layers"]),
    )
    m = int(measured["micro_batches"])
    layout = Layout(
        world_size=group, micro_batch=int(measured["micro_batch"]), seq_len=int(measured["seq_len"]),
        micro_batches=m, precision="bf16-true" if dtype == "bfloat16" else "32-true", shard_optimizer=True,
        zero_stage=zero_stage, collectives="native", device_type=machine.device_type,
    )  # fmt: skip
    held = stage_params(
        model_parameters(config, tuple(layout.no_decay)), list(range(config.num_layers)), True, True
    )
    reduce, gather, reduce_calls, gather_calls, _ = optimizer_volumes(held, layout)
    rounds = m if zero_stage == 2 else 1
    intra = machine.intra_node_gbps * 1e9
    one_round = collective_seconds(machine, "reduce_scatter", group, False, reduce, reduce_calls, intra)
    priced = rounds * one_round + collective_seconds(
        machine, "all_gather", group, False, gather, gather_calls, intra
    )
    priced += update_seconds(machine, update_bytes(config, layout))
    own = float(measured["reduced"]) - float(measured["plain"]) - priced
    return max(0.0, own) / (m * float(measured["bucket_bytes"]))
