"""Ulysses context (sequence) parallelism of a `Mula`, applied from outside (docs/context-parallel.md).

The C ranks of a context-parallel group (`LayoutMesh.group("cp")`) read the same samples and
each keeps its contiguous 1/C of every sequence (`mula.model.layers.SequenceShard`: the module slices inputs
and targets, RoPE starts at the slice's global position). Everything but attention is per token, so
it runs on the slice as it is; attention (DeepSpeed-Ulysses) is the one place the whole sequence meets:

    attention  `UlyssesAttention` replaces each attention layer's `core`: one all-to-all turns q, k, v
               [B, heads, S/C, d] (sequence-split) into [B, heads/C, S, d] (head-split: every position,
               this rank's heads), the causal attention runs over the whole sequence (global positions,
               the mask of one process), and a second all-to-all turns the output back. torch's
               `all_to_all_single_autograd` carries the gradients back the same way.
    MoE        each rank routes its own tokens; `ContextParallelTokens` (a `TokenSplit`) makes the aux
               and z losses the whole micro-batch's, summed over the CP group. The step's expert counts
               (router-bias update, metrics) and the global aux-loss scope sum every rank's own counts
               already, so they see the global counts without a CP term.
    loss       each rank's loss is the mean over its slice; the ranks' slices are equal, so the mean of
               the C ranks' losses is the sequence's mean (what `train/loss` logs: the mean over ranks).
    gradients  CP ranks replicate every parameter (dense and experts) and hold different tokens: the
               gradient-reduce engine treats them as data-parallel ranks (`LayoutMesh`'s stage
               and EDP groups include them), averaging over DP x C. That average is the gradient of the
               mean of the ranks' losses, i.e. of the sequence mean, when every collective inside the loss
               has its true backward: the all-to-alls' (above) and the router losses' all-reduce, whose
               backward is an all-reduce too (each rank's loss holds the whole sum, so each share's
               gradient is the sum of the C ranks' upstream gradients).

Composes with pipeline stages (the runner slices each step's batch, the stages send [B, S/C, H]
between CP peers: strategies/pipeline/), with tensor parallelism (applied after it: q, k, v hold the
TP rank's heads, which Ulysses exchanges over the CP group; an MoE layer's TP token split sums its
router statistics over TP before the CP sum), and with both (docs/context-parallel.md). Downstream
evaluation forwards each rank's slice and gathers the logits over the CP group
(strategies/eval_forward.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mula.layout.rules import check_context_parallel
from mula.model.layers import SequenceShard, causal_attention
from mula.model.moe import iter_moe_layers
from mula.model.moe.balancing import TokenSplit
from mula.torch_compat import all_gather_tensor_autograd, all_to_all_single_autograd


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous: torch 2.11's backward of the autograd
    functional collectives refuses a strided gradient (a permuted output's, or a sum's expanded one;
    2.13 copies it)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _all_to_all(chunks: Tensor, group: Any) -> Tensor:
    """chunks [C, ...]: chunk j goes to group rank j; returns [C, ...], chunk j from group rank j."""
    return _ContiguousGrad.apply(all_to_all_single_autograd(chunks.contiguous(), None, None, group))


def _gather_sequence(x: Tensor, parts: int, group: Any) -> Tensor:
    """[B, heads, S/C, d] sequence-split -> [B, heads/C, S, d] head-split (group rank r: heads chunk r)."""
    b, h, t, d = x.shape
    chunks = x.view(b, parts, h // parts, t, d).transpose(0, 1)  # [C (head chunk), B, h/C, S/C, d]
    got = _all_to_all(chunks, group)  # [C (sequence slice), B, h/C, S/C, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // parts, parts * t, d)


def _scatter_sequence(y: Tensor, parts: int, group: Any) -> Tensor:
    """[B, heads/C, S, d] head-split -> [B, heads, S/C, d] sequence-split (the inverse of `_gather_sequence`)."""
    b, h, s, d = y.shape
    chunks = y.view(b, h, parts, s // parts, d).permute(2, 0, 1, 3, 4)  # [C (sequence slice), B, h/C, S/C, d]
    got = _all_to_all(chunks, group)  # [C (head chunk), B, h/C, S/C, d]
    return got.transpose(0, 1).reshape(b, h * parts, s // parts, d)


class UlyssesAttention:
    """An attention layer's `core` over the C ranks of `group`: heads exchanged for the sequence around
    `causal_attention` (see the module docstring). q [B, heads, S/C, d], k and v [B, kv_heads, S/C, d]
    -> [B, heads, S/C, d]. q, k and v travel in one all-to-all, the output in another."""

    def __init__(self, group: Any, parts: int) -> None:
        self.group, self.parts = group, parts

    def __repr__(self) -> str:
        return f"UlyssesAttention(parts={self.parts})"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
        b, heads, t, d = q.shape
        kv_heads, c = k.shape[1], self.parts
        # one exchange: per destination rank, its q heads then its k and v heads (concatenated by chunk)
        per = [z.view(b, c, z.shape[1] // c, t, d) for z in (q, k, v)]
        packed = torch.cat(per, dim=2).view(b, heads + 2 * kv_heads, t, d)
        whole = _gather_sequence(packed, c, self.group)
        q_h, k_h, v_h = whole.split([heads // c, kv_heads // c, kv_heads // c], dim=1)
        return _scatter_sequence(causal_attention(q_h, k_h, v_h, scale), c, self.group)


class ContextParallelTokens(TokenSplit):
    """A micro-batch's tokens split over the C ranks of `group` by sequence slice (module docstring),
    each CP rank's slice possibly split further by `inner` (tensor parallelism's `TensorParallelTokens`:
    each TP rank routes 1/T of it): C x inner.parts ranks in all."""

    def __init__(self, group: Any, cp_parts: int, inner: TokenSplit | None = None) -> None:
        self.group, self.cp_parts = group, cp_parts
        self.inner = inner if inner is not None else TokenSplit()
        self.parts = cp_parts * self.inner.parts

    def __repr__(self) -> str:
        return f"ContextParallelTokens(cp_parts={self.cp_parts}, inner={self.inner!r})"

    def total(self, t: Tensor) -> Tensor:
        """t summed over the CP group (after the inner split's sum); backward: the gradients summed over
        the CP group too, since every CP rank's loss holds the total and the engine averages their
        gradients (the sum of an autograd all-gather, whose backward is a reduce-scatter: torch's
        differentiable collectives, small [C, ...] tensors). The inner (TP) sum keeps its own backward:
        the identity, TP peers holding one loss whose partial gradients the engine sums."""
        t = self.inner.total(t)
        return _ContiguousGrad.apply(all_gather_tensor_autograd(t.unsqueeze(0), 0, self.group)).sum(0)


def apply_context_parallel(
    model: nn.Module, group: Any, rank: int, parts: int, tp_size: int = 1
) -> nn.Module:
    """Make `model` (a `Mula`, possibly split over `tp_size` TP ranks already) hold slice `rank` of
    `parts` of every sequence and attend over the whole of it with the other ranks of `group` (in place;
    the model is returned). Refuses, in one sentence, heads or key/value heads that `parts` x `tp_size`
    does not divide."""
    check_context_parallel(model.config, parts, tp_size)
    model.sequence_shard = SequenceShard(rank, parts)
    for block in model.layers:
        block.attn.core = UlyssesAttention(group, parts)
    for _, layer in iter_moe_layers(model):
        inner = layer.token_split
        if isinstance(inner, ContextParallelTokens):  # applied already (Lightning calls setup again)
            inner = inner.inner
        layer.token_split = ContextParallelTokens(group, parts, inner)
    return model
