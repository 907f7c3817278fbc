"""Top-k softmax router and its two auxiliary losses (load balancing and z-loss)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class RouterOutput:
    """What the router decides for N tokens over E experts."""

    logits: Tensor  # [N, E] fp32
    probs: Tensor  # [N, E] fp32 softmax over all experts
    topk_idx: Tensor  # [N, K] long, experts in descending probability
    topk_weight: Tensor  # [N, K] fp32 combine weights


class Router(nn.Module):
    """Linear gate + softmax over all experts + top-k (OLMoE / Switch style).

    The kept probabilities are used as combine weights as they are (OLMoE), or renormalised to
    sum to 1 when `norm_topk_prob`. Softmax and top-k run in fp32 so that bf16 autocast cannot
    flip near-tied routing decisions.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool = False) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Truncated-normal init (±3 std)."""
        nn.init.trunc_normal_(self.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: Tensor) -> RouterOutput:
        """x: [N, H] -> routing for each of the N tokens."""
        logits = F.linear(x, self.weight).float()
        probs = logits.softmax(dim=-1)
        topk_weight, topk_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)
        return RouterOutput(logits, probs, topk_idx, topk_weight)


def expert_counts(topk_idx: Tensor, num_experts: int) -> Tensor:
    """Number of (token, slot) assignments per expert, [E] long, without a host sync."""
    flat = topk_idx.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def load_balancing_loss(probs: Tensor, counts: Tensor) -> Tensor:
    """Switch/OLMoE load-balancing loss `E * sum_i f_i * P_i` over the tokens of one layer.

    f_i = assignments to expert i / tokens (so f sums to top_k, as transformers'
    `load_balancing_loss_func`), P_i = mean router probability of expert i. Gradients flow
    through P only. Equals top_k when routing is perfectly uniform.
    """
    num_tokens, num_experts = probs.shape
    f = counts.to(probs.dtype) / num_tokens
    return num_experts * (f * probs.mean(dim=0)).sum()


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE z-loss: mean over tokens of logsumexp(router logits)^2; keeps logits small."""
    return torch.logsumexp(logits, dim=-1).square().mean()
