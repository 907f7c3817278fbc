"""The MoE layer: router -> dispatcher.dispatch -> grouped experts -> dispatcher.combine (+ shared experts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mula.model.config import MulaConfig
from mula.model.kernels.capacity import dropped_choices
from mula.model.layers import MLP
from mula.model.moe.balancing import GlobalLoad, TokenSplit
from mula.model.moe.dispatcher import Dispatcher, LocalDispatcher
from mula.model.moe.dropping import DropTally
from mula.model.moe.experts import GroupedExperts
from mula.model.moe.router import Router, expert_counts
from mula.model.moe_capacity import capacity_of


@dataclass
class MoEStats:
    """Per-layer router losses (unweighted) and load, returned alongside the layer output."""

    aux_loss: Tensor  # scalar, E * sum_i f_i P_i
    z_loss: Tensor  # scalar, mean logsumexp(logits)^2
    tokens_per_expert: Tensor  # [E] long, assignments per expert of this rank's tokens (sums to N*K)


class MoELayer(nn.Module):
    """Top-k mixture of SwiGLU experts (OLMoE; dropless unless `capacity_factor`: `capacity`), plus
    DeepSeek's shared experts when the config has some: `shared_experts`, one SwiGLU of `num_shared_experts * shared_expert_intermediate_size` features
    every token goes through, added to the routed output. It is a dense module (its parameter names hold
    no `experts` module, see `mula.model.param_names.is_expert_param`): replicated over the expert-parallel
    group and sharded by the optimizer like any dense weight.

    `dispatcher` is a plain attribute holding any `Dispatcher` (not a submodule: it has no state):
    the expert-parallel strategy replaces it (and slices `experts`) without touching this code.
    `token_split` (a `TokenSplit`, also a plain attribute) says which share of the micro-batch's tokens
    this layer sees: all of them, or 1/T under tensor parallelism (the strategy replaces it); the router
    losses are those of the whole micro-batch either way.
    """

    def __init__(self, config: MulaConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.router = Router(
            config.hidden_size,
            config.num_experts,
            config.top_k,
            config.norm_topk_prob,
            use_bias=config.has_router_bias,
            mode=config.routing_mode,
            scoring=config.router_scoring,
            n_group=config.n_group,
            topk_group=config.topk_group,
            scaling_factor=config.routed_scaling_factor,
        )
        self.experts = GroupedExperts(
            config.num_experts, config.hidden_size, config.expert_intermediate_size, config.expert_backend
        )
        self.shared_experts = (
            MLP(config.hidden_size, config.shared_intermediate_size) if config.num_shared_experts else None
        )
        # capacity_factor: each expert keeps at most C of a micro-batch's choices (None: dropless)
        self.capacity = capacity_of(config)
        self.dispatcher: Dispatcher = LocalDispatcher(
            config.num_experts, config.expert_backend, self.capacity
        )
        self.drops = DropTally()  # what the capacity dropped, for the metrics (`mula.model.moe.dropping`)
        self.token_split = TokenSplit()
        # aux_loss_scope="global": f over the step's global batch (training only; eval stays local)
        self.global_load = GlobalLoad() if config.aux_loss_scope == "global" else None
        # aux_loss_scope="sequence": the balance loss per sequence, averaged (`TokenSplit.sequence_aux_loss`)
        self.per_sequence = config.aux_loss_scope == "sequence"

    def extra_repr(self) -> str:
        return f"dispatcher={self.dispatcher!r}"

    def forward(self, x: Tensor) -> tuple[Tensor, MoEStats]:
        """x [B,T,H] -> (y [B,T,H], MoEStats)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        route = self.router(x)
        y, counts, f = self.routed(x, route.topk_idx, route.topk_weight)
        sequences = shape[0] if self.per_sequence else None  # x is [B, T, H]: B sequences' tokens
        aux, z = self.token_split.router_losses(route, counts, f, sequences)
        stats = MoEStats(aux, z, counts)
        y = y.view(shape)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x).view(shape)
        return y, stats

    @torch.compiler.disable
    def routed(
        self, x: Tensor, topk_idx: Tensor, topk_weight: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """The routed experts of x [N,H]: (y [N,H] = the weighted sum of each token's K expert outputs,
        counts [E] long, the global-scope frequencies f [E] or None).

        Everything here has data-dependent sizes or host-side state (the dispatch's rows per expert, the
        CPU kernels' bucketed layout planned from host counts, the expert-parallel all-to-all's split
        sizes, `GlobalLoad`'s running sums, the capacity's `drops` tally), while what goes in and comes out has static shapes. So
        `torch.compile` leaves it to its own kernels (`torch.compiler.disable`): one graph break per MoE
        block, and no recompilation however routing changes (docs/compile.md).
        """
        x_grouped, grouping, state = self.dispatcher.dispatch(x, topk_idx, topk_weight)
        y = self.dispatcher.combine(self.experts(x_grouped, grouping), state)
        counts = expert_counts(topk_idx, self.num_experts)
        if self.capacity is not None:  # what it dropped, for the metrics: from the counts, on the device
            n, k = topk_idx.shape
            self.drops.add(dropped_choices(counts, self.capacity.slots(n, k, self.num_experts)), n * k)
        f = None
        if self.global_load is not None and torch.is_grad_enabled():
            f = self.global_load.frequencies(counts, x.shape[0])
        return y, counts, f
