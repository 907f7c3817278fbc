"""Hugging Face conversion of the DeepSeek-V3 family: transformers' `DeepseekV3ForCausalLM` <-> Mula.

`mula.hf.config` and `mula.hf.weights` dispatch here on `model_type == "deepseek_v3"` (import) and on `MulaConfig.is_mla` (export);
everything else (files, shards, the per-expert on-disk layout, the tokenizer) is `mula.hf`'s. The state
dict names are the OLMoE ones (`mula.hf.weights._RENAMES`) plus, here, the router's correction bias:
Mula's balancing bias buffer `mlp.router.bias` is transformers' `mlp.gate.e_score_correction_bias`
(both are added to the sigmoid scores for the top-k choice only). Attention, shared experts and the
dense first blocks' MLP carry transformers' own names in Mula already.

What Mula does not compute is refused on import in one sentence: YaRN or any other RoPE scaling (and
its softmax `mscale`), attention biases and an activation other than SiLU (`mula.hf.config`'s checks for every
family); here `rope_interleave=False`, fewer key/value heads than heads, no shared expert, no MoE block
at all, or a `topk_method` other than DeepSeek-V3's `noaux_tc`. Multi-token prediction modules
(`num_nextn_predict_layers`, the published checkpoints' `model.layers.61.*`) are not part of Mula's
model: their weights are skipped on import and an export declares none.
"""

from __future__ import annotations

from typing import Any

from mula.model.config import MulaConfig

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
ROUTER_BIAS_HF = ".mlp.gate.e_score_correction_bias"


def is_family(config: MulaConfig) -> bool:
    """True for a config that exports as DeepSeek-V3 (it uses multi-head latent attention)."""
    return config.is_mla


def config_from_hf(d: dict[str, Any], name: str, rope_theta: float) -> MulaConfig:
    """MulaConfig from a transformers DeepSeek-V3 config dict (`mula.hf.config` has refused what no
    family supports, e.g. RoPE scaling, and read `rope_theta`); missing keys take `DeepseekV3Config`'s
    defaults."""
    heads = d.get("num_attention_heads", 128)
    layers = d.get("num_hidden_layers", 61)
    dense = d.get("first_k_dense_replace", 3)
    refusals = (
        (
            d.get("rope_interleave", True) is False,
            "rope_interleave=False (Mula uses DeepSeek's interleaved layout)",
        ),
        (d.get("num_key_value_heads") not in (None, heads), "num_key_value_heads != num_attention_heads"),
        (d.get("n_shared_experts", 1) in (0, None), "n_shared_experts=0"),
        (dense >= layers, f"first_k_dense_replace={dense} >= num_hidden_layers={layers} (no MoE block)"),
        (d.get("topk_method", "noaux_tc") != "noaux_tc", f"topk_method={d.get('topk_method')!r}"),
    )
    for refused, what in refusals:
        if refused:
            raise ValueError(f"{what} is not supported by Mula's DeepSeek-V3 conversion.")
    routing = {
        "router_scoring": "sigmoid",
        "n_group": d.get("n_group", 8),
        "topk_group": d.get("topk_group", 4),
        "routed_scaling_factor": float(d.get("routed_scaling_factor", 2.5)),
        "router_bias": True,  # the checkpoint's e_score_correction_bias, kept (frozen unless balancing is on)
    }
    return MulaConfig(
        name=name,
        vocab_size=d.get("vocab_size", 129280),
        hidden_size=d.get("hidden_size", 7168),
        num_layers=layers,
        num_heads=heads,
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        rope_theta=rope_theta,
        norm="rmsnorm",
        norm_eps=d.get("rms_norm_eps", 1e-6),
        qk_norm=False,
        intermediate_size=d.get("intermediate_size", 18432),
        num_experts=d.get("n_routed_experts", d.get("num_local_experts", 256)),
        top_k=d.get("num_experts_per_tok", 8),
        expert_intermediate_size=d.get("moe_intermediate_size", 2048),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        num_dense_layers=dense,
        num_shared_experts=d.get("n_shared_experts", 1),
        q_lora_rank=d.get("q_lora_rank", 1536),
        kv_lora_rank=d.get("kv_lora_rank", 512),
        qk_nope_head_dim=d.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=d.get("qk_rope_head_dim", 64),
        v_head_dim=d.get("v_head_dim", 128),
        init_std=d.get("initializer_range", 0.02),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        **routing,
    )


def check_expressible(config: MulaConfig) -> None:
    """Refuse a Mula config transformers' DeepSeek-V3 cannot hold (one sentence)."""
    problems = []
    if not config.is_moe or not config.num_shared_experts:
        problems.append("an MoE model with shared experts")
    if config.shared_intermediate_size != config.num_shared_experts * config.expert_intermediate_size:
        problems.append("shared experts as wide as the routed ones (shared_expert_intermediate_size None)")
    if config.router_scoring != "sigmoid":
        problems.append("router_scoring='sigmoid'")
    if problems:
        raise ValueError(f"transformers' DeepSeek-V3 needs {' and '.join(problems)}; this config has not.")


def config_to_hf(config: MulaConfig) -> dict[str, Any]:
    """DeepSeek-V3's own config.json fields for `config` (`mula.hf.config.config_to_hf` adds the
    architecture and the fields every family writes alike), every one explicit."""
    check_expressible(config)
    return {
        "intermediate_size": config.intermediate_size,
        "moe_intermediate_size": config.expert_intermediate_size,
        "num_key_value_heads": config.num_heads,
        "n_shared_experts": config.num_shared_experts,
        "n_routed_experts": config.num_experts,
        "num_experts_per_tok": config.top_k,
        "routed_scaling_factor": config.routed_scaling_factor,
        "n_group": config.n_group,
        "topk_group": config.topk_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": config.norm_topk_prob,
        "first_k_dense_replace": config.num_dense_layers,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "rope_interleave": True,
        "num_nextn_predict_layers": 0,
        "rms_norm_eps": config.norm_eps,
    }


def is_mtp_key(config: MulaConfig, key: str) -> bool:
    """True for a weight of a multi-token prediction module (`model.layers.{n}.` with n >= num_layers)."""
    if not key.startswith("model.layers."):
        return False
    return int(key.split(".")[2]) >= config.num_layers
