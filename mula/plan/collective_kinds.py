"""The bytes a step's collectives move, by kind of collective, as `mula bench` measures them
(`mula.bench.collectives.CollectiveMeter`, which says how each kind is counted): `comm_volumes`' volumes
as the `torch.distributed` calls carry them, plus what they leave out as too small to price (the expert
counts' and CPU combine weights' exchanges, the router-loss totals over context-parallel ranks, the
gradient norm's, the expert counts' and the pipeline's loss all-reduces).

Kinds: eager `all_to_all` (the expert dispatcher), `all_reduce`, `reduce_scatter`, `all_gather`,
`reduce` and `broadcast` (a gloo run's rooted pairs), `send_recv` (pipeline stages), and torch's
functional collectives: `functional` (DTensor's all-reduces, all-gathers and reduce-scatters, the
router-loss totals) and `functional_all_to_all` (Ulysses). Every collective a step issues moves as many
bytes into each rank as out of it (balanced routing, symmetric schedules), so the plan of the bytes
received is that of the bytes sent. Sharded Muon's exchange is planned for its busiest rank
(`mula.plan.grad_reduction.muon_exchange`); the others move less.
"""

from __future__ import annotations

from mula.model.config import MulaConfig
from mula.plan.grad_reduction import KindVolumes, add_volume, optimizer_collectives
from mula.plan.layout import Layout
from mula.plan.memory import stage_params
from mula.plan.parameters import model_parameters
from mula.plan.split_volumes import (
    context_parallel_router_bytes,
    context_parallel_router_calls,
    expert_all_to_all_extra,
)
from mula.plan.step_time import comm_volumes

KINDS = (
    "all_to_all",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "reduce",
    "broadcast",
    "send_recv",
    "functional",
    "functional_all_to_all",
)


def step_all_reduces(config: MulaConfig, layout: Layout) -> KindVolumes:
    """The step's small all-reduces beside the gradients': the global gradient norm with its non-finite
    flag (`strategies.optim.clipping` for the sharded optimizer: 3 fp32 over the stage's data-parallel
    ranks, the 2 of TP-split elements over the TP group, 2 over the stages; `strategies.optim.grad_sync`
    otherwise: 1 fp32 over the EP group, the TP group and the stages each), and an MoE model's expert
    counts of the step ([MoE layers, E] int64 over every rank, `mula.model.moe.balancing.step_counts`), and
    under pipeline stages the step's loss sum and token count (2 fp32 over every rank)."""
    out: KindVolumes = {}

    def add(nbytes: float, group: int) -> None:
        add_volume(out, "all_reduce", 2 * nbytes * (group - 1) / group, int(group > 1))

    if layout.shard_optimizer:
        add(3 * 4, layout.replica_size)
        add(2 * 4, layout.tp_size)
        add(2 * 4, layout.pp_size)
    else:
        add(4, layout.ep_size)
        add(4, layout.tp_size)
        add(4, layout.pp_size)
    if config.is_moe:
        add(config.num_moe_layers * config.num_experts * 8, layout.world_size)
    if layout.pp_size > 1:  # the step's loss sum and token count (strategies.pipeline.steps), fp32
        add(2 * 4, layout.world_size)
    return out


def planned_collectives(config: MulaConfig, layout: Layout) -> list[dict[str, dict[str, float]]]:
    """Per pipeline rank (the first stage's first): {"sent": {kind: bytes}, "received": {kind: bytes},
    "calls": {kind: calls}} of one optimizer step over every kind of `KINDS` (0 where none): `comm_volumes`
    by kind, the optimizer's collectives split by kind (`optimizer_collectives`), and the small
    exchanges it leaves out."""
    params = model_parameters(config, tuple(layout.no_decay), layout.optimizer)
    rounds = max(1, layout.micro_batches) if layout.shard_optimizer and layout.zero_stage == 2 else 1
    scalars = step_all_reduces(config, layout)
    out = []
    for holds, v in zip(layout.stage_holdings(config), comm_volumes(config, layout)):
        kinds: KindVolumes = {}
        extra = expert_all_to_all_extra(config, layout, holds.blocks)
        add_volume(kinds, "all_to_all", v.all_to_all + extra, v.all_to_all_calls)
        # every pipeline send has its receive on the neighbouring stage, and one comes back for it
        add_volume(kinds, "send_recv", v.pipeline, 2 * v.pipeline_calls)
        router_calls = context_parallel_router_calls(config, layout, holds.blocks)
        add_volume(kinds, "functional", v.tensor_parallel, v.tensor_parallel_calls)
        add_volume(
            kinds, "functional", context_parallel_router_bytes(config, layout, holds.blocks), router_calls
        )
        add_volume(
            kinds, "functional_all_to_all", v.context_parallel, v.context_parallel_calls - router_calls
        )
        held = stage_params(params, holds.blocks, holds.first, holds.last)
        reduce, gather, _ = optimizer_collectives(held, layout)
        for volumes, times in ((reduce, rounds), (gather, 1), (scalars, 1)):
            for kind, (nbytes, calls) in volumes.items():
                add_volume(kinds, kind, times * nbytes, times * calls)
        sent = {k: kinds.get(k, [0.0, 0.0])[0] for k in KINDS}
        calls = {k: kinds.get(k, [0.0, 0.0])[1] for k in KINDS}
        out.append({"sent": sent, "received": dict(sent), "calls": calls})
    return out
