"""Megatron-style tensor (and sequence) parallelism of a `Mula`, applied from outside.

In the spirit of torchtitan's `parallelize`: the plain model is built as usual, then
`apply_tensor_parallel` hands `torch.distributed.tensor.parallel.parallelize_module` one plan per
module over the job mesh's "tp" dimension (T ranks, docs/tensor-parallel.md), the embedding excepted
(Mula's own vocabulary-parallel module):

    embed        vocabulary-parallel (`VocabParallelEmbedding`, Megatron's: rows of the table split
                 over T, each rank looking up its rows on local tensors, the partial embeddings summed
                 over the group, or reduce-scattered along the sequence under SP)
    attention    q/k/v column-parallel (each rank computes num_heads / T heads, kv_heads / T KV
                 heads), o_proj row-parallel (one all-reduce, or reduce-scatter under SP)
    QK-norm      `ShardedFeatureNorm`: Mula normalises q and k over ALL heads' features (as OLMoE),
                 so the per-rank statistics are all-reduced over the TP group; the weight is split
                 like the heads. Per head (`qk_norm_per_head`, Qwen3): untouched, its one head_dim
                 weight replicated and its partial gradient summed over TP (`mark_tp_partial`)
    MLA          (DeepSeek-V3) the down projections and latent norms replicated, q_b/kv_b (or q_proj)
                 column-parallel by heads, o_proj row-parallel (`_split_latent_attention`)
    MLP          gate/up column-parallel, down row-parallel
    MoE layer    experts whole, the tokens split over the TP group before routing
                 (strategies/tensor_parallel_moe.py)
    MTP modules  (`mula.model.mtp`) their blocks split as every block; their norms and `eh_proj` whole
                 (replicated); under SP they run on this rank's 1/T of the sequence, their gradients
                 partial over the TP group (`mark_tp_partial`, as the MoE router's)
    lm_head      column-parallel: the logits stay a DTensor split over the vocabulary, and the
                 strategy runs the loss under `loss_parallel` (a vocabulary-parallel cross-entropy);
                 with tied embeddings it is the embedding's own table (both split along the vocabulary)
    norms        untouched (replicated, full sequence); with `sequence_parallel` they run on
                 1/T of the sequence (SequenceParallel), the residual stream stays split along the
                 sequence, and the layers' inputs are all-gathered / outputs reduce-scattered

Parameters become DTensors over the TP mesh (Shard for split weights, Replicate for norm weights
under sequence parallelism); gradients are reduced over the data-parallel group with their local
tensors (strategies/optim/grad_reduce.py, `local_grad` there completes partial ones over the TP group).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from mula.model.moe import MoELayer
from mula.model.transformer import MLP, Attention, LatentAttention, LayerNorm, Mula, RMSNorm
from mula.torch_compat import FUNCTIONAL_ALL_REDUCE_HAS_BACKWARD, functional_all_reduce
from strategies.optim.grad_reduce import mark_tp_partial
from strategies.tensor_parallel_moe import split_moe_tokens


class ShardedFeatureNorm(nn.Module):
    """An RMSNorm or LayerNorm over the last dimension of a tensor whose features are split over the TP
    group (q or k after a column-parallel projection): the sums over features are all-reduced over the
    group (differentiably), so each rank normalises its slice exactly as the whole tensor would be.

    `weight` (RMSNorm only) is this rank's slice, a DTensor Shard(0) over `tp_mesh`.
    """

    def __init__(self, norm: nn.Module, tp_mesh: Any) -> None:
        super().__init__()
        self.group = tp_mesh.get_group()
        self.eps = norm.eps
        self.rms = isinstance(norm, RMSNorm)
        if self.rms:
            self.features = norm.weight.shape[0]
            self.weight = nn.Parameter(distribute_tensor(norm.weight.detach(), tp_mesh, [Shard(0)]))
        else:
            self.features = norm.dim

    def forward(self, x: Tensor) -> Tensor:
        """Normalise x [..., features / T] over all `features` of the group."""
        xf = x.float()
        if self.rms:
            mean_sq = _sum(xf.pow(2), self.group) / self.features
            y = (xf * torch.rsqrt(mean_sq + self.eps)).to(x.dtype)
            return self.weight.to_local() * y
        mean = _sum(xf, self.group) / self.features
        centred = xf - mean
        var = _sum(centred.pow(2), self.group) / self.features
        return (centred * torch.rsqrt(var + self.eps)).to(x.dtype)


def _sum(x: Tensor, group: Any) -> Tensor:
    """The sum of x over its last dimension and over the group, differentiable (the backward sums the
    gradients over the group): torch's functional all-reduce where it has a backward (newer torch),
    else `torch.distributed.nn.functional.all_reduce` (older torch, deprecated since)."""
    local = x.sum(-1, keepdim=True)
    if FUNCTIONAL_ALL_REDUCE_HAS_BACKWARD:
        return functional_all_reduce(local, "sum", group)
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(local, group=group)


class VocabParallelEmbedding(nn.Embedding):
    """An `nn.Embedding` whose [V, H] table is split along the vocabulary over the TP group (Megatron's
    vocabulary-parallel embedding): `weight` is a DTensor Shard(0) over `tp_mesh` (as torch's
    `RowwiseParallel` makes it: checkpoints, the gradient reduction and the tied LM head see the same
    parameter), but the forward works on local tensors (`_VocabParallelLookup`): this rank looks up the
    ids among its V / T rows, zero for the ids other ranks hold, and the partial embeddings are summed
    over the group. Its output is a plain tensor: [B, S, H], or this rank's [B, S / T, H] under sequence
    parallelism; its weight's gradient is this rank's rows only.

    Why not `RowwiseParallel`: its output is a DTensor whose autograd chain (the mask partial placement
    redistributed, then taken apart by `to_local`) fails in backward as soon as the gradient reaching it
    is not the one eager DTensor layers hand back: a `torch.compile`d block after it (AOTAutograd,
    torch 2.13) makes its backward stop with "Redistribution from one partial type (P(sum)) to another
    (MaskP...) is unsupported" (or "'Tensor' object has no attribute '_local_tensor'"); so does an
    eager `clone()` in between. Made in place by `_split_embedding` (a pipeline stage built before the
    split holds the module), as `fully_shard` swaps a module's class.
    """

    tp_mesh: Any
    sequence_parallel: bool

    def forward(self, ids: Tensor) -> Tensor:
        """ids [B, S] (every TP rank the same) -> [B, S, H], or [B, S / T, H] under SP."""
        local = self.weight.to_local()  # this rank's rows; the gradient comes back as a Shard(0) DTensor
        out = Shard(1) if self.sequence_parallel else Replicate()
        return _VocabParallelLookup.apply(ids, local, self.tp_mesh, out)


def _held_ids(ids: Tensor, first: int, rows: int) -> tuple[Tensor, Tensor]:
    """(the ids as rows of this rank's `rows` rows from vocabulary entry `first`, 0 where another rank
    holds the id; where another rank holds it)."""
    shifted = ids - first
    elsewhere = (shifted < 0) | (shifted >= rows)
    return shifted.masked_fill(elsewhere, 0), elsewhere


class _VocabParallelLookup(torch.autograd.Function):
    """The vocabulary-parallel lookup of `ids` in this rank's rows `local` of the table.

    Forward: the embedding of the ids this rank holds, zero for the others, summed over the TP group by
    the collective DTensor runs from Partial to `out` (an all-reduce to Replicate, or a reduce-scatter
    to Shard(1) under SP). Backward: the output's gradient made Replicate (as it is, or all-gathered
    along the sequence: it is complete on every rank, and every rank's partial took part in every
    output element), then the embedding's backward on this rank's rows (the ids other ranks hold
    masked out). Only the ids are kept for backward, as a plain embedding keeps them. No DTensor
    autograd: the placements only run the collectives."""

    @staticmethod
    def forward(ctx: Any, ids: Tensor, local: Tensor, tp_mesh: Any, out: Any) -> Tensor:
        rows = local.shape[0]
        held, elsewhere = _held_ids(ids, tp_mesh.get_local_rank() * rows, rows)
        partial = F.embedding(held, local).masked_fill_(elsewhere.unsqueeze(-1), 0)
        ctx.save_for_backward(ids)
        ctx.rows, ctx.tp_mesh, ctx.out = rows, tp_mesh, out
        summed = DTensor.from_local(partial, tp_mesh, [Partial()], run_check=False)
        return summed.redistribute(tp_mesh, [out]).to_local()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None, None]:
        (ids,) = ctx.saved_tensors
        whole = DTensor.from_local(grad, ctx.tp_mesh, [ctx.out], run_check=False)
        whole = whole.redistribute(ctx.tp_mesh, [Replicate()]).to_local()
        held, elsewhere = _held_ids(ids, ctx.tp_mesh.get_local_rank() * ctx.rows, ctx.rows)
        mine = whole.masked_fill(elsewhere.unsqueeze(-1), 0)
        rows_grad = torch.ops.aten.embedding_backward(mine, held, ctx.rows, -1, False, False)
        return None, rows_grad, None, None


def _split_embedding(embed: nn.Embedding, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Make `embed` a `VocabParallelEmbedding` in place: its table a Shard(0) DTensor over `tp_mesh`,
    taken from the TP group's first rank (as `RowwiseParallel` distributes it)."""
    weight = embed.weight
    embed.weight = nn.Parameter(
        distribute_tensor(weight.detach(), tp_mesh, [Shard(0)]), requires_grad=weight.requires_grad
    )
    embed.__class__ = VocabParallelEmbedding
    assert isinstance(embed, VocabParallelEmbedding)
    embed.tp_mesh, embed.sequence_parallel = tp_mesh, sequence_parallel


def _split_attention(attn: Attention, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Heads over T: q/k/v column-parallel, o_proj row-parallel, QK-norm over all heads (or per head:
    Qwen3's one head_dim weight replicated, its gradient partial over the TP group)."""
    t = tp_mesh.size()
    plan: dict[str, Any] = {
        "q_proj": ColwiseParallel(),
        "k_proj": ColwiseParallel(),
        "v_proj": ColwiseParallel(),
        "o_proj": RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel(),
    }
    parallelize_module(attn, tp_mesh, plan)
    attn.num_heads, attn.kv_heads = attn.num_heads // t, attn.kv_heads // t  # this rank's heads
    for name in ("q_norm", "k_norm"):
        norm = getattr(attn, name)
        if attn.per_head:
            # each head normalised on its own (Qwen3): this rank's heads need no statistics of its peers';
            # the shared head_dim weight stays whole and sees only this rank's heads, so its gradient is
            # partial: summed over the TP group before the data-parallel reduction (as the MoE router's)
            for p in norm.parameters():
                mark_tp_partial(p, tp_mesh)
        elif isinstance(norm, (RMSNorm, LayerNorm)):
            setattr(attn, name, ShardedFeatureNorm(norm, tp_mesh))


def _split_latent_attention(attn: LatentAttention, tp_mesh: Any, sequence_parallel: bool) -> None:
    """Multi-head latent attention (DeepSeek-V3) over T, as Megatron and torchtitan split it: the
    low-rank down projections (`q_a_proj`, `kv_a_proj_with_mqa`) and their norms stay whole on every
    rank (replicated), the up projections (`q_b_proj`, or `q_proj` without a q latent, and `kv_b_proj`)
    column-parallel by heads, `o_proj` row-parallel.

    Gradients: each up projection's input gradient is all-reduced over the TP group in backward
    (`ColwiseParallel`'s input), so the latents' gradients, and with them the down projections' and the
    norms', are complete on every rank. The one RoPE key every head shares goes straight from
    `kv_a_proj_with_mqa` to this rank's heads: `_complete_shared_key` all-reduces its gradient too. The
    attention's input gradient is then complete (no partial weight gradients, no sum over TP after)."""
    t = tp_mesh.size()
    up = "q_proj" if attn.q_lora_rank is None else "q_b_proj"
    o_proj = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    plan = {up: ColwiseParallel(), "kv_b_proj": ColwiseParallel(), "o_proj": o_proj}
    parallelize_module(attn, tp_mesh, plan)
    attn.num_heads //= t  # this rank's heads
    attn.kv_a_proj_with_mqa.register_forward_hook(_complete_shared_key(attn.kv_rank, tp_mesh))


def _complete_shared_key(kv_rank: int, tp_mesh: Any) -> Any:
    """A forward hook for `kv_a_proj_with_mqa`, whose output is [latent | shared RoPE key]: the key as
    it is forward, its gradient (each rank's heads' part) summed over the TP group backward -- a
    Replicate DTensor taken apart with a Partial gradient, made Replicate again by `from_local`'s backward."""

    def hook(module: nn.Module, args: Any, out: Tensor) -> Tensor:
        latent, key = out.split([kv_rank, out.shape[-1] - kv_rank], dim=-1)
        key = DTensor.from_local(key, tp_mesh, [Replicate()], run_check=False)
        return torch.cat((latent, key.to_local(grad_placements=[Partial()])), dim=-1)

    return hook


def _split_mlp(mlp: MLP, tp_mesh: Any, sequence_parallel: bool) -> None:
    """SwiGLU over T: gate/up column-parallel, down row-parallel."""
    down = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    parallelize_module(
        mlp, tp_mesh, {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": down}
    )


def apply_tensor_parallel(model: Mula, tp_mesh: Any, sequence_parallel: bool = False) -> Mula:
    """Split a `Mula` over the 1-D `tp_mesh` in place (see the module docstring); returns it.

    The model may be one pipeline stage's (`strategies.pipeline.split.split_model`): whatever it holds
    of the embedding, the blocks and the final norm and LM head is split, what it lacks (None) is
    skipped. Every TP rank must call it with the same weights (replicas are made identical afterwards
    over the data-parallel group; DTensor's distribution takes each shard from the TP group's first rank).
    """
    sp = sequence_parallel
    # under SP the residual stream between layers is this rank's 1/T of the sequence (a local tensor)
    if model.embed is not None:
        _split_embedding(model.embed, tp_mesh, sp)
    if model.lm_head is not None:
        lm_head = ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1), use_local_output=False
        )
        parallelize_module(model, tp_mesh, {"lm_head": lm_head})
    if model.embed is not None and model.lm_head is not None:
        # tie_embeddings: both plans split the [V, H] table along the vocabulary (dim 0, Shard(0)), so
        # the LM head can take the embedding's DTensor itself: one parameter, both uses' gradients summed
        model.tie_weights()
    for block in model.layers:
        _split_block(block, tp_mesh, sp)
    if sp and model.norm is not None:
        parallelize_module(model, tp_mesh, {"norm": SequenceParallel()})
    for module in model.mtp if sp else ():
        _split_mtp_tokens(module, tp_mesh)
    model.register_forward_pre_hook(
        lambda _, args: check_sequence_split(model.config, args[0].shape[1], tp_mesh.size(), sp)
    )
    return model


def _split_mtp_tokens(module: nn.Module, tp_mesh: Any) -> None:
    """An MTP module under sequence parallelism: its inputs (the previous depth's normed state, a DTensor
    from the final norm's `SequenceParallel` or a slice from the previous module, and the embeddings)
    taken as this rank's slice of the sequence; its norms and projection act on each token alone, so they
    run on the slice as they are, and their weights' gradients are the slice's part of the sum."""
    parallelize_module(
        module, tp_mesh,
        PrepareModuleInput(
            input_layouts=(Shard(1), Shard(1)), desired_input_layouts=(Shard(1), Shard(1)), use_local_output=True
        ),
    )  # fmt: skip
    for p in module.parameters():
        mark_tp_partial(p, tp_mesh)


def _split_block(block: nn.Module, tp_mesh: Any, sp: bool) -> None:
    """One transformer block over T: attention by heads, a dense MLP by features or an MoE layer by
    tokens, and under SP its norms on 1/T of the sequence with the layers' inputs all-gathered."""
    latent = isinstance(block.attn, LatentAttention)
    (_split_latent_attention if latent else _split_attention)(block.attn, tp_mesh, sp)
    moe = isinstance(block.mlp, MoELayer)
    if moe:  # experts whole, tokens split (strategies/tensor_parallel_moe.py)
        split_moe_tokens(block.mlp, tp_mesh, sp)
    else:
        assert isinstance(block.mlp, MLP)
        _split_mlp(block.mlp, tp_mesh, sp)
    if not sp:
        return
    plan: dict[str, Any] = {
        "attn_norm": SequenceParallel(),
        "mlp_norm": SequenceParallel(),
        # attention's (x, cos, sin): only x is split along the sequence. MLA takes the gathered x as a
        # plain tensor (its replicated down projections are plain modules): its gradient comes back
        # complete on every rank (`_split_latent_attention`), so backward keeps this rank's slice of it
        "attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=latent,
        ),
    }
    if not moe:  # an MoE layer takes its slice of the sequence as it is
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    parallelize_module(block, tp_mesh, plan)


def check_sequence_split(config: Any, seq: int, t: int, sequence_parallel: bool) -> None:
    """Refuse a sequence of length `seq` that T ranks cannot split evenly where they split it (sequence
    parallelism, and MoE layers: their tokens are split over the TP ranks); one sentence, called before
    any collective (the model's forward pre-hook; a pipeline step before its schedule)."""
    if t == 1 or not (sequence_parallel or config.num_experts > 0) or seq % t == 0:
        return
    what = "sequence_parallel splits" if sequence_parallel else "MoE layers under tensor parallelism split"
    raise ValueError(
        f"{what} the sequence over tensor_parallel_size={t} ranks, but this batch's "
        f"sequence length {seq} is not divisible by {t}; choose a seq_len divisible by it."
    )


class TensorParallelLoss:
    """`loss_parallel` around a step's forward and backward under tensor parallelism (a member of
    XPUMoEStrategy), so the cross-entropy of the vocabulary-split logits is computed without gathering
    them (torch requires the context around both).

    Input, stated at construction: `tp`, the tensor-parallel size T (the layout's); at T = 1 the
    context does nothing."""

    def __init__(self, tp: int) -> None:
        self.tp = tp

    @contextmanager
    def context(self) -> Generator[None, None, None]:
        """`loss_parallel` under tensor parallelism, else nothing."""
        if self.tp > 1:
            with loss_parallel():
                yield
        else:
            yield
