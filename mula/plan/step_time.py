"""Step-time model: compute at an assumed matmul efficiency plus the communication a layout adds.

Per optimizer step, on one rank of the slowest pipeline stage (one stage per node, EP inside a node):

* compute: `flops_per_token` of the step's tokens over W ranks (plus the forward of what activation
  checkpointing recomputes), at `peak * compute_mfu` of the machine;
* expert all-to-all: per MoE layer and micro-batch, tokens * top_k * hidden rows leave each rank with
  probability (E-1)/E, twice in forward (dispatch, combine), twice in backward, twice more when the MoE
  block is recomputed; at the intra-node bandwidth when the EP group fits a node, else inter-node;
* gradient reduce-scatter and parameter all-gather (sharded optimizer) or all-reduce (replicated
  AdamW), dense over the stage's W/P ranks and experts over their EDP group, ring volumes
  (n-1)/n per element; the reduce-scatter overlaps the last micro-batch's backward, the all-gather
  overlaps nothing unless `overlap_param_gather`;
* pipeline: bubble (P-1)/(v*m) of the stage's compute and all-to-all time, and the activations sent
  between stages (inter-node).

The all-to-all is not overlapped with compute (Mula's dispatcher is synchronous). Everything else
that is real but small (router, norms, optimizer update, kernel launch latency) is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from mula.activation_checkpointing import parse_activation_checkpointing
from mula.config import MulaConfig
from mula.plan.layout import Layout
from mula.plan.machines import Machine
from mula.plan.memory import stage_layers, stage_params
from mula.plan.parameters import model_parameters


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

    @property
    def step_time_s(self) -> float:
        """Predicted wall time of one optimizer step."""
        return self.compute_s + self.all_to_all_s + self.grad_sync_s + self.param_gather_s + self.pipeline_s

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
        keys = ("compute_s", "all_to_all_s", "grad_sync_s", "param_gather_s", "pipeline_s")
        out = {k: getattr(self, k) for k in keys}
        return {**out, "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu}


def _recompute_flops_per_token(config: MulaConfig, layout: Layout) -> float:
    """Forward FLOPs per token and layer that activation checkpointing runs a second time."""
    parts = parse_activation_checkpointing(layout.checkpointing)
    h = config.hidden_size
    q = config.num_heads * config.head_size
    attn = 2 * config._attn_matmul_params() + 4 * q * layout.seq_len
    if config.is_moe:
        mlp = 2 * (config.num_experts * h + config.top_k * config._expert_params())
    else:
        mlp = 6 * h * config.intermediate_size
    if "full" in parts:
        return attn + mlp
    return (attn if "attention" in parts else 0) + (mlp if "moe" in parts and config.is_moe else 0)


def _ring_s(elements: int, elem_bytes: int, group: int, bandwidth: float) -> float:
    """One reduce-scatter or all-gather of `elements` over `group` ranks (ring volume)."""
    return 0.0 if group <= 1 else elements * elem_bytes * (group - 1) / group / bandwidth


def _stage_elements(config: MulaConfig, layout: Layout, stages: list[range]) -> tuple[int, int]:
    """The largest stage's dense elements and its local expert elements (one EP rank's share)."""
    params = model_parameters(config, tuple(layout.no_decay))
    dense = expert = 0
    for s, rng in enumerate(stages):
        held = stage_params(params, rng, s == 0, s == len(stages) - 1)
        dense = max(dense, sum(q.numel for q in held if not q.is_expert))
        expert = max(expert, sum(q.numel for q in held if q.is_expert) // layout.ep_size)
    return dense, expert


def step_time(config: MulaConfig, layout: Layout, machine: Machine, global_batch: int) -> StepTime:
    """Predicted step time of training `config` with `layout` on `machine` at `global_batch` sequences."""
    w, p, e = layout.world_size, layout.pp_size, layout.ep_size
    tokens = global_batch * layout.seq_len
    flops = float(config.flops_per_token(layout.seq_len)) * tokens
    peak = machine.peak_bf16_tflops * 1e12
    stages = stage_layers(config.num_layers, layout)
    layers = max(len(s) for s in stages)
    extra = _recompute_flops_per_token(config, layout) * layers * tokens / (w / p)
    compute = (flops / w * (layers * p / config.num_layers) + extra) / (peak * machine.compute_mfu)

    intra, inter = machine.intra_node_gbps * 1e9, machine.inter_node_gbps * 1e9
    node = machine.tiles_per_node
    rank_tokens = tokens / (w / p)  # tokens each rank of a stage processes per step
    a2a = 0.0
    if config.is_moe and e > 1:
        passes = 4 + (2 if parse_activation_checkpointing(layout.checkpointing) & {"moe", "full"} else 0)
        volume = rank_tokens * config.top_k * config.hidden_size * layout.compute_bytes * (e - 1) / e
        a2a = passes * layers * volume / (intra if e <= node else inter)

    # per-stage parameters: the largest stage's dense and local expert elements
    dense, expert = _stage_elements(config, layout, stages)
    dp, edp = layout.dp_size, layout.edp_size
    # a stage's ranks fill whole nodes before spanning more; EDP ranks are E apart, so both groups
    # leave the node once the stage does
    bw = intra if dp <= node else inter
    rb = layout.reduce_bytes if layout.shard_optimizer else layout.param_bytes
    reduce = _ring_s(dense, rb, dp, bw) + _ring_s(expert, rb, edp, bw)
    gather = _ring_s(dense, layout.param_bytes, dp, bw) + _ring_s(expert, layout.param_bytes, edp, bw)
    if (
        not layout.shard_optimizer
    ):  # an all-reduce moves both volumes, overlapping backward like a reduce-scatter
        reduce, gather = reduce + gather, 0.0
    m = max(1, layout.micro_batches)
    backward = compute * 2 / 3 / m  # one micro-batch's backward, which a reduce-scatter overlaps
    if layout.shard_optimizer and layout.zero_stage == 2:
        grad_sync = m * max(0.0, reduce - backward)  # ZeRO-2 reduce-scatters after every micro-batch
    else:
        grad_sync = max(0.0, reduce - backward)  # once, during the last micro-batch's backward
    if layout.overlap_param_gather:
        gather = max(0.0, gather - compute / 3 / m)

    pipeline = 0.0
    if p > 1:
        v = layout.pp_virtual_stages
        pipeline = (p - 1) / (v * m) * (compute + a2a)
        per_mb = layout.micro_batch * layout.seq_len * config.hidden_size * layout.compute_bytes
        pipeline += 2 * m * v * per_mb / inter  # activations forward, gradients backward
    return StepTime(compute, a2a, grad_sync, gather, pipeline, tokens, flops, w, peak)
