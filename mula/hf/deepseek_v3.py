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
at all, or a `topk_method` other than DeepSeek-V3's `noaux_tc`.

Multi-token prediction modules (`num_nextn_predict_layers`, the published checkpoints' `model.layers.61.*`)
are Mula's `mtp_depth` (`mula.model.mtp`): module k's block is layer `num_hidden_layers + k` under the
same names as every block, its own weights `enorm`, `hnorm`, `eh_proj` and `shared_head.norm` are Mula's
`mtp.{k}.*` (`MTP_NAMES`). The checkpoints also hold each module's copy of the embedding and the output
head (`embed_tokens`, `shared_head.head`): Mula shares the model's, so an import checks that the copies
are the model's and drops them, and an export writes them. A config that declares modules whose weights
the checkpoint lacks (transformers' default of 1, a `save_pretrained` of its model, which holds none)
imports without them. transformers' own model ignores these layers (it never loads layer 61), so
`mula.hf.to_hf` leaves them out.
"""

from __future__ import annotations

import dataclasses
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
        mtp_depth=d.get("num_nextn_predict_layers", 0),  # dropped again when the weights lack them
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
        "num_nextn_predict_layers": config.mtp_depth,
        "rms_norm_eps": config.norm_eps,
    }


MTP_NAMES = (  # Mula's name under `mtp.{k}.` -> the checkpoint's under `model.layers.{num_layers + k}.`
    ("enorm.weight", "enorm.weight"),
    ("hnorm.weight", "hnorm.weight"),
    ("eh_proj.weight", "eh_proj.weight"),
    ("norm.weight", "shared_head.norm.weight"),
)
# each module's copy of what it shares with the model: (checkpoint name, Mula's parameter)
MTP_SHARED = (("embed_tokens.weight", "embed.weight"), ("shared_head.head.weight", "lm_head.weight"))


def _layer(key: str) -> int | None:
    """The layer index of a `model.layers.{i}.` checkpoint key, else None."""
    return int(key.split(".")[2]) if key.startswith("model.layers.") else None


def is_mtp_key(config: MulaConfig, key: str) -> bool:
    """True for a checkpoint weight of an MTP module (`model.layers.{i}.`, i >= num_layers)."""
    layer = _layer(key)
    return layer is not None and layer >= config.num_layers


def is_unheld_mtp_key(config: MulaConfig, key: str) -> bool:
    """True for a checkpoint weight of an MTP module beyond `config`'s (i >= `num_blocks`: every module's
    when `mtp_depth` is 0), which an import skips."""
    layer = _layer(key)
    return layer is not None and layer >= config.num_blocks


def mtp_key_from_hf(config: MulaConfig, key: str) -> tuple[str, str] | None:
    """For a checkpoint key of an MTP module's own weights or shared copies: ("own", Mula's name) or
    ("shared", the model's parameter it copies); None for any other key (the module's block included)."""
    layer = _layer(key)
    if layer is None or not config.num_layers <= layer < config.num_blocks:
        return None
    rest = key.split(".", 3)[3]
    k = layer - config.num_layers
    for ours, theirs in MTP_NAMES:
        if rest == theirs:
            return "own", f"mtp.{k}.{ours}"
    for theirs, ours in MTP_SHARED:
        if rest == theirs:
            return "shared", ours
    return None


def mtp_key_to_hf(config: MulaConfig, key: str) -> str:
    """The checkpoint name of Mula's `mtp.{k}.*` weight `key`."""
    _, k, rest = key.split(".", 2)
    return f"model.layers.{config.num_layers + int(k)}.{dict(MTP_NAMES)[rest]}"


def mtp_shared_copies(config: MulaConfig) -> list[tuple[str, str]]:
    """(checkpoint name, Mula's parameter) of every module's copy of the embedding and the output head
    (a tied head is the embedding)."""
    tied = {"lm_head.weight": "embed.weight"} if config.tie_embeddings else {}
    return [
        (f"model.layers.{config.num_layers + k}.{theirs}", tied.get(ours, ours))
        for k in range(config.mtp_depth)
        for theirs, ours in MTP_SHARED
    ]


def held_mtp_depth(config: MulaConfig, keys: list[str]) -> MulaConfig:
    """`config` without MTP modules when the checkpoint's `keys` hold none of theirs (transformers' model,
    a `save_pretrained` of it, a config declaring modules whose weights were not published)."""
    if config.mtp_depth and not any(_layer(key) == config.num_layers for key in keys):
        return dataclasses.replace(config, mtp_depth=0)
    return config
