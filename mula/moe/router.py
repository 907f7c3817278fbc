"""Top-k softmax router and its two auxiliary losses (load balancing and z-loss).

Two routing settings beyond OLMoE's: a per-expert bias buffer added to the probabilities for the
top-k choice only (auxiliary-loss-free balancing, DeepSeek-V3; `mula.moe.balancing` updates it), and
a `uniform` mode that spreads the assignments evenly over the experts whatever the scores (for
benchmarks that isolate kernels and communication from routing skew, as Optimus' forced routing).
"""

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

    With `use_bias`, the router holds a persistent fp32 buffer `bias` [E] (zeros at init) added to the
    probabilities to choose the top-k experts; the combine weights stay the unbiased probabilities.
    `mode="uniform"` sends the assignment (n, k) to expert (n*K + k) mod E: every expert gets the
    same count within one, the K experts of a token are distinct, and the combine weights are still
    the router's probabilities of those experts (so the router keeps a gradient).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool = False,
        use_bias: bool = False,
        mode: str = "learned",
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.mode = mode
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias: Tensor | None
        if use_bias:
            self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.bias = None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Truncated-normal init (±3 std); a zero bias."""
        nn.init.trunc_normal_(self.weight, std=std, a=-3 * std, b=3 * std)
        if self.bias is not None:
            self.bias.zero_()

    def _apply(self, fn, recurse: bool = True):
        # The bias stays fp32 under `.to(bf16)`: its updates (rate ~1e-3) vanish in bf16 once it grows.
        super()._apply(fn, recurse)
        if self.bias is not None and self.bias.is_floating_point() and self.bias.dtype != torch.float32:
            self.bias = self.bias.float()
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # Weights without a bias (imported, or trained without balancing) start balancing from zero.
        if self.bias is not None and prefix + "bias" not in state_dict:
            state_dict[prefix + "bias"] = torch.zeros_like(self.bias, device="cpu")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: Tensor) -> RouterOutput:
        """x: [N, H] -> routing for each of the N tokens."""
        logits = F.linear(x, self.weight).float()
        probs = logits.softmax(dim=-1)
        if self.mode == "uniform":
            n = probs.shape[0]
            flat = torch.arange(n * self.top_k, device=probs.device) % self.num_experts
            topk_idx = flat.view(n, self.top_k)
            topk_weight = probs.gather(1, topk_idx)
        elif self.bias is not None:
            topk_idx = torch.topk(probs.detach() + self.bias, self.top_k, dim=-1).indices
            topk_weight = probs.gather(1, topk_idx)
        else:
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


def load_balancing_loss(probs: Tensor, counts: Tensor, frequencies: Tensor | None = None) -> Tensor:
    """Switch/OLMoE load-balancing loss `E * sum_i f_i * P_i` over the tokens of one layer.

    f_i = assignments to expert i / tokens (so f sums to top_k, as transformers'
    `load_balancing_loss_func`), P_i = mean router probability of expert i. Gradients flow
    through P only. Equals top_k when routing is perfectly uniform. `frequencies` [E] replaces the
    f taken from this batch's `counts` (the global scope's f over the whole batch of all ranks).
    """
    num_tokens, num_experts = probs.shape
    f = counts.to(probs.dtype) / num_tokens if frequencies is None else frequencies.to(probs.dtype)
    return num_experts * (f * probs.mean(dim=0)).sum()


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE z-loss: mean over tokens of logsumexp(router logits)^2; keeps logits small."""
    return torch.logsumexp(logits, dim=-1).square().mean()
