"""Grouped SwiGLU experts, weights stacked so each projection is one grouped GEMM."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mula.model.kernels import ExpertGrouping, grouped_swiglu


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs stored stacked: gate_up [E, 2I, H] (gate rows, then up), down [E, H, I].

    The expert-parallel strategy keeps a slice of the stacks on each rank (names contain ".experts.").
    The compute is one `mula.model.kernels.grouped_swiglu` call (grouped GEMMs with the SwiGLU fused where the
    backend can), so faster kernels swap in behind `backend`.
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, backend: str = "auto"
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.backend = backend
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Truncated-normal init (±3 std)."""
        for w in (self.gate_up, self.down):
            nn.init.trunc_normal_(w, std=std, a=-3 * std, b=3 * std)

    def forward(self, x_grouped: Tensor, grouping: ExpertGrouping) -> Tensor:
        """x_grouped [M,H] grouped by expert, as the dispatcher's `grouping` says (tokens per expert
        [E] long, or the routing plan that wrote the rows) -> [M,H] in the same rows."""
        return grouped_swiglu(x_grouped, self.gate_up, self.down, grouping, self.backend)

    def extra_repr(self) -> str:
        e, i2, h = self.gate_up.shape
        return f"num_experts={e}, hidden={h}, intermediate={i2 // 2}, backend={self.backend!r}"
