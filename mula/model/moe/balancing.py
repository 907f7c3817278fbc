"""Keeping MoE routing balanced beyond the per-micro-batch auxiliary loss.

* `GlobalLoad` (aux_loss_scope="global"): the load-balancing loss's expert frequencies f_i taken over
  the step's whole global batch instead of one micro-batch, as Megatron-Core's global auxiliary loss.
  Each micro-batch all-reduces its [E] counts (and token count) over the data-parallel world and adds
  them to the step's running sum; the loss uses f = running counts / running tokens, so the gradient
  flows through the local probabilities only. With one micro-batch per rank, f is exactly the global
  batch's; with gradient accumulation, micro-batch m uses the first m micro-batches of every rank
  (the later ones do not exist yet when its backward runs).
* `update_router_bias` (router_bias_update_rate > 0): auxiliary-loss-free balancing (DeepSeek-V3),
  bias_i += rate * sign(mean load - load_i) after each optimizer step, from the step's token counts
  summed over all micro-batches and ranks (`step_counts`: one all-reduce of [layers, E] per step), so
  every rank computes the same bias from the same numbers.
* `TokenSplit.sequence_aux_loss` (aux_loss_scope="sequence"): the load-balancing loss per sequence,
  averaged over the micro-batch's sequences (DeepSeek-V3's sequence-wise balance loss); a sequence split
  over context- or tensor-parallel ranks is summed over them first, so every layout gives the same loss.
* `TokenSplit`: how many ranks share the tokens of one micro-batch at an MoE layer. The plain model's
  layer holds them all (`TokenSplit()`, the identity); under tensor parallelism each TP rank routes
  1/T of them (`strategies.tensor_parallel_moe`), and `router_losses` takes the aux loss's
  frequencies and mean probabilities and the z loss's mean over the whole micro-batch, as one process.

Both global sums above add this rank's own counts over every rank: under tensor parallelism a TP rank
counts only its 1/T of the micro-batch's tokens, so the sums stay exact (each token counted once).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from mula.model.moe.router import Router, RouterOutput, load_balancing_loss, router_z_loss
from mula.torch_compat import running_backward


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(t: Tensor) -> Tensor:
    """t summed over every rank of the default process group (t itself without one); no host sync."""
    if _distributed():
        dist.all_reduce(t)
    return t


def _recomputing() -> bool:
    # a forward inside backward is activation checkpointing's recompute: it must see the same f, and
    # must not count its tokens twice
    return running_backward()


class GlobalLoad:
    """One MoE layer's expert frequencies over the step's global batch (see the module docstring).

    A plain object held by `MoELayer` (no state-dict entry). Call `reset` at each optimizer step.
    """

    def __init__(self) -> None:
        self._sum: Tensor | None = None  # [E + 1]: counts per expert, then tokens
        self._last: Tensor | None = None

    def frequencies(self, counts: Tensor, num_tokens: int) -> Tensor:
        """f [E] fp32 = assignments per expert / tokens over this step's micro-batches so far on all ranks."""
        if _recomputing() and self._last is not None:
            return self._last
        local = torch.cat((counts, counts.new_tensor([num_tokens])))
        local = all_reduce_sum(local)
        self._sum = local if self._sum is None else self._sum + local
        self._last = self._sum[:-1].float() / self._sum[-1].float()
        return self._last

    def reset(self) -> None:
        """Start a new optimizer step."""
        self._sum = self._last = None


def step_counts(counts: Tensor) -> Tensor:
    """[layers, E] counts of this rank's micro-batches -> summed over all ranks (one all-reduce)."""
    return all_reduce_sum(counts.clone())


@torch.no_grad()
def update_router_bias(routers: Iterable[Router], counts: Tensor, rate: float) -> None:
    """bias += rate * sign(mean load - load) for each router, from its row of global counts [layers, E]."""
    for router, load in zip(routers, counts.float()):
        if router.bias is not None:
            router.bias.add_(torch.sign(load.mean() - load), alpha=rate)


class TokenSplit:
    """The tokens of a micro-batch at an MoE layer, all on this process (the plain model's layer).

    A plain object held by `MoELayer.token_split`, replaced from outside when ranks share the tokens
    (as `MoELayer.dispatcher` is): `parts` ranks, each holding an equal share, and `total`, the sum over
    them of a per-rank tensor.
    """

    parts = 1

    def total(self, t: Tensor) -> Tensor:
        """t summed over the ranks sharing the micro-batch; its backward is the identity (every rank's
        loss holds the same total, so each rank's share of the gradient is already whole)."""
        return t

    def router_losses(
        self, route: RouterOutput, counts: Tensor, frequencies: Tensor | None, sequences: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """(aux, z) of the whole micro-batch from this rank's `route` and `counts` [E]: the aux loss's
        frequencies (`frequencies` when the global scope gives them) and mean probabilities and the z
        loss's mean over every token of the micro-batch, whichever rank routed it. With `sequences` (the
        sequence scope: this rank's tokens are that many sequences' slices, in order) the aux loss is
        `sequence_aux_loss`."""
        if self.parts == 1 and sequences is None:
            return load_balancing_loss(route.probs, counts, frequencies), router_z_loss(route.logits)
        share = 1.0 / self.parts  # each rank holds 1/parts of the tokens: its mean counts that much
        z = self.total(router_z_loss(route.logits) * share)
        if sequences is not None:
            return self.sequence_aux_loss(route, sequences), z
        mean_probs = self.total(route.probs.mean(dim=0, keepdim=True) * share)  # [1, E]
        if frequencies is None:
            frequencies = self.total(counts).float() / (route.probs.shape[0] * self.parts)
        return load_balancing_loss(mean_probs, counts, frequencies), z

    def sequence_aux_loss(self, route: RouterOutput, sequences: int) -> Tensor:
        """aux_loss_scope="sequence": the mean over the micro-batch's sequences of E * sum_i f_i P_i taken
        per sequence (DeepSeek-V3's complementary sequence-wise balance loss, eq. 17-20, times top_k):
        f_i = the sequence's choices of expert i / its tokens, P_i = the mean of its tokens' probabilities.

        This rank's N tokens are `sequences` equal slices, one per sequence in order (x [B, t, H]
        flattened); the ranks sharing the micro-batch (`parts`: context and tensor parallelism) hold the
        other slices of the same sequences, so each sequence's [E] counts and probability sums are
        `total`s over them before the product: a sequence split over C ranks is still one sequence.
        """
        n, e = route.probs.shape
        tokens = n // sequences * self.parts  # each sequence's tokens, on all the ranks sharing it
        prob_sums = self.total(route.probs.view(sequences, -1, e).sum(dim=1))  # [B, E]
        counts = self.total(sequence_counts(route.topk_idx, sequences, e))  # [B, E] (no gradient)
        return e * (counts * prob_sums).sum(dim=1).mean() / tokens**2


def sequence_counts(topk_idx: Tensor, sequences: int, num_experts: int) -> Tensor:
    """[B, E] fp32: the choices of each expert among each sequence's tokens (`topk_idx` [B * t, K], the
    sequences' tokens in order); exact in fp32 up to 2^24 choices, without a host sync."""
    idx = topk_idx.reshape(sequences, -1)
    ones = torch.ones(idx.shape, dtype=torch.float32, device=idx.device)
    return torch.zeros(sequences, num_experts, device=idx.device).scatter_add_(1, idx, ones)
