"""The node-local groups' collectives per step: what `strategies.tensor_parallel` (DTensor's functional
collectives), `strategies.context_parallel` (Ulysses' all-to-alls) and the expert dispatcher
(`strategies.experts.all_to_all`) issue, in bus bytes and calls (`mula.plan.step_time` prices them; tests/test_plan_volumes_tp.py and
tests/test_context_parallel.py count them in real runs)."""

from __future__ import annotations

from mula.model.activation_checkpointing import parse_activation_checkpointing
from mula.model.config import MulaConfig
from mula.model.moe_capacity import capacity_of
from mula.plan.layout import Layout


def context_parallel_sends(config: MulaConfig, layout: Layout, blocks: list[int]) -> tuple[float, float]:
    """(bus bytes, calls) of Ulysses' all-to-alls one rank makes per step over its C ranks
    (strategies/context_parallel.py): per attention layer and micro-batch, q, k and v of its S/C tokens
    (its TP rank's heads) in one message and the output in another, (C-1)/C of each sent, forward, backward, and forward again
    when attention is recomputed. Zero without context parallelism."""
    c = layout.cp_size
    if c == 1:
        return 0.0, 0.0
    parts = parse_activation_checkpointing(layout.checkpointing)
    passes = 2 + (1 if parts & {"attention", "full"} else 0)  # forward, backward, recomputed forward
    if config.is_mla:  # q, k, v zero-padded to one width, one key per query head
        width = max(config.qk_head_size, config.v_head_size)
        qkv, out = 3 * config.num_heads * width, config.num_heads * width
    else:
        qkv = (config.num_heads + 2 * config.kv_heads) * config.head_size
        out = config.num_heads * config.head_size
    tokens = max(1, layout.micro_batches) * layout.micro_batch * layout.local_seq_len
    # under tensor parallelism each TP rank exchanges its 1/T of the heads over its CP group
    width = (qkv + out) // layout.tp_size
    sent = passes * len(blocks) * tokens * width * layout.compute_bytes * (c - 1) / c
    return sent, 2.0 * passes * len(blocks) * max(1, layout.micro_batches)


def context_parallel_router_calls(config: MulaConfig, layout: Layout, blocks: list[int]) -> float:
    """Calls of an MoE model's router-loss totals over the C ranks (`ContextParallelTokens.total`: an
    autograd all-gather of each sum, a reduce-scatter in backward for those with a gradient), per MoE
    layer and micro-batch: the mean probabilities, z and (unless the global scope gives the frequencies)
    the counts gathered in every forward of the layer (again when it is recomputed), the first two
    reduce-scattered in backward. Zero without context parallelism. Their bytes (a few numbers per
    expert) are left out."""
    if layout.cp_size == 1 or not config.is_moe:
        return 0.0
    parts = parse_activation_checkpointing(layout.checkpointing)
    forwards = 1 + bool(parts & {"moe", "full"})
    sums = 2 + (config.aux_loss_scope != "global")
    moe_layers = sum(config.is_moe_layer(i) for i in blocks)
    return float(max(1, layout.micro_batches) * moe_layers * (forwards * sums + 2))


def context_parallel_router_bytes(config: MulaConfig, layout: Layout, blocks: list[int]) -> float:
    """Bus bytes of the router-loss totals' collectives (`context_parallel_router_calls`) per step: per
    MoE layer and micro-batch, each forward all-gathers the mean probabilities (E fp32), z (one fp32) and
    the counts (E int64, unless the global scope gives the frequencies; the sequence scope: probability
    sums and counts per sequence, [B, E] fp32 each) from the C - 1 other ranks, and backward
    reduce-scatters the first two, (C-1)/C of their C-fold gradient. Zero without context parallelism."""
    c = layout.cp_size
    if c == 1 or not config.is_moe:
        return 0.0
    forwards = 1 + bool(parse_activation_checkpointing(layout.checkpointing) & {"moe", "full"})
    with_grad = 4 * config.num_experts + 4
    counts = 0 if config.aux_loss_scope == "global" else 8 * config.num_experts
    if config.aux_loss_scope == "sequence":  # per sequence: probability sums and counts [B, E], fp32
        with_grad = counts = 4 * layout.micro_batch * config.num_experts
        with_grad += 4
    moe_layers = sum(config.is_moe_layer(i) for i in blocks)
    per_layer = (c - 1) * (forwards * (with_grad + counts) + with_grad)
    return float(max(1, layout.micro_batches) * moe_layers * per_layer)


def tensor_parallel_sends(
    config: MulaConfig, layout: Layout, blocks: list[int], first: bool, last: bool, partial_grads: bool = True
) -> tuple[float, float]:
    """(bus bytes, calls) of a rank's tensor-parallel collectives per step, for a rank holding `blocks`
    (and the embedding when `first`, the final norm and LM head when `last`), as
    `strategies.tensor_parallel` issues them (module docstring). Activations of one micro-batch are
    `tokens x hidden` elements: the residual stream's and the gradients flowing into it in the
    parameters' dtype, the row-parallel matmuls' outputs (and their gradients) in the compute dtype. An
    MoE block's layer routes 1/T of the tokens (`strategies.tensor_parallel_moe`): without SP its output
    is all-gathered (compute dtype) and its input's gradient too (parameters' dtype), under SP neither;
    its router-loss sums are all-reduced every forward (one call each), and its router's and (routed and
    shared) experts' partial gradients once per reduction round, one call per parameter, as are the
    per-head QK-norm weights' (`qk_norm_per_head`: replicated, each TP rank's heads a partial sum). Calls are
    DTensor's functional collectives (tests/test_plan_volumes_tp.py counts them in a real run).
    `partial_grads=False` leaves out the partial gradients' all-reduces (the strategy's gradient hooks
    make them; a bare forward + backward does not)."""
    t = layout.tp_size
    if t == 1:
        return 0.0, 0.0
    parts = parse_activation_checkpointing(layout.checkpointing)
    tokens = layout.micro_batch * layout.local_seq_len  # this CP rank's slice under context parallelism
    r, b, act = layout.param_bytes, layout.compute_bytes, tokens * config.hidden_size
    ring = (t - 1) / t
    # one QK-norm's statistics over split heads, q and k: one sum each under RMSNorm, mean and variance
    # under LayerNorm, [tokens] fp32, one call each, forward (and as many backward); none per head (each
    # head is whole on its rank)
    over_heads = config.qk_norm and not config.qk_norm_per_head
    stat_calls = (1 if config.norm == "rmsnorm" else 2) * 2 if over_heads else 0
    stats = stat_calls * tokens * 4 * 2 * ring
    # the router losses' sums over the TP group: mean probabilities and z (fp32), counts (int64) unless
    # the global scope gives the frequencies; the sequence scope sums probabilities and counts per
    # sequence ([B, E] fp32 each)
    probs, counts = 4 * config.num_experts, 0 if config.aux_loss_scope == "global" else 8 * config.num_experts
    if config.aux_loss_scope == "sequence":
        probs = counts = 4 * layout.micro_batch * config.num_experts
    router = 2 * (probs + 4 + counts) * ring
    router_calls = 2 + (config.aux_loss_scope != "global")
    # MLA (`_split_latent_attention`): backward all-reduces the column-parallel up projections' inputs (the
    # q latent, or the attention's input without one, and the kv latent, each in the parameters' dtype
    # after their norm) and the shared RoPE key (a projection's output, compute dtype), and nothing else
    mla_grads = 0.0
    if config.is_mla:
        latents = (config.q_lora_rank or config.hidden_size) + int(config.kv_lora_rank or 0)
        mla_grads = 2 * tokens * (latents * r + config.qk_rope_head_dim * b) * ring
    if layout.sequence_parallel:
        # all-gather of the attention and MLP inputs (r), reduce-scatter of their outputs (b), forward;
        # backward the reverse: reduce-scatter of the inputs' gradients, all-gather of the outputs'
        attn_fwd = mlp_fwd = act * (r + b) * ring
        attn, mlp = 2 * attn_fwd, 2 * mlp_fwd
        calls_fwd = {"attn": 2, "mlp": 2, "moe": router_calls}
        calls = {"attn": 4, "mlp": 4, "moe": router_calls}
        if config.is_mla:  # its input's gradient is complete on every rank: sliced, not reduce-scattered
            attn, calls["attn"] = attn_fwd + act * b * ring + mla_grads, 6
        moe_fwd, moe = router, router  # the MoE layer takes and returns its slice of the sequence
        # embedding's reduce-scatter / LM head's gather, both ways
        outer = act * r * ring * (2 * first + 2 * last)
        outer_calls = 2 * first + 2 * last
    else:
        # all-reduce of the o_proj and down_proj outputs (forward), of the q, k, v, gate and up inputs'
        # gradients (backward)
        attn_fwd = mlp_fwd = 2 * act * b * ring
        attn, mlp = attn_fwd + 3 * 2 * act * r * ring, mlp_fwd + 2 * 2 * act * r * ring
        if config.is_mla:  # three all-reduces in backward as well, of the latents and the RoPE key
            attn = attn_fwd + mla_grads
        moe_fwd = act * b * ring + router  # the output's all-gather
        moe = moe_fwd + act * r * ring  # and the input gradient's
        calls_fwd = {"attn": 1, "mlp": 1, "moe": 1 + router_calls}
        calls = {"attn": 4, "mlp": 3, "moe": 2 + router_calls}
        outer = 2 * act * r * ring * (first + last)  # the embedding's output, the LM head input's gradient
        outer_calls = first + last
    total = total_calls = 0.0
    for index in blocks:
        mlp_kind = "moe" if config.is_moe_layer(index) else "mlp"
        block = attn + 2 * stats + (moe if mlp_kind == "moe" else mlp)
        n = calls["attn"] + 2 * stat_calls + calls[mlp_kind]
        # the forwards activation checkpointing runs again, with their collectives
        again_attn = "full" in parts or "attention" in parts
        again_mlp = "full" in parts or (mlp_kind == "moe" and "moe" in parts)
        block += (attn_fwd + stats) * again_attn + (moe_fwd if mlp_kind == "moe" else mlp_fwd) * again_mlp
        n += (calls_fwd["attn"] + stat_calls) * again_attn + calls_fwd[mlp_kind] * again_mlp
        total, total_calls = total + block, total_calls + n
    loss = 3 * 2 * tokens * 4 * ring if last else 0.0  # max, sum of exponentials, target logit
    m = max(1, layout.micro_batches)
    out = m * (total + outer + loss)
    out_calls = m * (total_calls + outer_calls + 3 * last)
    # partial gradients of weights replicated over TP, all-reduced once per reduction round (every
    # micro-batch under the sharded optimizer, whose hooks consume each backward's gradients), one call
    # per parameter
    rounds = m if layout.shard_optimizer else 1
    partial = partial_calls = 0
    if layout.sequence_parallel and config.norm == "rmsnorm":
        partial_calls = 2 * len(blocks) + last  # the norm weights
        partial += partial_calls * config.hidden_size
    if config.qk_norm_per_head and config.norm == "rmsnorm":  # q and k norm weights, head_dim each
        partial_calls += 2 * len(blocks)
        partial += 2 * len(blocks) * config.head_size
    moe_layers = sum(config.is_moe_layer(i) for i in blocks)
    e_local = config.num_experts // layout.ep_size
    shared = 3 * config.hidden_size * config.shared_intermediate_size if config.num_shared_experts else 0
    partial += moe_layers * (
        config.num_experts * config.hidden_size + e_local * config._expert_params() + shared
    )
    # the router's weight, the experts' two stacks, the shared experts' three projections
    partial_calls += moe_layers * (3 + (3 if config.num_shared_experts else 0))
    if not partial_grads:
        return out, out_calls
    return out + rounds * partial * 2 * r * ring, out_calls + rounds * partial_calls


def dispatched_rows(config: MulaConfig, layout: Layout) -> int:
    """Rows one MoE layer's dispatch moves per micro-batch on one rank: its tokens x top_k (dropless; under
    TP a rank routes 1/T of the tokens), or with an expert capacity the E x C fixed slots, padding included
    (`mula.model.kernels.capacity`: C from the micro-batch's tokens)."""
    tokens = layout.micro_batch * layout.local_seq_len // layout.tp_size
    capacity = capacity_of(config)
    if capacity is None:
        return tokens * config.top_k
    return config.num_experts * capacity.slots(tokens, config.top_k, config.num_experts)


def expert_all_to_all_sends(config: MulaConfig, layout: Layout, blocks: list[int]) -> tuple[float, float]:
    """(bytes, calls) of the expert all-to-alls one rank makes per step over its E ranks for `blocks`:
    per MoE layer and micro-batch, tokens x top_k rows of `hidden` elements in the compute dtype leave
    the rank with probability (E-1)/E, twice in forward (dispatch, combine), twice in backward, twice more
    when the MoE block is recomputed (under TP each rank routes 1/T of its micro-batches' tokens). The
    messages: the row exchanges, one expert-count exchange per forward of the dispatch, and on CPU (the
    padded expert layout folds the combine weights into the experts) the weights' exchange in each
    forward and once backward. With an expert capacity the rows are the E x C fixed slots (`dispatched_rows`),
    no counts are exchanged and the weights always travel. Dense blocks send nothing; zero without expert
    parallelism."""
    e = layout.ep_size
    if not config.is_moe or e == 1:
        return 0.0, 0.0
    m = max(1, layout.micro_batches)
    recompute = parse_activation_checkpointing(layout.checkpointing) & {"moe", "full"}
    passes = 4 + (2 if recompute else 0)
    row = config.hidden_size * layout.compute_bytes
    forwards = passes // 2 - 1
    fixed = capacity_of(config) is not None
    counts = 0 if fixed else forwards
    messages = passes + counts + ((forwards + 1) if fixed or layout.device_type == "cpu" else 0)
    moe_layers = sum(config.is_moe_layer(i) for i in blocks)
    sent = passes * moe_layers * m * dispatched_rows(config, layout) * row * (e - 1) / e
    return sent, float(messages * moe_layers * m)


def expert_all_to_all_extra(config: MulaConfig, layout: Layout, blocks: list[int]) -> float:
    """Bytes of the expert all-to-alls beside the token rows (`expert_all_to_all_sends` counts their
    messages): per MoE layer, micro-batch and forward of the dispatch, this rank's expert counts (int64)
    to the E - 1 other ranks, and where the CPU expert layout folds the combine weights into the experts,
    one fp32 weight per row leaving the rank, in each forward and once backward."""
    e = layout.ep_size
    if not config.is_moe or e == 1:
        return 0.0
    m = max(1, layout.micro_batches)
    forwards = 1 + bool(parse_activation_checkpointing(layout.checkpointing) & {"moe", "full"})
    fixed = capacity_of(config) is not None  # fixed blocks: no counts, the weights on every device
    counts = 0 if fixed else forwards * (e - 1) * (config.num_experts // e) * 8
    weights = 0.0
    if fixed or layout.device_type == "cpu":
        rows = m * dispatched_rows(config, layout)
        weights = (forwards + 1) * rows * 4 * (e - 1) / e
    moe_layers = sum(config.is_moe_layer(i) for i in blocks)
    return moe_layers * (m * counts + weights)
