"""Mula state dict <-> transformers weight names and layouts (OLMoE, OLMo, Qwen3-MoE, DeepSeek-V3).

Mula's names map piece by piece onto transformers' (`_RENAMES`). Experts are stacked in Mula
(`gate_up [E, 2I, H]`, `down [E, H, I]`); on disk they are per expert
(`model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight`, transformers 4.x), in memory either that or
transformers 5.x's fused `gate_up_proj` / `down_proj`; both are accepted when reading. Mula's router
balancing bias is DeepSeek-V3's `e_score_correction_bias`; the other families have none.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from mula.hf import deepseek_v3 as hf_deepseek_v3
from mula.hf import qwen3_moe as hf_qwen3_moe
from mula.model.config import MulaConfig

_RENAMES = (  # Mula name piece -> transformers name piece, inside model.layers.{i}
    (".attn_norm.", ".input_layernorm."),
    (".mlp_norm.", ".post_attention_layernorm."),
    (".attn.", ".self_attn."),
    (".mlp.router.", ".mlp.gate."),
)


ROUTER_BIAS = ".mlp.router.bias"  # Mula's balancing bias buffer (router_bias_update_rate > 0)


def _to_hf_key(key: str) -> str:
    if key == "embed.weight":
        return "model.embed_tokens.weight"
    if key == "lm_head.weight":
        return key
    key = "model." + key
    for ours, theirs in _RENAMES:
        key = key.replace(ours, theirs)
    return key


def _from_hf_key(key: str) -> str:
    if key == "model.embed_tokens.weight":
        return "embed.weight"
    if key == "lm_head.weight":
        return key
    key = key.removeprefix("model.")
    for ours, theirs in _RENAMES:
        key = key.replace(theirs, ours)
    return key


def iter_hf_tensors(
    config: MulaConfig, state_dict: dict[str, Tensor], fused_experts: bool = False
) -> Iterator[tuple[str, Tensor]]:
    """Yield (transformers name, tensor) for a Mula state dict, one tensor at a time.

    Experts come out per expert (4.x / on-disk layout) or fused like transformers 5.x modules.
    A tied LM head is left out (transformers re-ties it). DeepSeek-V3's MTP modules come out under the
    checkpoints' names, each with its copy of the embedding and the head (`mula.hf.deepseek_v3`).
    """
    deepseek = hf_deepseek_v3.is_family(config)
    for key, value in state_dict.items():
        if key == "lm_head.weight" and config.tie_embeddings:
            continue
        if key.startswith("mtp."):
            yield hf_deepseek_v3.mtp_key_to_hf(config, key), value
            continue
        if deepseek and key.endswith(".mlp.router.weight") and not config.has_router_bias:
            # DeepSeek-V3 always has the correction bias; without Mula's, it is zero
            yield _to_hf_key(key).replace(".weight", ".e_score_correction_bias"), torch.zeros(value.shape[0])
        if key.endswith(ROUTER_BIAS):
            if deepseek:
                yield _to_hf_key(key).replace(".bias", ".e_score_correction_bias"), value
            continue  # else all zero (`check_router_bias`): OLMoE's routing without it is the same
        if ".mlp.experts." not in key:
            yield _to_hf_key(key), value
            continue
        prefix, kind = _to_hf_key(key).rsplit(".", 1)  # model.layers.{i}.mlp.experts, gate_up|down
        if fused_experts:
            yield f"{prefix}.{kind}_proj", value
            continue
        for j in range(value.shape[0]):
            if kind == "gate_up":
                gate, up = value[j].chunk(2, dim=0)
                yield f"{prefix}.{j}.gate_proj.weight", gate
                yield f"{prefix}.{j}.up_proj.weight", up
            else:
                yield f"{prefix}.{j}.down_proj.weight", value[j]
    for name, ours in hf_deepseek_v3.mtp_shared_copies(config):
        yield name, state_dict[ours]


def state_dict_from_hf(config: MulaConfig, hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Mula state dict from transformers OLMoE/OLMo/Qwen3-MoE weights, per-expert (4.x, files) or fused (5.x)."""
    out: dict[str, Tensor] = {}
    per_expert: dict[str, Tensor] = {}
    shared: dict[str, tuple[str, Tensor]] = {}  # the MTP modules' copies of the embedding and head
    for key, value in hf_state.items():
        if ".rotary_emb." in key or hf_deepseek_v3.is_unheld_mtp_key(config, key):
            continue  # non-persistent buffers some versions saved (Mula recomputes RoPE); MTP modules beyond mtp_depth
        mtp = hf_deepseek_v3.mtp_key_from_hf(config, key)
        if mtp is not None:
            if mtp[0] == "own":
                out[mtp[1]] = value
            else:
                shared[key] = (mtp[1], value)
            continue
        if key.endswith(hf_deepseek_v3.ROUTER_BIAS_HF):
            out[_from_hf_key(key).replace(".e_score_correction_bias", ".bias")] = value
            continue
        if ".mlp.experts." in key and key.endswith(".weight"):
            per_expert[key] = value
        elif key.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            name = _from_hf_key(key).removesuffix("_proj")
            out[name] = value
        elif key == "lm_head.weight" and config.tie_embeddings:
            continue
        else:
            out[_from_hf_key(key)] = value
    for i in range(config.num_blocks if config.is_moe and per_expert else 0):
        if not config.is_moe_layer(i):
            continue  # a dense first block
        p = f"model.layers.{i}.mlp.experts"
        try:
            out[f"layers.{i}.mlp.experts.gate_up"] = torch.stack(
                [
                    torch.cat(
                        [
                            per_expert.pop(f"{p}.{j}.gate_proj.weight"),
                            per_expert.pop(f"{p}.{j}.up_proj.weight"),
                        ]
                    )
                    for j in range(config.num_experts)
                ]
            )
            out[f"layers.{i}.mlp.experts.down"] = torch.stack(
                [per_expert.pop(f"{p}.{j}.down_proj.weight") for j in range(config.num_experts)]
            )
        except KeyError as e:
            raise ValueError(f"Hugging Face weights are missing {e.args[0]}.") from None
    if per_expert:
        raise ValueError(f"Unexpected Hugging Face expert weights, e.g. {next(iter(per_expert))}.")
    for key, (ours, copy) in shared.items():
        main = out.get(ours, out.get("embed.weight"))  # a tied head is the embedding
        if main is None or not torch.equal(copy, main):
            raise ValueError(
                f"{key} is not the model's {ours}: Mula's multi-token prediction modules share the "
                "embedding and the output head with the model, as DeepSeek-V3 trains them."
            )
    return out


def check_router_bias(state_dict: dict[str, Tensor], config: MulaConfig | None = None) -> None:
    """Refuse weights whose routers carry a non-zero balancing bias: transformers' OLMoE and Qwen3-MoE
    (the family `config` exports to) have no such term (DeepSeek-V3's `e_score_correction_bias` is one)."""
    if config is not None and hf_deepseek_v3.is_family(config):
        return
    family = "Qwen3-MoE" if config is not None and hf_qwen3_moe.exports(config) else "OLMoE"
    for key, value in state_dict.items():
        if key.endswith(ROUTER_BIAS) and bool(value.detach().ne(0).any()):
            raise ValueError(
                f"{key} is non-zero (router bias balancing, router_bias_update_rate > 0) and transformers' "
                f"{family} cannot express a router bias, so exporting would silently change the routing."
            )
