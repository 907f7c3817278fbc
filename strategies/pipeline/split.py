"""Splitting a plain `Mula` model into pipeline stages, from the outside (as torchtitan does).

S = P x V stages (V virtual stages per rank with the interleaved schedule); stage s holds a contiguous
run of blocks, the first also the embedding, the last the final norm and the LM head. Rank p of the
pipeline group holds stages p, p + P, ..., p + (V - 1) P (torch's looped placement): which blocks a
rank keeps is `mula.layout.parallel_layout.ParallelLayout.rank_holdings`'s answer.

Every rank builds the whole model with the same seed and then keeps only its stages' modules, in
place, under their original names: the blocks live in a `StageLayers` keyed by global layer index,
so parameter names (and therefore checkpoint keys) are those of the unsplit model whatever P is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from mula.layout.parallel_layout import Holdings
from mula.model.layers import SequenceShard
from mula.model.transformer import Mula, check_sequence_length, forward_blocks, rope_cos_sin


class StageLayers(nn.ModuleDict):
    """The blocks a rank keeps, keyed by global layer index, so parameter names stay `layers.<i>.*`;
    iterates over its blocks like the `nn.ModuleList` it replaces."""

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self._modules.values())  # type: ignore[arg-type]


def split_model(model: Mula, holdings: Holdings) -> None:
    """Keep only the blocks a rank holds (`ParallelLayout.rank_holdings`), the embedding if it holds
    the first stage, norm and LM head if it holds the last; in place."""
    if isinstance(model.layers, StageLayers):
        return  # already split (Lightning may call setup again)
    model.layers = StageLayers({str(i): model.layers[i] for i in holdings.blocks})
    if not holdings.first:
        model.embed = None
    if not holdings.last:
        model.norm = None
        model.lm_head = None


class MulaStage(nn.Module):
    """One pipeline stage of a split `Mula` model (torch's `PipelineStage` runs it).

    Inputs: token ids [B, T] on the first stage, else (hidden [B, T, H], router losses [2]).
    Outputs: (hidden or, on the last stage, logits [B, T, V], router losses [2]); a dense model has no
    router losses. The router losses are `forward_blocks`' running sums of every MoE layer's (aux, z)
    loss so far (zeros before the first MoE block): they travel with the activations, so the last
    stage's loss (`router_losses` of the sums) contains all of them and backward brings each stage its
    share of their gradient -- the same loss as the unsplit model's, summed in the same order.
    """

    def __init__(self, model: Mula, layers: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleList(model.layers[str(i)] for i in layers)
        self.layer_ids = list(layers)  # global block indices
        # set by the runner: receives (global block index, tokens per expert) of each training forward
        self.count_sink: Callable[[int, Tensor], None] | None = None
        # ranks splitting the sequence of the hidden state between stages (set by the runner): T under
        # sequence parallelism (each rank holds and sends its 1/T), 1 otherwise (whole, replicated over TP)
        self.seq_parts = 1
        # which slice of every sequence this rank holds (set by the runner): context parallelism's
        # CP rank c holds 1/C of it, and its RoPE positions start at c S/C (the whole sequence otherwise)
        self.sequence_shard = SequenceShard()
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: Tensor, router: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Run this stage's part of `Mula.forward`."""
        # positions of this CP rank's slice (a rank's hidden state may hold 1/seq_parts of it: SP)
        seq = x.shape[1] if self.embed is not None else x.shape[1] * self.seq_parts
        shard = self.sequence_shard
        if self.embed is not None:
            check_sequence_length(self.config, seq * shard.count)
            x = self.embed(x)
        cos, sin = rope_cos_sin(self.config, seq, x.device, shard.start(seq))
        out = forward_blocks(zip(self.layer_ids, self.blocks), x, cos, sin, router)
        if self.count_sink is not None and torch.is_grad_enabled():  # training forwards only
            for index, counts in out.tokens_per_expert.items():
                self.count_sink(index, counts)
        x = out.hidden
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        if not self.config.is_moe:
            return x
        if out.router_sums is None:  # the first stage holds only dense blocks: nothing to add yet
            return x, torch.zeros(2, dtype=torch.float32, device=x.device)
        return x, out.router_sums

    def example_io(self, micro_batch: int, seq_len: int, dtype: torch.dtype, logits_dtype: torch.dtype):
        """(inputs, outputs) as meta tensors of one micro-batch of `seq_len` tokens (this CP rank's
        slice under context parallelism): the static shapes `PipelineStage` needs.

        The hidden state between stages holds this rank's 1/`seq_parts` of it; the last
        stage's logits are described by their global shape (under TP a vocabulary-split DTensor, which
        the loss consumes on the same rank: never sent)."""
        c = self.config

        def meta(*shape: int, dt: torch.dtype = dtype, grad: bool = True) -> Tensor:
            return torch.empty(shape, dtype=dt, device="meta").requires_grad_(grad)

        router = (meta(2, dt=torch.float32),) if c.is_moe else ()
        hidden = meta(micro_batch, seq_len // self.seq_parts, c.hidden_size)
        inputs = (
            (meta(micro_batch, seq_len, dt=torch.long, grad=False),) if self.embed is not None else (hidden,)
        )
        if self.embed is None:
            inputs = inputs + router
        out = (
            meta(micro_batch, seq_len, c.vocab_size, dt=logits_dtype) if self.lm_head is not None else hidden
        )
        return inputs, (out, *router)
