"""Multi-token prediction (MTP), DeepSeek-V3 section 2.2: `mtp_depth` sequential modules after the model.

Module k (1..D) predicts the token k + 1 ahead of each position i. Its input is the previous depth's
representation h^{k-1}_i, the one the output head maps linearly to logits (the paper's OutHead is linear:
h^0 is the main model's last hidden state after its final norm, h^k after module k's own norm, which
DeepSeek-V3's checkpoints call `shared_head.norm`; transformers' and vLLM's MTP layers chain the same
normed states), and the embedding of the token k ahead, t_{i+k}:

    h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])        (2h -> h)
    h^k  = norm_k(Block_k(h'))                                       (causal, positions 1..T-k)
    p^k  = lm_head(h^k)                                              (predicts t_{i+k+1})
    L_MTP = 1 / D * sum_k CE(p^k, t_{i+k+1}),  loss = CE + mtp_loss_weight * L_MTP

The embedding and the LM head are the main model's (shared). `eh_proj` takes the embedding first: the
column order of DeepSeek-V3's published `eh_proj` weights (as transformers' `MtpLayer`, vLLM and SGLang
read them; the paper writes the hidden state first, a permutation of the same matrix's columns).

Instead of truncating depth k's sequence to T-k positions, every depth keeps all T positions (Megatron's
"roll and mask"): the ids k ahead are padded at the end (`shifted_ids`) and the targets with
`IGNORE_INDEX` (`shifted_targets`). Causal attention makes the kept positions' values those of the
truncated sequence, and the sequence keeps its length, so context parallelism slices every depth as it
slices the main model. The padded positions still pass through the module's MoE layer (routed, counted
in the router losses and the expert counts, as under Megatron), but carry no loss.

Module k's block is the model's block `num_layers + k - 1` (`Mula.layers`, DeepSeek-V3's
`model.layers.61`), so every strategy that lays out the blocks (expert, tensor, context parallelism,
recompute, compile) lays out the MTP blocks too; this module holds the rest (`MTPModule`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from mula.model.config import MulaConfig
from mula.model.layers import make_norm

IGNORE_INDEX = -100  # cross_entropy's default ignore_index: a padded target of a deeper module


class MTPModule(nn.Module):
    """One MTP module's own weights (its block is `Mula.layers[num_layers + k]`): the two input norms,
    the 2h -> h projection and the output norm before the shared LM head (DeepSeek-V3's `enorm`,
    `hnorm`, `eh_proj`, `shared_head.norm`)."""

    def __init__(self, config: MulaConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.enorm = make_norm(config, h)
        self.hnorm = make_norm(config, h)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.norm = make_norm(config, h)

    def forward(self, hidden: Tensor, embedded: Tensor) -> Tensor:
        """The previous depth's hidden [B,T,H] and the embeddings of the tokens k ahead [B,T,H] -> the
        block's input [B,T,H]."""
        return self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))


def check_mtp_sequence(depth: int, seq_len: int) -> None:
    """Refuse sequences too short for `depth` MTP modules (the deepest predicts `depth` + 1 tokens ahead)."""
    if depth and seq_len <= depth:
        raise ValueError(f"mtp_depth={depth} needs sequences longer than {depth} tokens, got {seq_len}.")


def shifted_ids(batch: Tensor, depth: int) -> Tensor:
    """The ids `depth` ahead of each input position of `batch` [B, T + 1] (inputs `batch[:, :T]`): [B, T],
    the last `depth - 1` padded with id 0 (their targets are `IGNORE_INDEX`)."""
    ids = batch[:, depth:]
    return F.pad(ids, (0, depth - 1), value=0)


def shifted_targets(batch: Tensor, depth: int) -> Tensor:
    """The targets of MTP module `depth`: the ids `depth + 1` ahead [B, T], the last `depth` `IGNORE_INDEX`."""
    return F.pad(batch[:, depth + 1 :], (0, depth), value=IGNORE_INDEX)


def mtp_cross_entropy(logits: Tensor, targets: Tensor, depth: int, seq_len: int, shards: int) -> Tensor:
    """Module `depth`'s mean cross-entropy over its `seq_len - depth` real targets per sequence.

    `logits` [B, t, V] and `targets` [B, t] are this rank's slice (t = seq_len / `shards` under context
    parallelism); the sum over the slice is divided by the slice's share of the whole batch's real
    targets, so the mean over the `shards` ranks (which their gradient reduction takes) is the batch's mean.
    """
    total = F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    if isinstance(total, DTensor):  # vocabulary-parallel logits (tensor parallelism): a replicated loss
        total = total.full_tensor()
    return total * shards / (targets.shape[0] * (seq_len - depth))
