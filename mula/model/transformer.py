"""The Mula transformer, top to bottom: attention, block, model (norms, RoPE and the SwiGLU MLP are in
`mula.model.layers`, multi-head latent attention in `mula.model.mla`).

Pre-norm decoder (OLMoE / OLMo-1B): x + attn(norm(x)), then x + mlp(norm(x)); the MLP is a
SwiGLU (dense) or a `mula.model.moe.MoELayer` (an MoE model may keep its first `num_dense_layers` blocks
dense). Numerically identical to transformers' OLMoE / OLMo on the same weights (`tests/test_hf.py`),
and with MLA and shared experts to transformers' DeepSeek-V3 (`tests/test_hf_deepseek_v3.py`).

The blocks run through `forward_blocks`, and the router losses are `router_losses` of its sums: one
definition, which the pipeline stages (strategies/pipeline/split.py) use too.

With `mtp_depth`, the multi-token prediction modules (`mula.model.mtp`) run after the model on the ids
`Mula.forward` is handed for them; their blocks are the last `mtp_depth` of `Mula.layers`.

Activation checkpointing (`Mula.set_activation_checkpointing`) recomputes whole blocks or selected
parts of them in backward with torch's non-reentrant `checkpoint`; gradients are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from mula.model.activation_checkpointing import parse_activation_checkpointing
from mula.model.config import MulaConfig
from mula.model.layers import (
    MLP,
    LayerNorm,
    RMSNorm,
    SequenceShard,
    apply_rope,
    causal_attention,
    make_norm,
    rope_cos_sin,
)
from mula.model.mla import LatentAttention
from mula.model.moe import GroupedExperts, MoELayer, Router
from mula.model.mtp import MTPModule

__all__ = [
    "MLP", "Attention", "Block", "LatentAttention", "LayerNorm", "Mula", "MulaOutput", "RMSNorm",
    "apply_rope", "forward_blocks", "make_norm", "rope_cos_sin", "router_losses",
]  # fmt: skip


class Attention(nn.Module):
    """Causal self-attention with RoPE, grouped-query heads and optional QK-norm, via SDPA.

    The QK-norm normalises the whole projected q and k (OLMoE), or each head on its own with one
    weight of head_dim shared by the heads (`qk_norm_per_head`, Qwen3); before RoPE either way.
    `core` (a plain attribute, `causal_attention` by default) attends q over k, v; context parallelism
    replaces it from outside (strategies/context_parallel.py).
    """

    def __init__(self, config: MulaConfig) -> None:
        super().__init__()
        self.num_heads, self.kv_heads, self.head_dim = config.num_heads, config.kv_heads, config.head_size
        h, q_dim, kv_dim = (
            config.hidden_size,
            config.num_heads * config.head_size,
            config.kv_heads * config.head_size,
        )
        self.q_proj = nn.Linear(h, q_dim, bias=False)
        self.k_proj = nn.Linear(h, kv_dim, bias=False)
        self.v_proj = nn.Linear(h, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, h, bias=False)
        self.per_head = config.qk_norm_per_head
        q_norm_dim, k_norm_dim = config.qk_norm_dims() or (q_dim, kv_dim)
        self.q_norm = make_norm(config, q_norm_dim) if config.qk_norm else nn.Identity()
        self.k_norm = make_norm(config, k_norm_dim) if config.qk_norm else nn.Identity()
        self.core: Callable[..., Tensor] = causal_attention

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B,T,H] -> [B,T,H]."""
        b, t, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if not self.per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(b, t, self.num_heads, self.head_dim), k.view(b, t, self.kv_heads, self.head_dim)
        if self.per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.core(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def _recompute(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), its activations recomputed in backward instead of saved (non-reentrant checkpoint).

    The returned values are those of the first forward (MoE stats stay exact). Early stop is off so
    that a recompute always re-runs every collective in fn (the expert all-to-alls) on every rank,
    whatever the data-dependent number of tensors each rank saved. The RNG state is preserved
    (torch's default): the model draws no random numbers today, and a recompute must not either.
    """
    with set_checkpoint_early_stop(False):
        return checkpoint(fn, *args, use_reentrant=False)


class Block(nn.Module):
    """Pre-norm transformer block; `mlp` is a `MoELayer` when `moe` (`MulaConfig.is_moe_layer` of the
    block's index), else an `MLP`.

    `checkpointing` names what backward recomputes: "full" (the whole block) or any of "attention",
    "moe" (the MoE layer: router, dispatch, experts, combine; a dense MLP is not affected) and "norms"
    (the two pre-norms).
    """

    def __init__(self, config: MulaConfig, moe: bool) -> None:
        super().__init__()
        self.attn_norm = make_norm(config, config.hidden_size)
        self.attn = LatentAttention(config) if config.is_mla else Attention(config)
        self.mlp_norm = make_norm(config, config.hidden_size)
        self.mlp = MoELayer(config) if moe else MLP(config.hidden_size, config.intermediate_size)
        self.checkpointing: frozenset[str] = frozenset()

    def _call(self, part: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), recomputed in backward when `part` is checkpointed."""
        return _recompute(fn, *args) if part in self.checkpointing else fn(*args)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor):
        """x [B,T,H] -> (x [B,T,H], MoEStats or None)."""
        if "full" in self.checkpointing:
            return _recompute(self._forward, x, cos, sin)
        return self._forward(x, cos, sin)

    def _forward(self, x: Tensor, cos: Tensor, sin: Tensor):
        x = x + self._call("attention", self.attn, self._call("norms", self.attn_norm, x), cos, sin)
        h = self._call("norms", self.mlp_norm, x)
        if isinstance(self.mlp, MoELayer):
            h, stats = self._call("moe", self.mlp, h)
        else:
            h, stats = self.mlp(h), None
        return x + h, stats


@dataclass
class BlocksOutput:
    """What a run of blocks returns (`forward_blocks`).

    `router_sums`: [2] fp32 running sums of the (aux, z) losses of every MoE block run so far (those
    handed in, then these blocks'), None while no MoE block has run; `router_losses` turns the sums over
    all MoE blocks into the model's losses. `tokens_per_expert`: global block index -> [E] counts of
    each MoE block of this run.
    """

    hidden: Tensor
    router_sums: Tensor | None
    tokens_per_expert: dict[int, Tensor]


def forward_blocks(
    blocks: Iterable[tuple[int, Block]],
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    router_sums: Tensor | None = None,
) -> BlocksOutput:
    """Run (global index, block) pairs in order on x [B,T,H], adding each MoE block's (aux, z) losses to
    `router_sums`: the one definition of the router losses, shared by `Mula.forward` and a pipeline
    stage (which hands the sums on to the next stage, so the same additions happen in the same order).
    """
    counts: dict[int, Tensor] = {}
    for index, block in blocks:
        x, stats = block(x, cos, sin)
        if stats is not None:
            here = torch.stack([stats.aux_loss, stats.z_loss]).float()
            router_sums = here if router_sums is None else router_sums + here
            counts[index] = stats.tokens_per_expert
    return BlocksOutput(x, router_sums, counts)


def router_losses(config: MulaConfig, router_sums: Tensor, with_mtp: bool = True) -> tuple[Tensor, Tensor]:
    """(aux, z): the means over the model's MoE layers, from the sums over all of them (`forward_blocks`);
    without the MTP modules' blocks when they did not run (`with_mtp` False: a forward without MTP ids)."""
    layers = config.num_moe_layers - (0 if with_mtp else config.mtp_depth)
    aux, z = (router_sums / layers).unbind()
    return aux, z


def check_sequence_length(config: MulaConfig, seq_len: int) -> None:
    """Refuse a sequence longer than `max_position_embeddings` (one sentence)."""
    if seq_len > config.max_position_embeddings:
        raise ValueError(
            f"Sequence length {seq_len} exceeds max_position_embeddings {config.max_position_embeddings}."
        )


@dataclass
class MulaOutput:
    """Output of `Mula.forward`. Router losses are unweighted means over the MoE layers that ran (0 if
    dense); `mtp_logits` are the MTP modules' logits, one [B, T, V] per module, when they ran."""

    logits: Tensor  # [B, T, V]
    aux_loss: Tensor  # scalar
    z_loss: Tensor  # scalar
    tokens_per_expert: Tensor | None  # [MoE layers that ran, E] long, None for dense models
    mtp_logits: tuple[Tensor, ...] = ()
    mtp_loss: Tensor | None = None  # their loss, filled in by the training module (`MulaLightningModule`)


@dataclass
class MTPOutput:
    """What the MTP modules return (`Mula.forward_mtp`): each module's logits [B, T, V], the router sums
    with their blocks' added, and their blocks' tokens per expert (global block index -> [E])."""

    logits: list[Tensor]
    router_sums: Tensor | None
    tokens_per_expert: dict[int, Tensor]


class Mula(nn.Module):
    """Decoder-only LM: embed -> blocks -> norm -> lm_head. Dense or MoE from `MulaConfig` (an MoE
    model's first `num_dense_layers` blocks dense). `sequence_shard` says which slice of each sequence
    the inputs are (`mula.model.layers.SequenceShard`: the whole one unless context parallelism sets it)."""

    def __init__(self, config: MulaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        # the main blocks, then each MTP module's block (`mula.model.mtp`)
        self.layers = nn.ModuleList(Block(config, config.is_moe_layer(i)) for i in range(config.num_blocks))
        self.norm = make_norm(config, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPModule(config) for _ in range(config.mtp_depth))
        self.sequence_shard = SequenceShard()
        self.reset_parameters()

    def set_activation_checkpointing(self, value: str | Sequence[str] | None) -> None:
        """Recompute activations in backward: "none", "full" or a list of `CHECKPOINT_PARTS`.

        A training setting, not part of the architecture (`MulaConfig` is unaffected).
        """
        parts = parse_activation_checkpointing(value)
        for block in self.layers:
            block.checkpointing = parts

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when `tie_embeddings` (re-run after `to_empty`)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Init every weight ~ truncated normal(0, init_std, ±3 std); norm weights = 1.

        Works on a model materialised from the meta device (`model.to_empty(device=...)`).
        """
        std = self.config.init_std
        self.tie_weights()
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
            elif isinstance(module, (Router, GroupedExperts)):
                module.reset_parameters(std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()

    def forward_mtp(
        self, hidden: Tensor, mtp_ids: Sequence[Tensor], cos: Tensor, sin: Tensor, router_sums: Tensor | None
    ) -> MTPOutput:
        """The MTP modules on the main model's normed last hidden state `hidden` [B,T,H] and the ids k ahead
        (`mtp_ids`, one [B,T] per module, or none: nothing runs), adding their blocks' router losses to
        `router_sums`: the one definition, which `forward` and a pipeline's last stage
        (strategies/pipeline/split.py, with its copy of the embedding) run."""
        n = self.config.num_layers
        sums, counts, logits = router_sums, {}, []
        for k, (module, ids) in enumerate(zip(self.mtp, mtp_ids)):
            # h^k = norm_k(block_k(eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1})]))), logits from the shared head
            block = self.layers[str(n + k)] if isinstance(self.layers, nn.ModuleDict) else self.layers[n + k]
            deeper = forward_blocks([(n + k, block)], module(hidden, self.embed(ids)), cos, sin, sums)
            hidden, sums = module.norm(deeper.hidden), deeper.router_sums
            counts.update(deeper.tokens_per_expert)
            logits.append(self.lm_head(hidden))
        return MTPOutput(logits, sums, counts)

    def forward(self, input_ids: Tensor, mtp_ids: Sequence[Tensor] = ()) -> MulaOutput:
        """input_ids [B,T] long (this model's slice of each sequence, `sequence_shard`) -> MulaOutput.

        `mtp_ids`: for each MTP module k (all of them, or none), the ids k ahead of the inputs' positions
        [B,T] (`mula.model.mtp.shifted_ids`, this model's slice of them); without them the modules do not run.
        """
        t = input_ids.shape[1]
        check_sequence_length(self.config, t * self.sequence_shard.count)
        if len(mtp_ids) not in (0, self.config.mtp_depth):
            raise ValueError(
                f"expected ids for all {self.config.mtp_depth} MTP modules or none, got {len(mtp_ids)}."
            )
        x = self.embed(input_ids)
        cos, sin = rope_cos_sin(self.config, t, x.device, self.sequence_shard.start(t))
        n = self.config.num_layers
        out = forward_blocks(zip(range(n), self.layers[:n]), x, cos, sin)
        hidden = self.norm(out.hidden)
        logits = self.lm_head(hidden)
        mtp = self.forward_mtp(hidden, mtp_ids, cos, sin, out.router_sums)
        sums, counts = mtp.router_sums, {**out.tokens_per_expert, **mtp.tokens_per_expert}
        if sums is not None:
            aux, z = router_losses(self.config, sums, with_mtp=bool(mtp_ids))
            counts = torch.stack(list(counts.values()))
        else:
            # a plain tensor even when the logits are a DTensor (tensor parallelism)
            aux = z = torch.zeros((), dtype=torch.float32, device=input_ids.device)
            counts = None
        return MulaOutput(logits, aux, z, counts, tuple(mtp.logits))
