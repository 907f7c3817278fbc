"""Bytes saved for backward by one micro-batch's forward, per activation-checkpointing setting.

An estimate of what `callbacks.memory_metrics.SavedTensorMeter` counts (`mem/activation_bytes`),
written op by op from `mula.model.transformer` and `mula.model.moe` (tests/test_plan_measured.py compares the two):
per token and layer, with h the hidden size, q/kv the attention projection widths, I the expert
(or MLP) width, K the top-k, E the experts, b the matmul dtype's bytes and r the residual stream's:

* a pre-norm (RMSNorm) saves its fp32 input, its rstd and its normalised output: 4h + 4 + r*h;
  its consumer saves the scaled output (b*h) -- shared by q/k/v, or by the router and the experts;
* attention: the q/k norms (as above on q and kv, with one rstd per head under `qk_norm_per_head`),
  SDPA's q, k, v, output and log-sum-exp (4*b*q + 4*heads; the output projection reads SDPA's output
  in place);
* router: logits and probabilities (softmax, or sigmoid scores) in fp32, z-loss log-sum-exp, top-k
  indices: 8E + 4 + 8K; sigmoid scoring adds the normalising sum (4), `norm_topk_prob` the kept
  weights and their sum (4K + 4);
* experts, per routed row: input, gate and up (b*(h + 2I)); the combine keeps the expert outputs
  (b*h) and weights; under expert parallelism the all-to-all dispatcher's send-plan index, and the
  combine weight riding with each row (CPU) or the returned rows and weights (GPU). On CPU without
  expert parallelism the bucketed padded layout (`mula.model.kernels.padded`) carries the combine weights
  per row instead; on CPU the layout
  also keeps gathered copies of the local expert weights (3*h*I*E_local elements). Routing is
  assumed balanced: every rank's experts receive tokens * K rows;
* dense MLP: gate, silu(gate), up and their product (4*b*I); the same for an MoE layer's shared
  experts (width num_shared_experts * their width) on the router's input;
* multi-head latent attention (`_latent_attention`): the latents' norms and projections' inputs,
  SDPA's q, k (qk width), v (the kv expansion's storage), output (v width) and log-sum-exp;
* tensor parallelism: heads and dense MLP features 1/T per rank (per-head QK-norm: one rstd per local
  head; MLA: its latents, their norms and the shared RoPE key whole on every rank, the q/kv expansions and
  SDPA by heads), and an MoE layer routes 1/T of the tokens (its experts whole:
  strategies/tensor_parallel_moe.py);
* context parallelism (Ulysses, strategies/context_parallel.py): every per-token term on 1/C of the
  sequence; SDPA's saved tensors are S tokens x heads / C, the same bytes as S / C tokens x heads,
  its q, k and v one buffer (the all-to-all's), so grouped KV heads add their k and v before the
  repeat (2*b*kv);
* mixed precision (fp32 weights, 16-bit autocast): every matmul keeps its own 16-bit copy of its input
  (q, k and v three) and of its weight (this rank's TP shard: MLA's down projections whole), outside
  recomputed parts;
* checkpointing keeps only a recomputed part's inputs: "norms" the residual (r*h) per norm, "attention"
  and "moe" their (already counted) normalised input, "full" each block's input (r*h).

Outside the blocks: the token ids, the final norm and LM head input, the cross-entropy's fp32
log-softmax (4V per token) and targets, and the RoPE tables.

With pipeline stages a stage holds several micro-batches at once: `peak_activations` walks the
stage's forwards and backwards in the schedule's order (`schedule_order`, torch's) and keeps the
largest sum (tests/test_plan_measured_pipeline.py compares it with measured runs).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from mula.model.activation_checkpointing import parse_activation_checkpointing
from mula.model.config import MulaConfig, numel
from mula.model.moe_capacity import capacity_of
from mula.plan.layout import Layout
from mula.plan.parameters import tp_local_shape
from mula.plan.split_volumes import dispatched_rows


def _norm(config: MulaConfig, dim: int, r: int, groups: int = 1) -> int:
    """Per-token bytes a norm over `dim` features saves (fp32 input, statistics, normalised output), the
    features normalised in `groups` independent groups (heads, under `qk_norm_per_head`)."""
    if config.norm == "rmsnorm":
        return 4 * dim + 4 * groups + r * dim
    # non-parametric LayerNorm: input, mean and rstd; its output is the consumer's
    return 4 * dim + 8 * groups


def _latent_attention(config: MulaConfig, b: int, t: int = 1) -> int:
    """Per-token bytes multi-head latent attention (`mula.model.mla`) saves beyond its normalised input,
    on one of `t` tensor-parallel ranks (num_heads / t heads; the latents whole on every rank).

    The q latent's norm (as a pre-norm on `q_lora_rank` features, its output saved by `q_b_proj`); the
    kv latent's norm (its fp32 input is a view of the `kv_a_proj_with_mqa` output when that is fp32
    already, so the whole output's storage counts: latent + RoPE key) and `kv_b_proj`'s input; SDPA's q,
    k, v and output, each `max(qk width, v width)` per head (the narrower side is zero-padded; an unpadded
    v is a view of `kv_b_proj`'s output, which then stays whole) and its log-sum-exp; `o_proj`'s input,
    a copy of the output's v columns. RoPE saves nothing per token (its tables only)."""
    heads, kv_rank, rope = config.num_heads // t, int(config.kv_lora_rank or 0), config.qk_rope_head_dim
    out = 0
    if config.q_lora_rank is not None:
        out += _norm(config, config.q_lora_rank, b) + b * config.q_lora_rank
    norm_input = 4 * (kv_rank + rope) if b == 4 else 4 * kv_rank
    out += norm_input + 4 + 2 * b * kv_rank  # + rstd, the normalised latent and the weight's product
    width = max(config.qk_head_size, config.v_head_size)
    out += 3 * b * heads * width + 4 * heads  # q, k, output; log-sum-exp
    if width != config.v_head_size:
        out += b * heads * width  # the zero-padded v
    else:  # v is a view of kv_b_proj's output: its whole storage (no-RoPE keys and values) stays
        out += b * heads * (config.qk_nope_head_dim + config.v_head_dim)
    return out + b * heads * config.v_head_size  # o_proj's input: a copy of the output's v columns


def _attention(config: MulaConfig, b: int, t: int = 1) -> int:
    """Per-token bytes attention saves beyond its (normalised) input, on one of `t` tensor-parallel ranks
    (each computes num_heads / t heads)."""
    if config.is_mla:
        return _latent_attention(config, b, t)
    heads = config.num_heads // t
    q = heads * config.head_size
    kv = config.kv_heads // t * config.head_size
    out = 4 * b * q + 4 * heads  # SDPA: q, k, v (kv repeated to q heads), output, lse
    if config.qk_norm:
        groups = (heads, config.kv_heads // t) if config.qk_norm_per_head else (1, 1)
        out += _norm(config, q, b, groups[0]) + _norm(config, kv, b, groups[1])
    return out


def _moe_per_token(config: MulaConfig, layout: Layout, b: int, r: int) -> int:
    """Per-token bytes of the router and the experts (weight copies excluded)."""
    e, k, h, i = config.num_experts, config.top_k, config.hidden_size, config.expert_intermediate_size
    router = 8 * e + 4 + 8 * k
    router += 4 if config.router_scoring == "sigmoid" else 0  # the sum normalising the scores
    router += 4 * k + 4 if config.norm_topk_prob else 0  # the renormalisation's inputs
    rows = b * (h + 2 * i)  # expert input, gate and up pre-activations
    capacity = capacity_of(config)
    if capacity is not None:
        # the fixed [E, C] slots (zero rows included), weights folded into the experts on every device
        rows += b + (8 if layout.ep_size > 1 else 0)
        tokens = max(1, layout.micro_batch * layout.local_seq_len)
        return router + round(dispatched_rows(config, layout) / tokens * rows)
    if layout.ep_size > 1:
        rows += 8  # the all-to-all dispatcher's send plan: its index, for the un-permute's backward
        if layout.device_type == "cpu":
            rows += b  # the padded layout folds the combine weight, which travels with the row
        else:  # the weighted un-permute keeps the returned rows (layer dtype) and weights; expert-plan index
            rows += r * h + 4 + 8
    elif layout.device_type == "cpu":
        rows += b  # combine weight per row, riding along in the padded layout
    else:
        rows += b * h + 4  # the un-permute keeps the expert outputs and weights for the weight gradient
    return router + k * rows


def _layer_bytes(config: MulaConfig, layout: Layout, parts: frozenset[str], tokens: int, moe: bool) -> int:
    """Bytes one block (an MoE block when `moe`, else a dense one) saves for one micro-batch of `tokens`
    tokens.

    Under mixed precision (fp32 weights, 16-bit autocast) every matmul saves its own 16-bit copy of its
    input and of its weight (the weights' copies only outside recomputed parts); a recomputed part
    keeps its fp32 input instead."""
    b, r, h = layout.compute_bytes, layout.param_bytes, config.hidden_size
    t = layout.tp_size
    # the norm and residual regions' tokens on this rank: all of them, or 1/T under sequence parallelism
    region = tokens // t if layout.sequence_parallel else tokens
    mixed = r > b
    if "full" in parts:
        return region * r * h
    e_local = config.num_experts // layout.ep_size
    weights = 0  # matmul weight elements whose autocast copies live until backward
    norm = (r * h) if "norms" in parts else _norm(config, h, r)
    per_token = 0
    if "attention" in parts:
        per_token += r * h if mixed else b * h  # the checkpoint's input: the normalised activation
    else:
        # q/k/v inputs (shared unless cast; under TP the whole sequence, all-gathered under SP), heads / T;
        # MLA reads it twice (the q and kv latent projections, or q_proj and the kv one)
        per_token += ((2 if config.is_mla else 3) if mixed else 1) * b * h + _attention(config, b, t)
        if layout.cp_size > 1 and not config.is_mla and config.kv_heads != config.num_heads:
            # Ulysses: SDPA's k and v are views of the exchanged buffer, repeated to the q heads apart
            per_token += 2 * b * (config.kv_heads // t) * config.head_size  # this TP rank's KV heads
        # this rank's shard of each projection: MLA's down projections stay whole under TP
        weights += sum(
            numel(tp_local_shape("attn." + name, shape, t))
            for name, shape in config._attn_shapes()
            if len(shape) == 2
        )
    moe_bytes = 0
    if moe:
        if "moe" in parts:  # the checkpoint's input: whole under TP alone, 1/T of the sequence under SP
            moe_bytes = region * (r * h if mixed else b * h)
        else:  # under TP each rank routes 1/T of the tokens (strategies/tensor_parallel_moe.py)
            moe_bytes = (tokens // t) * (b * h + _moe_per_token(config, layout, b, r))  # router input too
            weights += config.num_experts * h + (
                0 if layout.device_type == "cpu" else e_local * config._expert_params()
            )
            if config.num_shared_experts:  # a dense SwiGLU on the same input: gate/up casts, 4 features
                shared = config.shared_intermediate_size
                moe_bytes += (tokens // t) * ((2 * b * h if mixed else 0) + 4 * b * shared)
                weights += 3 * h * shared
    else:  # gate/up inputs (the whole sequence), the intermediate features split over T
        per_token += (2 if mixed else 1) * b * h + 4 * b * config.intermediate_size // t
        weights += 3 * h * config.intermediate_size // t
    out = tokens * per_token + moe_bytes + region * 2 * norm + (weights * b if mixed else 0)
    if moe and "moe" not in parts and layout.device_type == "cpu":
        # the padded layout gathers the local experts' weights in bucket order
        out += e_local * config._expert_params() * b
    return out


def activation_bytes(config: MulaConfig, layout: Layout, layers: range, *, first: bool, last: bool) -> int:
    """Bytes one micro-batch saves for backward on a stage holding blocks `layers` (and the embedding
    when `first`, the final norm, LM head and loss when `last`)."""
    parts = parse_activation_checkpointing(layout.checkpointing)
    tokens = layout.micro_batch * layout.local_seq_len  # this rank's slice under context parallelism
    moe = sum(config.is_moe_layer(i) for i in layers)  # the rest are dense (all of a dense model's)
    total = moe * _layer_bytes(config, layout, parts, tokens, True) if moe else 0
    if len(layers) > moe:
        total += (len(layers) - moe) * _layer_bytes(config, layout, parts, tokens, False)
    total += 2 * layout.local_seq_len * config.rope_dim * 4  # RoPE cos/sin tables, fp32
    if first:  # token ids (the embedding's indices: a view of the whole batch's)
        total += layout.micro_batch * (layout.seq_len + 1) * 8
    if last:
        h, b, r, t = config.hidden_size, layout.compute_bytes, layout.param_bytes, layout.tp_size
        region = tokens // t if layout.sequence_parallel else tokens
        # the final norm (1/T of the sequence under SP), the LM head's input (whole), the
        # vocabulary-parallel log-softmax (V / T columns) and the targets
        head = region * _norm(config, h, r) + tokens * (b * h + 4 * config.vocab_size // t + 8)
        # each MTP module (mula.model.mtp): its two input norms (in fp32 the previous depth's state that
        # hnorm takes is the one the previous head holds already), the concatenation eh_proj takes (2h) and
        # the shifted ids, then a head of its own (its norm, the LM head's input, log-softmax, targets)
        shared = 4 * h if b == 4 else 0
        mtp = region * (2 * _norm(config, h, r) - shared) + tokens * (2 * b * h + 8)
        total += head + config.mtp_depth * (mtp + head)
        if r > b:
            total += config.vocab_size // t * h * b  # the LM head's autocast weight copy
    return total


def schedule_order(layout: Layout, stage: int) -> list[tuple[int, int]]:
    """Pipeline rank `stage`'s forwards (+1) and backwards (-1) of one optimizer step, as (virtual stage
    of the rank, +1 or -1), in the order `torch.distributed.pipelining` runs them. Without a pipeline:
    one forward (accumulation micro-batches run one after the other)."""
    return _schedule_order(
        layout.pp_size, layout.micro_batches, layout.pp_virtual_stages, layout.pp_schedule, stage
    )


def _schedule_order(p: int, m: int, v: int, name: str, stage: int) -> list[tuple[int, int]]:
    if p == 1:
        return [(0, 1)]
    if name == "gpipe":
        return [(0, 1)] * m + [(0, -1)] * m
    if name == "1f1b":  # Schedule1F1B: a warmup of P - s forwards, then backward-first pairs
        warm = min(m, p - stage)
        return [(0, 1)] * warm + [(0, -1), (0, 1)] * (m - warm) + [(0, -1)] * warm
    # ScheduleInterleaved1F1B: micro-batches in rounds of about P, each virtual stage in turn; a warmup
    # two forwards longer per hop from the last rank, then ops of one forward and one backward
    # (forward first), then the remaining backwards
    per_round = m // max(1, m // p)
    warm = min((v - 1) * per_round + 2 * (p - 1 - stage), m * v)
    order = []
    for k in range(m * v + warm):
        if k < m * v:
            order.append(((k // per_round) % v, 1))
        if k >= warm:
            order.append((v - 1 - ((k - warm) // per_round) % v, -1))
    return order


def peak_activations(layout: Layout, stage: int, per_micro_batch: Sequence[int]) -> tuple[int, int | float]:
    """(bytes, micro-batches) pipeline rank `stage` holds at its fullest under the schedule.

    `per_micro_batch[v]`: bytes one micro-batch saves on the rank's virtual stage v (one entry per
    virtual stage). Walking `schedule_order`, each forward adds its micro-batch's bytes and each
    backward frees them; the result is the largest sum, and the micro-batches alive then, counted in
    whole ranks' worth (V virtual-stage micro-batches make one; a fraction only when interleaved).
    """
    schedule = (layout.pp_size, layout.micro_batches, layout.pp_virtual_stages, layout.pp_schedule)
    return _peak(schedule, stage, tuple(per_micro_batch))


@functools.lru_cache(maxsize=1 << 16)
def _peak(
    schedule: tuple[int, int, int, str], stage: int, per_micro_batch: tuple[int, ...]
) -> tuple[int, int | float]:
    """`peak_activations` of a schedule (P, M, V, name): `mula plan --search` asks it for every stage of
    tens of thousands of layouts, most sharing their schedule and activation bytes, hence the cache."""
    p, m, v, name = schedule
    held = alive = best = count = 0
    for virtual, change in _schedule_order(p, m, v, name, stage):  # the running sums, event by event
        held += change * per_micro_batch[virtual]
        alive += change
        if held > best:
            best, count = held, alive
    v = len(per_micro_batch)
    return best, (count // v if count % v == 0 else count / v)


def in_flight_micro_batches(layout: Layout, stage: int) -> int | float:
    """Micro-batches whose activations pipeline rank `stage` holds at its peak under the schedule.

    No pipeline: one. GPipe: every micro-batch of the step. 1F1B: stage s holds up to P - s.
    Interleaved 1F1B with v virtual stages and rounds of P micro-batches: ((v - 1) P + 2 (P - 1 - s) + 1)
    virtual-stage micro-batches, P + (P - 1) / v micro-batches on the first stage (Narayanan et al., 2021).
    """
    return peak_activations(layout, stage, [1] * layout.pp_virtual_stages)[1]


def transient_bytes(config: MulaConfig, layout: Layout, layers: Sequence[int], *, last: bool) -> int:
    """The largest short-lived allocation of a step on a stage holding blocks `layers`: the logits'
    gradient on the last stage, or one MoE layer's all-to-all send and receive buffers."""
    tokens = layout.micro_batch * layout.local_seq_len
    out = 0
    if last:
        out = tokens * config.vocab_size * (4 + layout.compute_bytes)  # fp32 logits grad + logits
    if any(config.is_moe_layer(i) for i in layers) and layout.ep_size > 1:
        # send and receive buffers: tokens x top_k rows each, or with a capacity the fixed E x C slots
        rows = tokens * config.top_k if capacity_of(config) is None else dispatched_rows(config, layout)
        out = max(out, 2 * rows * config.hidden_size * layout.compute_bytes)
    return out
