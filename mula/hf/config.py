"""Hugging Face config.json <-> `MulaConfig` for OLMoE (MoE), OLMo (dense), Qwen3-MoE and DeepSeek-V3.

`config_from_hf` reads a transformers config dict (missing keys take transformers' defaults for the model
type), `config_to_hf` writes one loadable by transformers 4.x and 5.x; each refuses, in one sentence, what
the other side cannot express. Qwen3-MoE's and DeepSeek-V3's own fields are `mula.hf.qwen3_moe`'s and
`mula.hf.deepseek_v3`'s; the dispatch and the fields every family writes alike are here.

Mula's router z-loss weight has no transformers field: export drops it, import uses the default. Nor
has an expert capacity (`capacity_factor`, `drop_policy`): transformers' MoE blocks are dropless, so export
writes the same config.json with or without one (the exported model computes the dropless function) and
import leaves `capacity_factor` None (dropless).
"""

from __future__ import annotations

from typing import Any

import torch

from mula.hf import deepseek_v3 as hf_deepseek_v3
from mula.hf import qwen3_moe as hf_qwen3_moe
from mula.model.config import MulaConfig

SUPPORTED = {
    "olmoe": "OlmoeForCausalLM",
    "olmo": "OlmoForCausalLM",
    hf_deepseek_v3.MODEL_TYPE: hf_deepseek_v3.ARCHITECTURE,
    hf_qwen3_moe.MODEL_TYPE: hf_qwen3_moe.ARCHITECTURE,
}


# ----- configs ---------------------------------------------------------------------------------
def unsupported_architecture(what: Any) -> ValueError:
    """The error for a transformers architecture or model type Mula does not convert."""
    return ValueError(
        f"Unsupported Hugging Face architecture {what!r}; Mula converts only {', '.join(SUPPORTED.values())}."
    )


def _rope_theta(d: dict[str, Any]) -> float:
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"RoPE scaling type {rope_type!r} is not supported by Mula (only plain RoPE).")
    return float(params.get("rope_theta", d.get("rope_theta", 10000.0)))


def config_from_hf(d: dict[str, Any], name: str = "custom") -> MulaConfig:
    """MulaConfig from a transformers OLMoE/OLMo/Qwen3-MoE/DeepSeek-V3 config dict (config.json or
    `config.to_dict()`).

    Missing keys take transformers' defaults for that model type, i.e. what transformers would load.
    """
    model_type = d.get("model_type")
    if model_type not in SUPPORTED:
        raise unsupported_architecture((d.get("architectures") or [model_type])[0])
    if d.get("clip_qkv") is not None:
        raise ValueError(
            f"clip_qkv={d['clip_qkv']} is not supported by Mula (OLMo-1B-hf and OLMoE use None)."
        )
    if d.get("attention_bias", False):
        raise ValueError("attention_bias=True is not supported by Mula (no biases anywhere).")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={d['hidden_act']!r} is not supported by Mula (SwiGLU uses silu).")
    if model_type == hf_qwen3_moe.MODEL_TYPE:
        return hf_qwen3_moe.config_from_hf(d, name, _rope_theta(d))
    if model_type == hf_deepseek_v3.MODEL_TYPE:
        return hf_deepseek_v3.config_from_hf(d, name, _rope_theta(d))
    moe = model_type == "olmoe"
    hidden = d.get("hidden_size", 2048 if moe else 4096)
    heads = d.get("num_attention_heads", 16 if moe else 32)
    if d.get("head_dim") not in (None, hidden // heads):
        raise ValueError(f"head_dim={d['head_dim']} != hidden_size/num_attention_heads is not supported.")
    kv = d.get("num_key_value_heads") or heads
    common: dict[str, Any] = {
        "name": name,
        "vocab_size": d.get("vocab_size", 50304),
        "hidden_size": hidden,
        "num_layers": d.get("num_hidden_layers", 16 if moe else 32),
        "num_heads": heads,
        "num_kv_heads": None if kv == heads else kv,
        "max_position_embeddings": d.get("max_position_embeddings", 4096 if moe else 2048),
        "rope_theta": _rope_theta(d),
        "init_std": d.get("initializer_range", 0.02),
        "tie_embeddings": bool(d.get("tie_word_embeddings", False)),
    }
    if moe:
        return MulaConfig(
            **common,
            norm="rmsnorm",
            norm_eps=d.get("rms_norm_eps", 1e-5),
            qk_norm=True,
            num_experts=d.get("num_experts", d.get("num_local_experts", 64)),
            top_k=d.get("num_experts_per_tok", 8),
            expert_intermediate_size=d.get("intermediate_size", 2048),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            router_aux_loss_coef=d.get("router_aux_loss_coef", 0.01),
        )
    return MulaConfig(
        **common,
        norm="layernorm",
        norm_eps=1e-5,  # OlmoLayerNorm hard-codes it
        qk_norm=False,
        num_experts=0,
        intermediate_size=d.get("intermediate_size", 11008),
    )


def check_softmax_routing(config: MulaConfig, family: str) -> None:
    """Refuse an MoE config whose routing `family`'s softmax top-k router cannot express."""
    if not config.is_moe:
        return
    options = {
        "router_scoring": (config.router_scoring, "softmax"),
        "n_group": (config.n_group, 1),
        "routed_scaling_factor": (config.routed_scaling_factor, 1.0),
    }
    for field, (value, plain) in options.items():
        if value != plain:
            raise ValueError(
                f"transformers' {family} routes by a softmax top-k without groups or scaling, so a model with "
                f"{field}={value!r} (Mula's default: {plain!r}) cannot be exported to it."
            )


def _check_expressible(config: MulaConfig) -> None:
    check_softmax_routing(config, "OLMoE")
    if config.num_shared_experts:
        raise ValueError(
            "transformers' OLMoE has no shared experts; a model with num_shared_experts cannot be exported to it."
        )
    if config.num_dense_layers:
        raise ValueError(
            f"transformers' OLMoE has an MoE MLP in every block, so a model whose first "
            f"{config.num_dense_layers} block(s) are dense (num_dense_layers) cannot be exported to it."
        )
    if config.head_size * config.num_heads != config.hidden_size:
        raise ValueError("transformers' OLMo/OLMoE need head_dim == hidden_size / num_heads.")
    if config.is_moe and (config.norm != "rmsnorm" or not config.qk_norm):
        raise ValueError("Only MoE configs with norm='rmsnorm' and qk_norm=True map to transformers' OLMoE.")
    if not config.is_moe and (config.norm != "layernorm" or config.qk_norm or config.norm_eps != 1e-5):
        raise ValueError(
            "Only dense configs with norm='layernorm', norm_eps=1e-5 and qk_norm=False map to transformers' OLMo."
        )


def shared_config_fields(
    config: MulaConfig, dtype: torch.dtype, token_ids: dict[str, int | None] | None
) -> dict[str, Any]:
    """The config.json fields every family writes alike: sizes, SiLU, plain RoPE, no attention bias, the
    exported tokenizer's eos/bos/pad_token_id (None without one), the weights' dtype."""
    ids = token_ids or {}
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.init_std,
        "use_cache": True,
        "pad_token_id": ids.get("pad_token_id"),
        "bos_token_id": ids.get("bos_token_id"),
        "eos_token_id": ids.get("eos_token_id"),
        "tie_word_embeddings": config.tie_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def config_to_hf(
    config: MulaConfig, dtype: torch.dtype = torch.float32, token_ids: dict[str, int | None] | None = None
) -> dict[str, Any]:
    """config.json contents for `config`, loadable by transformers 4.x and 5.x; every field explicit.

    `token_ids`: eos/bos/pad_token_id of the exported tokenizer (`hf_tokenizer.special_token_ids`);
    None without one. (transformers' OlmoeConfig defaults, e.g. intermediate_size 2048, are not OLMoE's.)
    A config with multi-head latent attention is a DeepSeek-V3 (`mula.hf.deepseek_v3.config_to_hf`).
    """
    family = None
    if hf_deepseek_v3.is_family(config):
        family = hf_deepseek_v3
    elif hf_qwen3_moe.exports(config):
        check_softmax_routing(config, "Qwen3-MoE")
        family = hf_qwen3_moe
    if family is not None:  # the family's module says what is its own
        return {
            "architectures": [family.ARCHITECTURE],
            "model_type": family.MODEL_TYPE,
            **shared_config_fields(config, dtype, token_ids),
            **family.config_to_hf(config),
        }
    _check_expressible(config)
    moe = config.is_moe
    d: dict[str, Any] = {
        "architectures": [SUPPORTED["olmoe" if moe else "olmo"]],
        "model_type": "olmoe" if moe else "olmo",
        **shared_config_fields(config, dtype, token_ids),
        "intermediate_size": config.expert_intermediate_size if moe else config.intermediate_size,
        "num_key_value_heads": config.kv_heads,
        "clip_qkv": None,
    }
    if moe:
        d.update(
            rms_norm_eps=config.norm_eps,
            num_experts=config.num_experts,
            num_experts_per_tok=config.top_k,
            norm_topk_prob=config.norm_topk_prob,
            router_aux_loss_coef=config.router_aux_loss_coef,
            output_router_logits=False,
        )
    return d
