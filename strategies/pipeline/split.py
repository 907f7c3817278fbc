"""Splitting a plain `Mula` model into pipeline stages, from the outside (as torchtitan does).

S = P x V stages (V virtual stages per rank with the interleaved schedule); stage s holds a contiguous
run of blocks, the first also the embedding, the last the final norm and the LM head. Rank p of the
pipeline group holds stages p, p + P, ..., p + (V - 1) P (torch's looped placement): which blocks a
rank keeps is `mula.layout.parallel_layout.ParallelLayout.rank_holdings`'s answer.

Every rank builds the whole model with the same seed and then keeps only its stages' modules, in
place, under their original names: the blocks live in a `StageLayers` keyed by global layer index,
so parameter names (and therefore checkpoint keys) are those of the unsplit model whatever P is.

Multi-token prediction (`mtp_depth`, mula/model/mtp.py) runs on the last stage, as Megatron places it:
the MTP modules and their blocks (`Holdings.mtp_blocks`) after the final norm, on the normed hidden
state the last stage also returns, from its loss function (strategies/pipeline/schedule.py, which hands
it the micro-batch's token ids). Their input embeds the ids k ahead with the model's embedding, so the
last stage keeps a copy of it, `embed` as on the first stage (same name; same initial values: every rank
builds the model with the same seed, and the first stage's is broadcast to it at setup);
strategies/pipeline/embedding.py keeps the two copies in step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

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
    the first stage, norm, LM head and MTP modules (with a copy of the embedding) if it holds the last;
    in place."""
    if isinstance(model.layers, StageLayers):
        return  # already split (Lightning may call setup again)
    model.layers = StageLayers({str(i): model.layers[i] for i in holdings.blocks})
    if not holdings.first and not (holdings.last and model.config.mtp_depth):
        model.embed = None
    if not holdings.last:
        model.norm = None
        model.lm_head = None
        model.mtp = nn.ModuleList()


class MulaStage(nn.Module):
    """One pipeline stage of a split `Mula` model (torch's `PipelineStage` runs it).

    Inputs: token ids [B, T] on the first stage, else (hidden [B, T, H], router losses [2]).
    Outputs: (hidden or, on the last stage, logits [B, T, V], router losses [2]); a dense model has no
    router losses. With multi-token prediction the last stage also returns the normed hidden state
    [B, T, H] after them, which its loss function hands to `run_mtp` with the ids k ahead. The router
    losses are `forward_blocks`' running sums of every MoE layer's (aux, z) loss so far (zeros before the first MoE block): they travel with the activations, so the last
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
        # the MTP modules, their blocks and the embedding copy they read (registered, so that the stage's
        # parameters are all it trains); run by `run_mtp` through the model's one definition
        self.has_mtp = last and model.config.mtp_depth > 0
        if self.has_mtp:
            n = model.config.num_layers
            self.mtp = model.mtp
            self.mtp_blocks = nn.ModuleList(model.layers[str(n + k)] for k in range(model.config.mtp_depth))
            self.mtp_embed = model.embed
            self._forward_mtp = model.forward_mtp

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
        hidden = None
        if self.lm_head is not None:
            hidden = self.norm(x)
            x = self.lm_head(hidden)
        outputs = [x]
        if self.config.is_moe:
            # zeros while only dense blocks ran (the first stage of a model with dense first blocks)
            zeros = torch.zeros(2, dtype=torch.float32, device=x.device)
            outputs.append(zeros if out.router_sums is None else out.router_sums)
        if self.has_mtp:
            outputs.append(hidden)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def run_mtp(self, hidden: Tensor, router: Tensor | None, mtp_ids: Sequence[Tensor]) -> Any:
        """The MTP modules on the last stage (`Mula.forward_mtp`): `hidden` [B, T, H] the normed state this
        stage returned, `router` its router sums (None for a dense model), `mtp_ids` the ids k ahead of
        this rank's positions; their blocks' expert counts go to the runner's sink like the stage's."""
        shard = self.sequence_shard
        seq = hidden.shape[1] * self.seq_parts
        cos, sin = rope_cos_sin(self.config, seq, hidden.device, shard.start(seq))
        out = self._forward_mtp(hidden, mtp_ids, cos, sin, router)
        if self.count_sink is not None and torch.is_grad_enabled():
            for index, counts in out.tokens_per_expert.items():
                self.count_sink(index, counts)
        return out

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
        return inputs, (out, *router, *((hidden,) if self.has_mtp else ()))
