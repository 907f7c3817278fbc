"""Step-time model: compute at an assumed matmul efficiency plus the communication a layout adds.

Per optimizer step, on one rank of the slowest pipeline stage (one stage per node, EP inside a node):

* compute: `flops_per_token` of the step's tokens over W ranks (plus the forward of what activation
  checkpointing recomputes), at `peak * compute_mfu` of the machine;
* communication volumes (`comm_volumes`, bytes one rank sends per step, per pipeline rank), each over
  its bandwidth:
  - expert all-to-all: per MoE layer and micro-batch, tokens * top_k rows of `hidden` elements in the
    compute dtype leave each rank with probability (E-1)/E, twice in forward (dispatch, combine),
    twice in backward, twice more when the MoE block is recomputed; at the intra-node bandwidth when
    the EP group fits a node, else inter-node;
  - gradient reduce-scatter and parameter all-gather of the sharded optimizer's flat buckets (padding
    included), dense over the stage's W/P ranks and experts over their EDP group, (n-1)/n of each
    bucket (ZeRO-2: once per micro-batch), or the all-reduce of replicated AdamW (twice that, in the
    parameters' dtype); the reduction overlaps the last micro-batch's backward, the all-gather
    overlaps nothing unless `overlap_param_gather` (on CPU ranks neither overlaps: gloo works on the
    cores that compute);
  - tensor parallelism (`tensor_parallel_sends`), per micro-batch, over the T ranks of a node: the
    all-reduce of every row-parallel output (forward) and of every column-parallel input's gradient
    (backward), or under sequence parallelism the all-gather of each layer's input and reduce-scatter
    of its output (and the reverse in backward); the QK-norm sums over split heads, the
    vocabulary-parallel loss's three per-token reductions, and, under SP, the all-reduce of the
    replicated norm weights' partial gradients; not overlapped with compute;
  - context parallelism (`context_parallel_sends`), per attention layer and micro-batch, over the C
    ranks of a node: Ulysses' all-to-all of q, k and v and that of the output, (C-1)/C of each
    leaving the rank, forward and backward (and the forward again when attention is recomputed); not
    overlapped with compute;
  - pipeline: the activations and their gradients each rank sends to its neighbouring stages (the
    residual stream in the parameters' dtype, plus the two fp32 router-loss sums of an MoE model),
    inter-node; and the bubble (P-1)/(v*m) of the stage's compute and all-to-all time.

Volumes are counted as a bandwidth-optimal algorithm moves them (the "bus bytes" of nccl-tests): what
an all-to-all sends to other ranks, (n-1)/n of a reduce-scatter's or all-gather's buffer, 2(n-1)/n of
an all-reduce's. tests/test_plan_volumes.py and tests/test_plan_volumes_tp.py check them against the
bytes real runs hand to these collectives. The all-to-all is not overlapped with compute (Mula's dispatcher is synchronous).
The optimizer update's elementwise passes and the training loop's fixed work per step and micro-batch
are priced from a calibrated machine file (`mula.plan.step_overheads`); compute is the calibrated rate
of whole forward + backward passes (router, norms and kernel launches inside it).
"""

from __future__ import annotations

from dataclasses import dataclass

from mula.model.activation_checkpointing import parse_activation_checkpointing
from mula.model.config import MulaConfig
from mula.model.param_names import MUON_NS_DTYPES
from mula.plan.calibrated import collective_seconds, compute_flops_per_s, node_calls_seconds
from mula.plan.grad_reduction import optimizer_volumes, reduction_overhead_seconds
from mula.plan.layout import Layout
from mula.plan.machines import Machine
from mula.plan.memory import stage_key, stage_params
from mula.plan.parameters import model_parameters
from mula.plan.split_compute import layout_split_factor
from mula.plan.split_volumes import (
    context_parallel_router_calls,
    context_parallel_sends,
    expert_all_to_all_sends,
    tensor_parallel_sends,
)
from mula.plan.step_overheads import loop_seconds, newton_schulz_flops, update_bytes, update_seconds


@dataclass
class StepTime:
    """Seconds per optimizer step by part, and the derived throughput."""

    compute_s: float
    all_to_all_s: float
    grad_sync_s: float
    param_gather_s: float
    pipeline_s: float
    tokens_per_step: int
    flops_per_step: float
    world_size: int
    peak_flops: float
    tensor_parallel_s: float = 0.0
    context_parallel_s: float = 0.0
    optimizer_s: float = 0.0
    loop_s: float = 0.0

    @property
    def step_time_s(self) -> float:
        """Predicted wall time of one optimizer step."""
        parts = self.all_to_all_s + self.grad_sync_s + self.param_gather_s + self.pipeline_s
        rest = self.tensor_parallel_s + self.context_parallel_s + self.optimizer_s + self.loop_s
        return self.compute_s + parts + rest

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second over the whole job."""
        return self.tokens_per_step / self.step_time_s

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: the model's training FLOPs over the job's peak."""
        return self.flops_per_step / (self.step_time_s * self.world_size * self.peak_flops)

    def as_dict(self) -> dict[str, float]:
        """Parts, total, tokens/s and MFU."""
        keys = (
            "compute_s",
            "all_to_all_s",
            "grad_sync_s",
            "param_gather_s",
            "pipeline_s",
            "tensor_parallel_s",
            "context_parallel_s",
            "optimizer_s",
            "loop_s",
        )
        out = {k: getattr(self, k) for k in keys}
        return {**out, "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu}


def _recompute_flops_per_token(config: MulaConfig, layout: Layout, index: int) -> float:
    """Forward FLOPs per token of block `index` that activation checkpointing runs a second time."""
    parts = parse_activation_checkpointing(layout.checkpointing)
    attn = 2 * config._attn_matmul_params() + 2 * config.attention_core_width * layout.seq_len
    mlp = 2 * (config.layer_matmul_params(index) - config._attn_matmul_params())
    if "full" in parts:
        return attn + mlp
    moe = config.is_moe_layer(index)  # "moe" recomputes MoE layers only, never a dense MLP
    return (attn if "attention" in parts else 0) + (mlp if "moe" in parts and moe else 0)


@dataclass
class Volumes:
    """Bytes one pipeline rank sends per optimizer step, by collective (bus bytes, module docstring).

    all_to_all: expert token rows (every pass); grad_reduce: the gradient reduce-scatters (sharded
    optimizer) or all-reduces (replicated AdamW), dense and expert buckets; param_gather: the sharded
    optimizer's parameter all-gathers; pipeline: activations and gradients sent to neighbouring stages;
    grad_rounds: gradient reductions per step (the micro-batches under ZeRO-2, else 1); tensor_parallel:
    the tensor-parallel group's collectives (`tensor_parallel_sends`). The `*_calls` are the messages
    behind each volume (collective calls, pipeline send operations), which a calibrated machine prices
    at its latency each: the all-to-alls include the expert-count exchange (and, where the CPU expert
    layout folds the combine weights in, the weights' exchange). context_parallel: Ulysses' head
    all-to-alls (`context_parallel_sends`), context_parallel_calls their calls and the router-loss
    totals' (`context_parallel_router_calls`); tensor_parallel_calls:
    DTensor's collective calls behind `tensor_parallel`; grad_bucket_bytes: the gradient bytes the
    sharded optimizer's buckets take (`mula.plan.grad_reduction.optimizer_volumes`), which its reducer writes
    every micro-batch.
    """

    all_to_all: float = 0.0
    grad_reduce: float = 0.0
    param_gather: float = 0.0
    pipeline: float = 0.0
    grad_rounds: int = 1
    tensor_parallel: float = 0.0
    all_to_all_calls: float = 0.0
    grad_reduce_calls: float = 0.0
    param_gather_calls: float = 0.0
    pipeline_calls: float = 0.0
    context_parallel: float = 0.0
    context_parallel_calls: float = 0.0
    tensor_parallel_calls: float = 0.0
    grad_bucket_bytes: float = 0.0


def _pipeline_sends(config: MulaConfig, layout: Layout, stages: tuple[int, ...]) -> float:
    """Bytes a pipeline rank holding `stages` sends to other stages per step: for each of its (virtual) stages,
    every micro-batch's output forward (not from the last stage) and input gradient backward (not from
    the first), the residual stream in the parameters' dtype plus an MoE model's router-loss sums. Under
    tensor parallelism each TP rank sends to its peer of the next stage: the whole sequence (replicated
    over TP), or its 1/T with sequence parallelism; under context parallelism each CP rank its 1/C."""
    if layout.pp_size == 1:
        return 0.0
    seq = layout.local_seq_len // layout.tp_size if layout.sequence_parallel else layout.local_seq_len
    message = layout.micro_batch * seq * config.hidden_size * layout.param_bytes
    message += 2 * 4 if config.is_moe else 0  # (aux, z) running sums, fp32
    return _pipeline_send_count(layout, stages) * max(1, layout.micro_batches) * message


def _pipeline_send_count(layout: Layout, stages: tuple[int, ...]) -> int:
    """Stage-to-stage sends per micro-batch of a rank holding `stages` (forward and backward)."""
    last = layout.parallel.num_stages - 1
    return sum((s < last) + (s > 0) for s in stages)


_VOLUME_CACHE: dict[tuple, tuple[float, float, int, int, float]] = {}


def comm_volumes(config: MulaConfig, layout: Layout) -> list[Volumes]:
    """Bytes each pipeline rank (one entry per rank of the pipeline, the first first) sends per step."""
    params = model_parameters(config, tuple(layout.no_decay), layout.optimizer)
    stages = layout.stage_holdings(config)
    m = max(1, layout.micro_batches)
    rounds = m if layout.shard_optimizer and layout.zero_stage == 2 else 1
    out = []
    for holds in stages:
        a2a, a2a_calls = expert_all_to_all_sends(config, layout, holds.blocks)
        key = stage_key(config, layout, tuple(holds.blocks), holds.first, holds.last)
        if key not in _VOLUME_CACHE:
            if len(_VOLUME_CACHE) > 4096:  # bounded, as memory.stage_state's
                _VOLUME_CACHE.clear()
            held = stage_params(params, holds.blocks, holds.first, holds.last)
            _VOLUME_CACHE[key] = optimizer_volumes(held, layout)
        reduce, gather, reduce_calls, gather_calls, bucket_bytes = _VOLUME_CACHE[key]
        sends = _pipeline_sends(config, layout, holds.stages)
        # each send carries the residual stream and, for an MoE model, the router-loss sums: two operations
        send_calls = _pipeline_send_count(layout, holds.stages) * m * (2 if config.is_moe else 1)
        send_calls = send_calls if layout.pp_size > 1 else 0
        tp, tp_calls = tensor_parallel_sends(config, layout, holds.blocks, holds.first, holds.last)
        cp, cp_calls = context_parallel_sends(config, layout, holds.blocks)
        cp_calls += context_parallel_router_calls(config, layout, holds.blocks)
        out.append(
            Volumes(
                a2a,
                rounds * reduce,
                gather,
                sends,
                rounds,
                tp,
                a2a_calls,
                rounds * reduce_calls,
                gather_calls,
                send_calls,
                cp,
                cp_calls,
                tp_calls,
                bucket_bytes,
            )  # fmt: skip
        )
    return out


def step_time(config: MulaConfig, layout: Layout, machine: Machine, global_batch: int) -> StepTime:
    """Predicted step time of training `config` with `layout` on `machine` at `global_batch` sequences."""
    w, p, e = layout.world_size, layout.pp_size, layout.ep_size
    tokens = global_batch * layout.seq_len
    flops = float(config.flops_per_token(layout.seq_len)) * tokens
    peak = machine.peak_bf16_tflops * 1e12
    # the slowest stage's blocks (dense first blocks weigh less than MoE ones) and, on the last stage,
    # the LM head with the loss, each at its own rate (a calibrated machine measures both)
    core = 6 * config.attention_core_width * layout.seq_len  # QK^T and AV, forward and backward
    block = [6 * config.layer_matmul_params(i) + core for i in range(config.num_blocks)]  # MTP's too
    head = flops / tokens - sum(block)  # the LM head's FLOPs per token (and the MTP modules' heads)
    rank_tokens = tokens / (
        w / p
    )  # a stage's tokens over its ranks (a TP or CP rank: 1/T or 1/C of the work)
    cb = layout.compute_bytes

    # a TP or CP rank computes its share at the split's calibrated cost (mula.plan.split_compute)
    split = layout_split_factor(machine, layout)

    def stage_seconds(layers: list[int], last: bool) -> float:
        extra = sum(_recompute_flops_per_token(config, layout, i) for i in layers)
        seconds = sum(block[i] for i in layers) * rank_tokens / compute_flops_per_s(machine, cb)
        seconds += extra * rank_tokens / compute_flops_per_s(machine, cb, forward=True)
        seconds += last * head * rank_tokens / compute_flops_per_s(machine, cb, head=True)
        return split * seconds

    compute = max(stage_seconds(held.blocks, held.last) for held in layout.stage_holdings(config))

    intra, inter = machine.intra_node_gbps * 1e9, machine.inter_node_gbps * 1e9
    node = machine.tiles_per_node
    # each volume of the pipeline rank that sends the most of it
    per_rank = comm_volumes(config, layout)
    vol = Volumes(*(max(getattr(v, f) for v in per_rank) for f in Volumes.__dataclass_fields__))
    # the expert all-to-alls block between pieces of compute (count exchange, dispatch, combine), as TP's
    # collectives do: inside a node each call costs the calibrated price of such a call
    if e <= node:
        a2a = node_calls_seconds(machine, "all_to_all", e, vol.all_to_all, vol.all_to_all_calls, intra)
    else:
        a2a = collective_seconds(machine, "all_to_all", e, True, vol.all_to_all, vol.all_to_all_calls, inter)
    # a stage's ranks fill whole nodes before spanning more; EDP ranks are E apart, so both groups
    # leave the node once the stage does
    spans = layout.replica_size > node
    bw = inter if spans else intra
    # beyond one network group the data-parallel collectives share the global links (contention)
    contention = machine.cross_group_slowdown(layout.replica_size / node) if spans else 1.0
    reduce_kind = "reduce_scatter" if layout.shard_optimizer else "all_reduce"
    m = max(1, layout.micro_batches)
    # one micro-batch's backward, which a gradient reduction overlaps; on CPU ranks none: gloo's
    # reductions run on the cores that compute, so they add their time
    backward = 0.0 if layout.device_type == "cpu" else compute * 2 / 3 / m
    # ZeRO-2 reduces after every micro-batch, everything else once, during the last backward
    rounds = vol.grad_rounds
    one_round = collective_seconds(
        machine, reduce_kind, layout.replica_size, spans, vol.grad_reduce / rounds, vol.grad_reduce_calls / rounds, bw,
        contention,
    )  # fmt: skip
    grad_sync = rounds * max(0.0, one_round - backward)
    # the reducer's own work around its collectives: bucket copies, ZeRO-2's fresh buffers and landings
    grad_sync += reduction_overhead_seconds(machine, layout, vol.grad_bucket_bytes)
    gather = collective_seconds(
        machine, "all_gather", layout.replica_size, spans, vol.param_gather, vol.param_gather_calls, bw,
        contention,
    )  # fmt: skip
    if layout.overlap_param_gather and layout.device_type != "cpu":
        gather = max(0.0, gather - compute / 3 / m)

    pipeline = 0.0
    if p > 1:
        # a stage waits on each send/recv between its micro-batches' computes: on one node, at the same
        # calibrated per-call price
        if w > node:
            sends = collective_seconds(machine, "send_recv", 2, True, vol.pipeline, vol.pipeline_calls, inter)
        else:
            sends = node_calls_seconds(machine, "send_recv", 2, vol.pipeline, vol.pipeline_calls, intra)
        pipeline = (p - 1) / (layout.pp_virtual_stages * m) * (compute + a2a) + sends
    # the TP and CP groups stay on a node's fabric (Ulysses' C ranks next to TP); their calls are
    # functional collectives between pieces of compute, each at its calibrated price when measured
    # (else the collective's own latency: the all-reduce's for TP's all-reduces, gathers and scatters)
    tp = node_calls_seconds(
        machine, "all_reduce", layout.tp_size, vol.tensor_parallel, vol.tensor_parallel_calls, intra
    )
    cp = node_calls_seconds(
        machine, "all_to_all", layout.cp_size, vol.context_parallel, vol.context_parallel_calls, intra
    )
    optimizer = update_seconds(machine, update_bytes(config, layout))
    optimizer += newton_schulz_flops(config, layout) / compute_flops_per_s(
        machine, MUON_NS_DTYPES[layout.muon_ns_dtype]
    )
    loop = loop_seconds(machine, layout)
    return StepTime(
        compute, a2a, grad_sync, gather, pipeline, tokens, flops, w, peak, tp, cp, optimizer, loop
    )
