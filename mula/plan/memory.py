"""Per-rank memory of a training layout: parameters, gradients, optimizer state, activations and
buffers, predicted from the config and the layout alone (nothing is allocated).

Parameters, gradients and optimizer state are exact: they are laid out with the sharded optimizer's
own layout function (`mula.layout.flat_buffers.plan_buckets`) over the parameters in its registration order
(`mula.plan.parameters`), so the numbers equal what `EPShardedAdamW` allocates (and what
`MemoryMetrics` / `MoEMetrics` log: `mem/param_bytes`, `mem/grad_bytes`, `optim/state_bytes`,
`optim/param_bytes`). Activations come from `mula.plan.activations` (an estimate of the bytes saved
for backward); buffers are the communication buffers and the largest transient of a step.

With pipeline stages every stage is planned (`plan_stage`: the ranks of one stage, with their virtual
stages under interleaving) and the per-rank numbers are those of the stage with the largest total
(stage 0 keeps the most micro-batches in flight, the last one holds the LM head).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mula.layout.flat_buffers import Bucket, ParamEntry, plan_buckets
from mula.layout.muon_exchange import exchange_volume
from mula.model.config import MulaConfig
from mula.model.param_names import MUON_NS_DTYPES, muon_matrix_shape
from mula.plan.activations import activation_bytes, peak_activations, transient_bytes
from mula.plan.layout import Layout
from mula.plan.parameters import ParamSpec, model_parameters, tp_local_shape

COMPONENTS = ("params", "grads", "optimizer", "activations", "buffers")


@dataclass
class MemoryPlan:
    """Predicted bytes on one rank (the fullest pipeline stage's).

    params/grads/optimizer/activations/buffers: device bytes per component (`COMPONENTS`), `total`
    their sum. param_tensor_bytes: the parameters themselves without the flat buffers' alignment
    padding (`mem/param_bytes`); host_bytes: host memory per rank: the offloaded optimizer (`offload`:
    state, speculation's saved slices, gradient and parameter copies, `mem/host_optimizer_bytes`) plus,
    with asynchronous checkpoints (`async_checkpoint`), the staging copy of the rank's checkpoint state
    (its parameters and optimizer state).
    host_optimizer_bytes: the offloaded optimizer's part of host_bytes (`EPShardedAdamW.host_bytes`).
    stage: the pipeline stage these numbers belong to; activation_micro_batches: micro-batches whose
    activations that stage holds at its peak (fractional under interleaving: a virtual stage's
    micro-batch counts 1 / V).
    """

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    param_tensor_bytes: int
    host_bytes: int = 0
    stage: int = 0
    activation_micro_batches: int | float = 1
    host_optimizer_bytes: int = 0

    @property
    def total(self) -> int:
        """Device bytes per rank."""
        return sum(getattr(self, c) for c in COMPONENTS)

    def per_rank_bytes(self) -> dict[str, int]:
        """The components and their total, as `mula plan --format json` prints them."""
        return {**{c: getattr(self, c) for c in COMPONENTS}, "total": self.total}


def stage_params(
    params: Sequence[ParamSpec], layers: Sequence[int], first: bool, last: bool
) -> list[ParamSpec]:
    """Parameters a stage holds: its blocks, the embedding on the first, final norm and head on the last
    (with the multi-token prediction modules and, when the first stage is another, a copy of the embedding
    they read: split.py)."""
    mtp = any(".mtp." in f".{p.name}" for p in params)
    out = []
    for p in params:
        if p.layer is not None:
            keep = p.layer in layers
        else:
            keep = (first or (last and mtp)) if ".embed." in f".{p.name}." else last
        if keep:
            out.append(p)
    return out


def optimizer_entries(params: Sequence[ParamSpec], layout: Layout) -> list[ParamEntry]:
    """The optimizer's layout entries on one rank (expert stacks sliced to num_experts / E, dense layers
    to their local tensor-parallel shard: the DTensor parameters' local tensors)."""
    dtype = {4: "torch.float32", 2: "torch.bfloat16", 8: "torch.float64"}[layout.param_bytes]
    out = []
    for i, p in enumerate(params):
        shape = tp_local_shape(p.name, p.shape, layout.tp_size, p.tp_replicated)
        if p.is_expert:
            shape = (shape[0] // layout.ep_size, *shape[1:])
        n = 1
        for d in shape:
            n *= d
        domain = "expert" if p.is_expert else "dense"
        matrix = muon_matrix_shape(p.name, shape) if p.muon and layout.shard_optimizer else None
        out.append(ParamEntry(i, p.name, shape, n, dtype, p.group, domain, 0, n, shape, matrix))
    return out


def sharded_buckets(params: Sequence[ParamSpec], layout: Layout) -> list[Bucket]:
    """The sharded optimizer's flat buckets of a rank holding `params` (strategies.optim.grad_reduce's
    domains: dense sharded over the stage's ranks, or over EDP when EP-unaware; experts over EDP)."""
    dense_group = layout.replica_size if layout.ep_aware else layout.edp_cp_size
    return plan_buckets(
        optimizer_entries(params, layout), {"dense": dense_group, "expert": layout.edp_cp_size}, layout.bucket_numel,
        layout.align,
    )  # fmt: skip


def _state_bytes(params: Sequence[ParamSpec], layout: Layout) -> tuple[int, int, int, int, int, int, int]:
    """(params, param tensors, grads, optimizer, buffers, host, state) bytes of one rank holding `params`;
    with `offload` the optimizer's device bytes are 0 (the tail buckets aside) and host holds what
    `EPShardedAdamW.host_bytes` counts; state: the optimizer state wherever it lives (a checkpoint's)."""
    entries = optimizer_entries(params, layout)
    tensors = sum(e.numel for e in entries) * layout.param_bytes
    if not layout.shard_optimizer:
        # torch AdamW: every rank holds its parameters, a gradient each (or the all-reduce buckets,
        # the same elements) and exp_avg + exp_avg_sq in the parameters' dtype; `MulaMuon` keeps one
        # fp32 momentum per element of a Muon matrix instead
        muon = sum(e.numel for e, p in zip(entries, params) if p.muon)
        state = 2 * (tensors - muon * layout.param_bytes) + 4 * muon
        return tensors, tensors, tensors, state, 0, 0, state
    buckets = sharded_buckets(params, layout)
    full = sum(b.numel for b in buckets)
    shard = sum(b.shard_numel for b in buckets)
    params_alloc = full * layout.param_bytes  # strategies.optim.param_gather: one flat buffer per bucket
    grads = (shard + (full if layout.zero_stage == 1 else 0)) * layout.reduce_bytes
    # fp32 master + exp_avg + exp_avg_sq of the owned shard; a Muon bucket's: master + momentum
    saved = sum((8 if b.muon else 12) * b.shard_numel for b in buckets)
    optimizer = saved
    buffers = 0
    if layout.collectives == "native":
        # the all-gather's send buffer in the parameters' dtype, for every bucket with peers that is
        # bf16 or whose master shard comes from the host (offload, the tail buckets aside)
        host_side = len(buckets) - min(layout.offload_tail_buckets, len(buckets)) if layout.offload else 0
        buffers += layout.param_bytes * sum(
            b.shard_numel
            for i, b in enumerate(buckets)
            if b.group_size > 1 and (layout.param_bytes != 4 or i < host_side)
        )
    if layout.zero_stage == 2 and buckets:
        # a full bucket lives while its reduce-scatter is in flight: one reducing, one filling
        buffers += 2 * max(b.numel for b in buckets) * layout.reduce_bytes
    if layout.optimizer == "muon":
        # sharded Muon's exchange in flight: update slices, received matrices, Newton-Schulz scratch
        buffers += exchange_volume(buckets, MUON_NS_DTYPES[layout.muon_ns_dtype]).transient
    host = 0
    if layout.offload:  # strategies/optim/offload.py: the state and the slices speculation may restore
        # (12 per element each), the gradient shard's host copy and the cast master shard's send buffer;
        # the tail buckets keep their state on the device
        tail = min(layout.offload_tail_buckets, len(buckets))
        on_host = sum(b.shard_numel for b in buckets[: len(buckets) - tail])
        per_element = 24 if layout.offload_speculation else 12
        host = on_host * (per_element + layout.reduce_bytes + layout.param_bytes)
        optimizer = 12 * (shard - on_host)
    return params_alloc, tensors, grads, optimizer, buffers, host, saved


_STATE_FIELDS = ("ep_size", "tp_size", "replica_size", "edp_cp_size", "param_bytes", "reduce_bytes", "zero_stage", "bucket_numel",
                 "align", "ep_aware", "shard_optimizer", "collectives", "offload",
                 "offload_tail_buckets", "offload_speculation", "muon_ns_dtype")  # fmt: skip


def stage_key(config: MulaConfig, layout: Layout, layers: tuple[int, ...], first: bool, last: bool) -> tuple:
    """What a stage's optimizer layout (its parameters, buckets and their sharding) depends on: the key
    of the planner's memoised per-stage results (`--search` plans thousands of layouts)."""
    return (
        repr(config), tuple(layers), first, last,
        tuple(layout.no_decay), layout.optimizer, *(getattr(layout, f) for f in _STATE_FIELDS),
    )  # fmt: skip


def stage_state(
    config: MulaConfig, layout: Layout, layers: tuple[int, ...], first: bool, last: bool
) -> tuple[int, int, int, int, int, int, int]:
    """`_state_bytes` of one stage, memoised on what it depends on (`--search` plans many layouts)."""
    key = stage_key(config, layout, layers, first, last)
    if key not in _STATE_CACHE:
        if len(_STATE_CACHE) > 4096:  # bounded: a search visits a few hundred stages
            _STATE_CACHE.clear()
        params = model_parameters(config, tuple(layout.no_decay), layout.optimizer)
        _STATE_CACHE[key] = _state_bytes(stage_params(params, layers, first, last), layout)
    return _STATE_CACHE[key]


_STATE_CACHE: dict[tuple, tuple[int, int, int, int, int, int, int]] = {}


def plan_stage(config: MulaConfig, layout: Layout, stage: int) -> MemoryPlan:
    """Predicted bytes on a rank of pipeline stage `stage` (0 without a pipeline) training `config`."""
    p = layout.pp_size
    if not 0 <= stage < p:
        raise ValueError(f"stage {stage} is not one of the {p} pipeline stages.")
    held = layout.stage_holdings(config)[stage]  # refuses experts E does not divide, a bad split
    chunks, first, last = held.blocks_per_stage, held.first, held.last
    layers = tuple(held.blocks)
    p_alloc, tensors, grads, optimizer, buffers, host, state = stage_state(
        config, layout, layers, first, last
    )
    # the embedding rides with the first virtual stage of stage 0, the head with the last of stage P - 1
    per_micro_batch = [
        activation_bytes(config, layout, c, first=first and v == 0, last=last and v == len(chunks) - 1)
        for v, c in enumerate(chunks)
    ]
    act, in_flight = peak_activations(layout, stage, per_micro_batch)
    buffers += transient_bytes(config, layout, layers, last=last)
    staging = tensors + state if layout.async_checkpoint else 0  # mula.checkpoint.staging's host copy
    return MemoryPlan(
        p_alloc,
        grads,
        optimizer,
        act,
        buffers,
        tensors,
        host + staging,
        stage,
        in_flight,
        host_optimizer_bytes=host,
    )


def plan_memory(config: MulaConfig, layout: Layout) -> MemoryPlan:
    """Predicted per-rank bytes of training `config` with `layout` (the fullest pipeline stage)."""
    plans = [plan_stage(config, layout, s) for s in range(layout.pp_size)]
    return max(plans, key=lambda plan: plan.total)  # the first of equals
