"""The Qwen3-MoE family's Hugging Face config mapping (transformers' `Qwen3MoeForCausalLM`).

Only the config differs from OLMoE: the weights use the same names (`q_norm`/`k_norm` are per-head
weights of `head_dim`, `mlp.gate` the router, per-expert or fused experts, `mlp.{gate,up,down}_proj`
for dense blocks), so `mula.hf.weights` and `mula.hf` convert the state dicts and files for both, and
`mula.hf.config` dispatches the config here on `model_type` ("qwen3_moe") and on `qk_norm_per_head`
for export.

Mapping: `head_dim` <-> `head_dim` (decoupled from hidden/heads), `moe_intermediate_size` <->
`expert_intermediate_size`, `intermediate_size` <-> `intermediate_size` (the dense blocks' width), and
the dense blocks: transformers makes block i dense when i is in `mlp_only_layers` or (i + 1) is not a
multiple of `decoder_sparse_step`; Mula's dense blocks are the first `num_dense_layers`, so a config
whose dense blocks are not a prefix is refused. Qwen3-MoE has no z-loss: import sets
`router_z_loss_coef` 0.
"""

from __future__ import annotations

from typing import Any

from mula.model.config import MulaConfig

MODEL_TYPE = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"


def exports(config: MulaConfig) -> bool:
    """True when `config` belongs to this family on export (an MoE model with per-head QK-norm)."""
    return config.is_moe and config.qk_norm_per_head


def _dense_prefix(d: dict[str, Any], layers: int) -> int:
    """Number of leading dense blocks of a Qwen3-MoE config; refuses any other dense pattern."""
    step = int(d.get("decoder_sparse_step", 1))
    only = set(d.get("mlp_only_layers") or [])
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}.")
    moe = [i not in only and (i + 1) % step == 0 for i in range(layers)]
    first = moe.index(True) if any(moe) else layers
    if first == layers or not all(moe[first:]):
        dense = [i for i, m in enumerate(moe) if not m]
        raise ValueError(
            f"decoder_sparse_step={step} and mlp_only_layers={sorted(only)} make blocks {dense} dense; "
            "Mula's dense blocks are the first num_dense_layers with every later block MoE, so it "
            "cannot express this model."
        )
    return first


def config_from_hf(d: dict[str, Any], name: str, rope_theta: float) -> MulaConfig:
    """MulaConfig from a transformers Qwen3-MoE config dict; missing keys take transformers' defaults.

    `rope_theta`: the plain-RoPE base `mula.hf.config` read (it refuses RoPE scaling, attention biases
    and activations other than silu before calling this).
    """
    if d.get("use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported by Mula (full causal attention only).")
    # transformers 5 writes num_local_experts (its attribute map), the published configs num_experts
    experts = int(d.get("num_experts", d.get("num_local_experts", 128)))
    if experts <= 0:
        raise ValueError("A Qwen3-MoE config with num_experts=0 has no experts; Mula imports it only as MoE.")
    hidden = d.get("hidden_size", 2048)
    heads = d.get("num_attention_heads", 32)
    layers = d.get("num_hidden_layers", 24)
    kv = d.get("num_key_value_heads") or heads
    head_dim = d.get("head_dim") or hidden // heads
    return MulaConfig(
        name=name,
        vocab_size=d.get("vocab_size", 151936),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=None if kv == heads else kv,
        head_dim=None if head_dim * heads == hidden else head_dim,
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        rope_theta=rope_theta,
        norm="rmsnorm",
        norm_eps=d.get("rms_norm_eps", 1e-6),
        qk_norm=True,
        qk_norm_per_head=True,
        intermediate_size=d.get("intermediate_size", 6144),
        num_experts=experts,
        top_k=d.get("num_experts_per_tok", 8),
        expert_intermediate_size=d.get("moe_intermediate_size", 768),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        num_dense_layers=_dense_prefix(d, layers),
        router_aux_loss_coef=d.get("router_aux_loss_coef", 0.001),
        router_z_loss_coef=0.0,
        init_std=d.get("initializer_range", 0.02),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
    )


def check_expressible(config: MulaConfig) -> None:
    """Refuse a config that transformers' Qwen3-MoE cannot hold (one sentence)."""
    if config.norm != "rmsnorm" or not config.qk_norm_per_head:
        raise ValueError("Only MoE configs with norm='rmsnorm' and qk_norm_per_head=True map to Qwen3-MoE.")
    if config.num_dense_layers and config.intermediate_size <= 0:
        raise ValueError("Dense first blocks need a positive intermediate_size for Qwen3-MoE's dense MLP.")


def config_to_hf(config: MulaConfig) -> dict[str, Any]:
    """Qwen3-MoE's own config.json fields for `config` (`mula.hf.config.config_to_hf` adds the architecture
    and the fields every family writes alike; the routing and bias were checked there), every one explicit."""
    check_expressible(config)
    return {
        "intermediate_size": config.intermediate_size,
        "moe_intermediate_size": config.expert_intermediate_size,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_size,
        "rms_norm_eps": config.norm_eps,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.num_layers,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(config.num_dense_layers)),
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.top_k,
        "norm_topk_prob": config.norm_topk_prob,
        "router_aux_loss_coef": config.router_aux_loss_coef,
        "output_router_logits": False,
    }
