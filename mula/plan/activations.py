"""Bytes saved for backward by one micro-batch's forward, per activation-checkpointing setting.

An estimate of what `callbacks.memory_metrics.SavedTensorMeter` counts (`mem/activation_bytes`),
written op by op from `mula.model` and `mula.moe` (tests/test_plan_measured.py compares the two):
per token and layer, with h the hidden size, q/kv the attention projection widths, I the expert
(or MLP) width, K the top-k, E the experts, b the matmul dtype's bytes and r the residual stream's:

* a pre-norm (RMSNorm) saves its fp32 input, its rstd and its normalised output: 4h + 4 + r*h;
  its consumer saves the scaled output (b*h) -- shared by q/k/v, or by the router and the experts;
* attention: the q/k norms (as above on q and kv), SDPA's q, k, v, output and log-sum-exp
  (4*b*q + 4*heads; the output projection reads SDPA's output in place);
* router: logits and probabilities in fp32, z-loss log-sum-exp, top-k indices: 8E + 4 + 8K;
* experts, per routed row: input, gate and up (b*(h + 2I)); the combine keeps the expert outputs
  (b*h) and weights; under expert parallelism the all-to-all dispatcher's send-plan index, and the
  combine weight riding with each row (CPU) or the returned rows and weights (GPU). On CPU without
  expert parallelism the bucketed padded layout (`mula.kernels.padded`) carries the combine weights
  per row instead; on CPU the layout
  also keeps gathered copies of the local expert weights (3*h*I*E_local elements). Routing is
  assumed balanced: every rank's experts receive tokens * K rows;
* dense MLP: gate, silu(gate), up and their product (4*b*I);
* mixed precision (fp32 weights, 16-bit autocast): every matmul keeps its own 16-bit copy of its input
  (q, k and v three) and of its weight, outside recomputed parts;
* checkpointing keeps only a recomputed part's inputs: "norms" the residual (r*h) per norm, "attention"
  and "moe" their (already counted) normalised input, "full" each block's input (r*h).

Outside the blocks: the token ids, the final norm and LM head input, the cross-entropy's fp32
log-softmax (4V per token) and targets, and the RoPE tables.
"""

from __future__ import annotations

from math import ceil

from mula.activation_checkpointing import parse_activation_checkpointing
from mula.config import MulaConfig
from mula.plan.layout import Layout


def _norm(config: MulaConfig, dim: int, r: int) -> int:
    """Per-token bytes a pre-norm over `dim` saves (fp32 input, statistics, normalised output)."""
    if config.norm == "rmsnorm":
        return 4 * dim + 4 + r * dim
    return 4 * dim + 8  # non-parametric LayerNorm: input, mean and rstd; its output is the consumer's


def _attention(config: MulaConfig, b: int) -> int:
    """Per-token bytes attention saves beyond its (normalised) input."""
    q = config.num_heads * config.head_size
    kv = config.kv_heads * config.head_size
    out = 4 * b * q + 4 * config.num_heads  # SDPA: q, k, v (kv repeated to q heads), output, lse
    if config.qk_norm:
        out += _norm(config, q, b) + _norm(config, kv, b)
    return out


def _moe_per_token(config: MulaConfig, layout: Layout, b: int, r: int) -> int:
    """Per-token bytes of the router and the experts (weight copies excluded)."""
    e, k, h, i = config.num_experts, config.top_k, config.hidden_size, config.expert_intermediate_size
    router = 8 * e + 4 + 8 * k
    rows = b * (h + 2 * i)  # expert input, gate and up pre-activations
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


def _layer_bytes(config: MulaConfig, layout: Layout, parts: frozenset[str], tokens: int) -> int:
    """Bytes one block saves for one micro-batch of `tokens` tokens.

    Under mixed precision (fp32 weights, 16-bit autocast) every matmul saves its own 16-bit copy of its
    input and of its weight (the weights' copies only outside recomputed parts); a recomputed part
    keeps its fp32 input instead."""
    b, r, h = layout.compute_bytes, layout.param_bytes, config.hidden_size
    mixed = r > b
    if "full" in parts:
        return tokens * r * h
    e_local = config.num_experts // layout.ep_size
    weights = 0  # matmul weight elements whose autocast copies live until backward
    norm = (r * h) if "norms" in parts else _norm(config, h, r)
    per_token = 2 * norm
    if "attention" in parts:
        per_token += r * h if mixed else b * h  # the checkpoint's input: the normalised activation
    else:
        per_token += (3 if mixed else 1) * b * h + _attention(config, b)  # q/k/v inputs (shared unless cast)
        weights += config._attn_matmul_params()
    if config.is_moe:
        if "moe" in parts:
            per_token += r * h if mixed else b * h
        else:
            per_token += b * h + _moe_per_token(config, layout, b, r)  # router input (shared with experts)
            weights += config.num_experts * h + (
                0 if layout.device_type == "cpu" else e_local * config._expert_params()
            )
    else:
        per_token += (2 if mixed else 1) * b * h + 4 * b * config.intermediate_size
        weights += 3 * h * config.intermediate_size
    out = tokens * per_token + (weights * b if mixed else 0)
    if config.is_moe and "moe" not in parts and layout.device_type == "cpu":
        # the padded layout gathers the local experts' weights in bucket order
        out += e_local * config._expert_params() * b
    return out


def activation_bytes(config: MulaConfig, layout: Layout, layers: range, *, first: bool, last: bool) -> int:
    """Bytes one micro-batch saves for backward on a stage holding blocks `layers` (and the embedding
    when `first`, the final norm, LM head and loss when `last`)."""
    parts = parse_activation_checkpointing(layout.checkpointing)
    tokens = layout.micro_batch * layout.seq_len
    total = len(layers) * _layer_bytes(config, layout, parts, tokens)
    total += 2 * layout.seq_len * config.head_size * 4  # RoPE cos/sin tables, fp32
    if first:
        total += layout.micro_batch * (layout.seq_len + 1) * 8  # token ids (the embedding's indices)
    if last:
        h, b, r = config.hidden_size, layout.compute_bytes, layout.param_bytes
        total += tokens * (_norm(config, h, r) + b * h + 4 * config.vocab_size + 8)
        if r > b:
            total += config.vocab_size * h * b  # the LM head's autocast weight copy
    return total


def in_flight_micro_batches(layout: Layout, stage: int) -> int:
    """Micro-batches whose activations a stage holds at its peak under the pipeline schedule.

    No pipeline: one. GPipe: every micro-batch of the step. 1F1B: stage s holds up to P - s.
    Interleaved 1F1B with v virtual stages: about P - s + (P - 1) / v (Narayanan et al., 2021).
    """
    p, m = layout.pp_size, layout.micro_batches
    if p == 1:
        return 1
    if layout.pp_schedule == "gpipe":
        return m
    if layout.pp_schedule == "interleaved-1f1b":
        return min(m, p - stage + ceil((p - 1) / layout.pp_virtual_stages))
    return min(m, p - stage)


def transient_bytes(config: MulaConfig, layout: Layout, *, last: bool) -> int:
    """The largest short-lived allocation of a step: the logits' gradient on the last stage, or one
    MoE layer's all-to-all send and receive buffers."""
    tokens = layout.micro_batch * layout.seq_len
    out = 0
    if last:
        out = tokens * config.vocab_size * (4 + layout.compute_bytes)  # fp32 logits grad + logits
    if config.is_moe and layout.ep_size > 1:
        out = max(out, 2 * tokens * config.top_k * config.hidden_size * layout.compute_bytes)
    return out
