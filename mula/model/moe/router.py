"""The top-k router and its two auxiliary losses (load balancing and z-loss).

Scoring: `softmax` over all experts (OLMoE, Qwen3-MoE) or an independent `sigmoid` per expert
(DeepSeek-V3). Beyond that, all off by default:

* a per-expert bias buffer added to the scores for the top-k choice only (auxiliary-loss-free
  balancing, DeepSeek-V3's `e_score_correction_bias`; `mula.model.moe.balancing` updates it);
* group-limited routing (DeepSeek-V3): the E experts form `n_group` equal groups, each token keeps the
  `topk_group` groups whose two best (biased) scores sum highest and picks its top-k inside them;
* renormalising the kept scores to sum to 1 (`norm_topk_prob`) and scaling the combine weights by
  `routed_scaling_factor`;
* a `uniform` mode that spreads the assignments evenly over the experts whatever the scores (for
  benchmarks that isolate kernels and communication from routing skew, as Optimus' forced routing).

The semantics are those of transformers' `DeepseekV3TopkRouter` (sigmoid) and `OlmoeSparseMoeBlock` /
`Qwen3MoeTopKRouter` (softmax); `tests/test_router_scoring.py` checks them against a reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SCORINGS = ("softmax", "sigmoid")


@dataclass
class RouterOutput:
    """What the router decides for N tokens over E experts."""

    logits: Tensor  # [N, E] fp32
    # [N, E] fp32, each row a distribution over all experts, for the load-balancing loss: the softmax,
    # or under sigmoid scoring the sigmoid scores divided by their sum (DeepSeek-V3's s'_{i,t})
    probs: Tensor
    topk_idx: Tensor  # [N, K] long
    topk_weight: Tensor  # [N, K] fp32 combine weights


def limit_to_groups(choice: Tensor, n_group: int, topk_group: int) -> Tensor:
    """`choice` [N, E] with the experts outside each token's `topk_group` best groups set to -inf.

    The E experts are `n_group` contiguous groups; a group's score is the sum of its two highest
    entries of `choice` (DeepSeek-V3, as transformers computes it, bias included).
    """
    n, e = choice.shape
    grouped = choice.view(n, n_group, e // n_group)
    scores = group_scores(choice, n_group)
    keep = torch.zeros_like(scores, dtype=torch.bool)
    keep.scatter_(1, scores.topk(topk_group, dim=-1).indices, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, e)


def group_scores(choice: Tensor, n_group: int) -> Tensor:
    """[N, n_group]: each of the `n_group` contiguous groups' score, the sum of its two highest entries."""
    n, e = choice.shape
    return choice.view(n, n_group, e // n_group).topk(2, dim=-1).values.sum(dim=-1)


class Router(nn.Module):
    """Linear gate -> scores (softmax or sigmoid) -> top-k, with the options of the module docstring.

    The combine weights are the chosen experts' unbiased scores, renormalised to sum to 1 when
    `norm_topk_prob`, then multiplied by `scaling_factor`. Scoring and top-k run in fp32 so that bf16
    autocast cannot flip near-tied routing decisions.

    With `use_bias`, the router holds a persistent fp32 buffer `bias` [E] (zeros at init) added to the
    scores to choose the experts (and the groups); the combine weights stay unbiased.
    `mode="uniform"` sends the assignment (n, k) to expert (n*K + k) mod E: every expert gets the
    same count within one, the K experts of a token are distinct, and the combine weights are still
    the router's scores of those experts (so the router keeps a gradient).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool = False,
        use_bias: bool = False,
        mode: str = "learned",
        scoring: str = "softmax",
        n_group: int = 1,
        topk_group: int = 1,
        scaling_factor: float = 1.0,
    ) -> None:
        super().__init__()
        if scoring not in SCORINGS:
            raise ValueError(f"Router scoring must be one of {SCORINGS}, got {scoring!r}.")
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.mode = mode
        self.scoring = scoring
        self.n_group, self.topk_group = n_group, topk_group
        self.scaling_factor = scaling_factor
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

    def scores(self, logits: Tensor) -> Tensor:
        """The experts' scores [N, E] (fp32): softmax or sigmoid of the router's logits."""
        return logits.softmax(dim=-1) if self.scoring == "softmax" else logits.sigmoid()

    def choice(self, scores: Tensor) -> Tensor:
        """What top-k picks from (no gradient): the scores, plus the balancing bias, limited to each token's
        best groups (`limit_to_groups`)."""
        choice = scores.detach() if self.bias is None else scores.detach() + self.bias
        if self.n_group > 1:
            choice = limit_to_groups(choice, self.n_group, self.topk_group)
        return choice

    def forward(self, x: Tensor) -> RouterOutput:
        """x: [N, H] -> routing for each of the N tokens."""
        logits = F.linear(x, self.weight).float()
        scores = self.scores(logits)
        probs = scores if self.scoring == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        if self.mode == "uniform":
            n = scores.shape[0]
            flat = torch.arange(n * self.top_k, device=scores.device) % self.num_experts
            topk_idx = flat.view(n, self.top_k)
        else:
            # the weights below take the scores' gradient (as torch.topk's values), the choice none
            topk_idx = torch.topk(self.choice(scores), self.top_k, dim=-1).indices
        topk_weight = scores.gather(1, topk_idx)
        if self.norm_topk_prob:
            # + 1e-20 as DeepSeek-V3 (tiny sigmoid scores); it rounds away against softmax top-k sums
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scaling_factor != 1.0:
            topk_weight = topk_weight * self.scaling_factor
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
    `load_balancing_loss_func`), P_i = mean router probability of expert i (`RouterOutput.probs`: the
    softmax, or under sigmoid scoring the normalised sigmoid scores, which makes this DeepSeek-V3's
    complementary balance loss times top_k, over the batch instead of one sequence). Gradients flow
    through P only. Equals top_k when routing is perfectly uniform. `frequencies` [E] replaces the
    f taken from this batch's `counts` (the global scope's f over the whole batch of all ranks).
    """
    num_tokens, num_experts = probs.shape
    f = counts.to(probs.dtype) / num_tokens if frequencies is None else frequencies.to(probs.dtype)
    return num_experts * (f * probs.mean(dim=0)).sum()


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE z-loss: mean over tokens of logsumexp(router logits)^2; keeps logits small.

    The same quantity under sigmoid scoring (a smooth bound on the largest logit's magnitude);
    DeepSeek-V3 trains without one (`router_z_loss_coef: 0`).
    """
    return torch.logsumexp(logits, dim=-1).square().mean()
