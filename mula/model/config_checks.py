"""The rules a `MulaConfig` must satisfy (`check_config`, run by `MulaConfig.__post_init__`) and the names
of its choices (norms, expert backends, routing options), free of torch.

Every rule raises one ValueError sentence naming the field, so a bad recipe fails before any model is
built.
"""

from __future__ import annotations

from typing import Any

# The config is typed `Any` here, not `MulaConfig`: mula/model/config.py imports this module, and a rule module
# that imports the class it checks would make the two one circle.

NORMS = ("rmsnorm", "layernorm")
# Expert-kernel backends a recipe may name (`mula.model.kernels.backends` resolves them); kept here, free of
# torch, so that reading a config never imports the kernels.
BACKENDS = ("auto", "triton", "torch", "loop")
# How the router's load-balancing loss counts expert frequencies, and how it picks experts.
AUX_LOSS_SCOPES = ("micro_batch", "global", "sequence")
ROUTING_MODES = ("learned", "uniform")
# How the router turns logits into scores (`mula.model.moe.router`): OLMoE/Qwen3-MoE's softmax, DeepSeek-V3's sigmoid.
ROUTER_SCORINGS = ("softmax", "sigmoid")
# Which of an over-full expert's choices a capacity keeps (`mula.model.kernels.capacity`).
DROP_POLICIES = ("probs", "position")


def check_backend_name(backend: str) -> None:
    """Raise ValueError unless `backend` is one of BACKENDS."""
    if backend not in BACKENDS:
        raise ValueError(f"Unknown expert backend {backend!r}; choose one of {', '.join(BACKENDS)}.")


def check_config(config: Any) -> None:
    """Raise ValueError, in one sentence, for the first rule `config` breaks (`MulaConfig.__post_init__`)."""
    positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_position_embeddings")
    for field in positive:
        if int(getattr(config, field)) <= 0:
            raise ValueError(f"MulaConfig.{field} must be positive, got {getattr(config, field)}.")
    if config.norm not in NORMS:
        raise ValueError(f"MulaConfig.norm must be one of {NORMS}, got {config.norm!r}.")
    if config.head_dim is None and config.hidden_size % config.num_heads and config.kv_lora_rank is None:
        raise ValueError(
            f"hidden_size {config.hidden_size} is not divisible by num_heads {config.num_heads}; "
            "set head_dim explicitly."
        )
    _check_mla(config)
    if config.rope_dim % 2:
        raise ValueError(f"The RoPE width must be even, got {config.rope_dim}.")
    if config.kv_heads <= 0 or config.num_heads % config.kv_heads:
        raise ValueError(
            f"num_heads {config.num_heads} must be a multiple of num_kv_heads {config.kv_heads}."
        )
    if config.qk_norm_per_head and not config.qk_norm:
        raise ValueError("qk_norm_per_head=True needs qk_norm=True (it says how the QK-norm normalises).")
    if config.num_experts < 0:
        raise ValueError(f"num_experts must be >= 0 (0 = dense), got {config.num_experts}.")
    check_backend_name(config.expert_backend)
    _check_routing(config)
    _check_capacity(config)
    _check_shared_experts(config)
    _check_mtp(config)
    if config.is_moe:
        if not 1 <= config.top_k <= config.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={config.num_experts}], got {config.top_k}.")
        if config.expert_intermediate_size <= 0:
            raise ValueError(
                f"expert_intermediate_size must be positive, got {config.expert_intermediate_size}."
            )
        if not 0 <= config.num_dense_layers < config.num_layers:
            raise ValueError(
                f"num_dense_layers must be in [0, num_layers={config.num_layers}) so that at least one "
                f"block is MoE, got {config.num_dense_layers}."
            )
        if config.num_dense_layers and config.intermediate_size <= 0:
            raise ValueError(
                f"intermediate_size must be positive for the dense blocks (num_dense_layers="
                f"{config.num_dense_layers}), got {config.intermediate_size}."
            )
    elif config.num_dense_layers:
        raise ValueError(
            f"num_dense_layers={config.num_dense_layers} needs an MoE model (num_experts > 0); every "
            "block of a dense model is dense already, so leave it 0."
        )
    elif config.intermediate_size <= 0:
        raise ValueError(
            f"intermediate_size must be positive for a dense model, got {config.intermediate_size}."
        )


def _check_mla(config: Any) -> None:
    if config.kv_lora_rank is None:
        mla_only = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        set_ = [f for f in mla_only if getattr(config, f)]
        if set_:
            raise ValueError(
                f"{', '.join(set_)} only apply to multi-head latent attention; set kv_lora_rank to use it."
            )
        return
    sizes = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    for field in sizes + (("q_lora_rank",) if config.q_lora_rank is not None else ()):
        if int(getattr(config, field)) <= 0:
            raise ValueError(f"MulaConfig.{field} must be positive for MLA, got {getattr(config, field)}.")
    if config.norm != "rmsnorm":
        raise ValueError("Multi-head latent attention (kv_lora_rank) needs norm='rmsnorm', as DeepSeek.")
    if config.qk_norm or config.num_kv_heads not in (None, config.num_heads) or config.head_dim is not None:
        raise ValueError(
            "Multi-head latent attention (kv_lora_rank) sets its own head widths and norms: leave "
            "qk_norm False, num_kv_heads and head_dim None."
        )


def _check_mtp(config: Any) -> None:
    if config.mtp_depth < 0:
        raise ValueError(f"mtp_depth must be >= 0 (0 = no multi-token prediction), got {config.mtp_depth}.")
    if not config.mtp_loss_weight >= 0.0:  # also refuses NaN
        raise ValueError(f"mtp_loss_weight must be >= 0, got {config.mtp_loss_weight}.")


def _check_shared_experts(config: Any) -> None:
    if config.num_shared_experts < 0:
        raise ValueError(f"num_shared_experts must be >= 0, got {config.num_shared_experts}.")
    if config.num_shared_experts and not config.is_moe:
        raise ValueError("num_shared_experts needs an MoE model (num_experts > 0).")
    width = config.shared_expert_intermediate_size
    if width is not None and (width <= 0 or not config.num_shared_experts):
        raise ValueError(
            f"shared_expert_intermediate_size={width} needs num_shared_experts > 0 and a positive width."
        )


def _check_capacity(config: Any) -> None:
    factor = config.capacity_factor
    number = isinstance(factor, (int, float)) and not isinstance(factor, bool)
    if factor is not None and not (number and 0.0 < factor < float("inf")):  # also refuses NaN
        raise ValueError(f"capacity_factor must be None (dropless) or a positive number, got {factor!r}.")
    if config.drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {config.drop_policy!r}.")


def _check_routing(config: Any) -> None:
    if not config.router_bias_update_rate >= 0.0:  # also refuses NaN
        raise ValueError(
            f"router_bias_update_rate must be >= 0 (0 = no bias balancing), got {config.router_bias_update_rate}."
        )
    if config.aux_loss_scope not in AUX_LOSS_SCOPES:
        raise ValueError(f"aux_loss_scope must be one of {AUX_LOSS_SCOPES}, got {config.aux_loss_scope!r}.")
    if config.routing_mode not in ROUTING_MODES:
        raise ValueError(f"routing_mode must be one of {ROUTING_MODES}, got {config.routing_mode!r}.")
    if config.router_scoring not in ROUTER_SCORINGS:
        raise ValueError(f"router_scoring must be one of {ROUTER_SCORINGS}, got {config.router_scoring!r}.")
    if not config.routed_scaling_factor > 0.0:  # also refuses NaN
        raise ValueError(f"routed_scaling_factor must be positive, got {config.routed_scaling_factor}.")
    if config.n_group < 1 or not 1 <= config.topk_group <= config.n_group:
        raise ValueError(
            f"Group-limited routing needs n_group >= 1 and 1 <= topk_group <= n_group, got n_group="
            f"{config.n_group}, topk_group={config.topk_group} (1 and 1: no group limit)."
        )
    if config.n_group > 1 and config.is_moe:
        per_group, kept = divmod(config.num_experts, config.n_group)
        if kept or per_group < 2:
            raise ValueError(
                f"n_group={config.n_group} must divide num_experts={config.num_experts} into groups of at "
                "least 2 experts (a group's score is the sum of its two best)."
            )
        if config.top_k > config.topk_group * per_group:
            raise ValueError(
                f"top_k={config.top_k} exceeds the {config.topk_group * per_group} experts that "
                f"topk_group={config.topk_group} groups of {per_group} hold."
            )
