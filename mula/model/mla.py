"""Multi-head latent attention (MLA, DeepSeek-V2/V3), computed as transformers' `DeepseekV3Attention`.

Keys and values come from a small per-token latent: `kv_a_proj_with_mqa` projects the input to
`kv_lora_rank` latent features plus one `qk_rope_head_dim` RoPE key shared by every head; the latent
is RMS-normalised and `kv_b_proj` expands it into each head's `qk_nope_head_dim` key features and
`v_head_dim` value features. Queries come from a `q_lora_rank` latent the same way (`q_a_proj`,
`q_a_layernorm`, `q_b_proj`), or from one plain `q_proj` when `q_lora_rank` is None (DeepSeek-V2-Lite).
Each head's query and key are [no-RoPE part | RoPE part]; the scores are scaled by
1/sqrt(qk_nope_head_dim + qk_rope_head_dim). Parameter names are transformers' own, so the
Hugging Face conversion (`mula.hf.deepseek_v3`) renames nothing inside the attention.

RoPE layout: DeepSeek's weights produce the rotated features as interleaved pairs (x0, x1), (x2, x3), ...
(transformers' `rope_interleave=True`, the only layout Mula supports). They are de-interleaved to
[evens | odds] and rotated with `mula.model.layers.apply_rope`'s halves layout, which is exactly
transformers' `apply_rotary_pos_emb_interleave` (its output is in that order too). YaRN's scaling of the
tables and of the softmax (`mscale`) is not supported: a config asking for it is refused on import.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mula.model.config import MulaConfig
from mula.model.layers import RMSNorm, apply_rope, causal_attention

# transformers (and DeepSeek's reference code) build the latent norms with RMSNorm's default eps,
# not the model's rms_norm_eps
LATENT_NORM_EPS = 1e-6


def deinterleave(x: Tensor) -> Tensor:
    """[..., (x0, x1), (x2, x3), ...] -> [..., x0, x2, ..., x1, x3, ...]: DeepSeek's RoPE pairs to halves."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    """Causal multi-head latent attention with RoPE on a per-head slice and one shared RoPE key, via SDPA."""

    def __init__(self, config: MulaConfig) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_heads
        self.num_heads = heads
        self.nope_dim, self.rope_dim, self.v_dim = (
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
        )
        self.kv_rank = int(config.kv_lora_rank or 0)
        qk_dim = self.nope_dim + self.rope_dim
        self.scale = qk_dim**-0.5  # transformers' scaling without YaRN's mscale
        # registration order = transformers' (and `MulaConfig._attn_shapes`')
        self.q_lora_rank = config.q_lora_rank  # None: queries by one plain projection, `q_proj`
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=False)
        # what attends q over k, v (replaced from outside under context parallelism, as `Attention.core`)
        self.core: Callable[..., Tensor] = causal_attention

    def _queries(self, x: Tensor) -> Tensor:
        if self.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B,T,H] -> [B,T,H]; `cos`/`sin` are the [T, qk_rope_head_dim] tables (`rope_cos_sin`)."""
        b, t, _ = x.shape
        q = self._queries(x).view(b, t, self.num_heads, -1).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        k_nope, v = (
            kv.view(b, t, self.num_heads, -1).transpose(1, 2).split([self.nope_dim, self.v_dim], dim=-1)
        )
        q_rot = apply_rope(deinterleave(q_rot), cos, sin)
        k_rot = apply_rope(deinterleave(k_rot.view(b, 1, t, self.rope_dim)), cos, sin)
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(b, self.num_heads, t, self.rope_dim)), dim=-1)
        # SDPA's fused kernels want one head width for q, k and v (CPU falls back to the T x T math
        # path otherwise): zero-pad the narrower side; the padded columns add nothing to the scores and
        # come out as zeros, sliced away
        width = max(q.shape[-1], self.v_dim)
        q, k, v = (F.pad(z, (0, width - z.shape[-1])) if z.shape[-1] < width else z for z in (q, k, v))
        y = self.core(q, k, v, self.scale)
        return self.o_proj(y[..., : self.v_dim].transpose(1, 2).reshape(b, t, -1))
