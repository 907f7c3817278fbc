"""The building blocks every kind of block shares: norms, RoPE and the dense SwiGLU MLP.

Kept apart from `mula.model.transformer` so that the MoE layer (shared experts) and multi-head latent attention
(`mula.model.mla`) use the same pieces without importing the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mula.model.config import MulaConfig


class RMSNorm(nn.Module):
    """RMSNorm with a weight; normalises in fp32 (as OLMoE) and multiplies after casting back."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Weight back to ones."""
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        """Normalise the last dimension."""
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * y.to(x.dtype)


class LayerNorm(nn.Module):
    """OLMo-1B's non-parametric LayerNorm (no weight, no bias), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """Normalise the last dimension."""
        return F.layer_norm(x.float(), (self.dim,), eps=self.eps).to(x.dtype)


def make_norm(config: MulaConfig, dim: int) -> nn.Module:
    """The norm `config.norm` names, over `dim` features."""
    return RMSNorm(dim, config.norm_eps) if config.norm == "rmsnorm" else LayerNorm(dim, config.norm_eps)


def rope_cos_sin(
    config: MulaConfig, seq_len: int, device: torch.device, start: int = 0
) -> tuple[Tensor, Tensor]:
    """fp32 RoPE tables [T, head_dim] for positions start..start+T-1 (halves layout, as transformers'
    Llama/OLMo); `start` > 0 for a slice of a longer sequence (context parallelism).

    Recomputed each forward (cheap, [T, head_dim]) instead of stored as a buffer, so a model built
    on the meta device needs no buffer re-initialisation.
    """
    d = config.rope_dim  # the whole head, or MLA's rotated part
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    positions = torch.arange(start, start + seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """Causal SDPA of q [B, heads, T, d] over k, v [B, kv_heads, T, d] (kv_heads dividing heads, GQA).

    The attention a layer's `core` runs by default; context parallelism replaces the core with one
    that exchanges heads for sequence around this very function (strategies/context_parallel.py).
    """
    if k.shape[1] != q.shape[1]:
        # repeat kv heads explicitly: portable to every SDPA backend (XPU, CUDA, CPU)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


class SequenceShard:
    """Which contiguous slice of every sequence a model holds: the `index`-th of `count` equal ones.

    A plain object held by `Mula.sequence_shard` (the whole sequence: index 0 of 1), replaced from
    outside under context parallelism: the module slices inputs and targets with `take`, and the model
    starts its RoPE positions at `start` (global positions, as one process's).
    """

    def __init__(self, index: int = 0, count: int = 1) -> None:
        self.index, self.count = index, count

    def __repr__(self) -> str:
        return f"SequenceShard(index={self.index}, count={self.count})"

    def take(self, t: Tensor) -> Tensor:
        """This slice of t [B, S, ...] along the sequence (S divisible by `count`, else one sentence)."""
        if self.count == 1:
            return t
        from mula.layout.rules import check_sequence_split

        check_sequence_split(t.shape[1], self.count)
        return t.chunk(self.count, dim=1)[self.index]

    def start(self, local_len: int) -> int:
        """The global position of this slice's first token, its slices being `local_len` long."""
        return self.index * local_len


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, heads, T, head_dim] by position; in fp32 (bf16 rotations lose position detail)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class MLP(nn.Module):
    """Dense SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """x [B,T,H] -> [B,T,H]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
