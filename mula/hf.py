"""Hugging Face interop: Mula <-> transformers' OLMoE (MoE), OLMo (dense), Qwen3-MoE and DeepSeek-V3.

Qwen3-MoE shares OLMoE's weight names; its config mapping is `mula.hf_qwen3_moe`. DeepSeek-V3's config
mapping (and its router bias name) is `mula.hf_deepseek_v3`; the dispatch is here.

- `from_hf(model)` / `to_hf(model)`: in-memory conversion (needs `transformers`, imported lazily).
- `import_hf(hf_dir, output)` / `export_hf(ckpt, output)`: files on disk, used by `mula import-hf` /
  `mula export-hf`. They read and write config.json + safetensors directly and do not need
  `transformers` at all. The export carries the run's tokenizer (`mula.hf_tokenizer`).

On disk the experts use the per-expert layout `model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight`
(and the 4.x-style `rope_theta` in config.json): transformers 4.x loads it natively and 5.x fuses it
into `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]` on load (its "qwen2_moe" conversion
mapping), as do vLLM and the original OLMoE checkpoints. Both layouts are accepted when reading.

Mula's router z-loss weight has no transformers field: export drops it, import uses the default.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mula import hf_deepseek_v3, hf_qwen3_moe, hf_tokenizer
from mula.checkpoint import (
    atomic_write,
    model_from_state_dict,
    read_checkpoint,
    save_weights,
    verify_for_reading,
)
from mula.config import MulaConfig
from mula.model import Mula

SUPPORTED = {
    "olmoe": "OlmoeForCausalLM",
    "olmo": "OlmoForCausalLM",
    hf_deepseek_v3.MODEL_TYPE: hf_deepseek_v3.ARCHITECTURE,
    hf_qwen3_moe.MODEL_TYPE: hf_qwen3_moe.ARCHITECTURE,
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_SHARD_BYTES = 5 * 1024**3


# ----- configs ---------------------------------------------------------------------------------
def _unsupported(what: Any) -> ValueError:
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
        raise _unsupported((d.get("architectures") or [model_type])[0])
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
    A config with multi-head latent attention is a DeepSeek-V3 (`mula.hf_deepseek_v3.config_to_hf`).
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


# ----- state dicts -----------------------------------------------------------------------------
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
    A tied LM head is left out (transformers re-ties it).
    """
    deepseek = hf_deepseek_v3.is_family(config)
    for key, value in state_dict.items():
        if key == "lm_head.weight" and config.tie_embeddings:
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


def state_dict_from_hf(config: MulaConfig, hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Mula state dict from transformers OLMoE/OLMo/Qwen3-MoE weights, per-expert (4.x, files) or fused (5.x)."""
    out: dict[str, Tensor] = {}
    per_expert: dict[str, Tensor] = {}
    for key, value in hf_state.items():
        if ".rotary_emb." in key or hf_deepseek_v3.is_mtp_key(config, key):
            continue  # non-persistent buffers some versions saved (Mula recomputes RoPE); MTP modules
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
    for i in range(config.num_layers if config.is_moe and per_expert else 0):
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
    return out


# ----- in memory -------------------------------------------------------------------------------
def from_hf(hf_model: Any) -> Mula:
    """A `Mula` with the weights of a transformers `OlmoeForCausalLM`, `OlmoForCausalLM` or
    `Qwen3MoeForCausalLM`."""
    cls_name = type(hf_model).__name__
    if cls_name not in SUPPORTED.values():
        raise _unsupported(cls_name)
    d = hf_model.config.to_dict()
    name = Path(str(d.get("_name_or_path") or "custom")).name or "custom"
    config = config_from_hf(d, name=name)
    # clone: the Mula model must not share storage with the transformers model
    hf_state = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    return model_from_state_dict(config, state_dict_from_hf(config, hf_state), source=f"{cls_name} weights")


def to_hf(model: Mula) -> Any:
    """A transformers `OlmoeForCausalLM` (MoE), `OlmoForCausalLM` (dense) or `Qwen3MoeForCausalLM` (MoE
    with per-head QK-norm) with `model`'s weights."""
    import transformers  # optional dependency: only needed here

    config = model.config
    check_router_bias(model.state_dict(), config)
    dtype = next(model.parameters()).dtype
    d = config_to_hf(config, dtype)
    arch = d["architectures"][0]
    hf_config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    hf_config = hf_config_cls.from_dict({k: v for k, v in d.items() if k != "torch_dtype"})
    hf_model = getattr(transformers, arch)(hf_config).to(dtype)
    fused = any(k.endswith(".mlp.experts.gate_up_proj") for k in hf_model.state_dict())  # 5.x modules
    hf_state = dict(iter_hf_tensors(config, model.state_dict(), fused_experts=fused))
    if config.tie_embeddings:
        hf_state["lm_head.weight"] = hf_state["model.embed_tokens.weight"]
    hf_model.load_state_dict(hf_state, strict=True)
    return hf_model.eval()


# ----- on disk ---------------------------------------------------------------------------------
def _check_new_output(output: Path) -> None:
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ValueError(
            f"Output {output} already exists; choose a new path (Mula never overwrites checkpoints)."
        )


def _read_hf_state(hf_dir: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    for index_name, loader in (
        ("model.safetensors.index.json", load_file),
        ("pytorch_model.bin.index.json", lambda p: torch.load(p, map_location="cpu", weights_only=True)),
    ):
        index = hf_dir / index_name
        if index.exists():
            state: dict[str, Tensor] = {}
            for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
                state.update(loader(hf_dir / shard))
            return state
    if (hf_dir / "model.safetensors").exists():
        return load_file(hf_dir / "model.safetensors")
    if (hf_dir / "pytorch_model.bin").exists():
        return torch.load(hf_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"No model.safetensors or pytorch_model.bin (or their index) in {hf_dir}.")


def import_hf(hf_dir: str | os.PathLike, output: str | os.PathLike) -> Mula:
    """Convert a transformers OLMoE/OLMo/Qwen3-MoE directory (config.json + weights) into a Mula weights file."""
    hf_dir, output = Path(hf_dir), Path(output)
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"Hugging Face model directory {hf_dir} does not exist.")
    if not (hf_dir / "config.json").exists():
        raise FileNotFoundError(f"{hf_dir} has no config.json; it is not a Hugging Face model directory.")
    _check_new_output(output)
    config = config_from_hf(json.loads((hf_dir / "config.json").read_text()), name=hf_dir.resolve().name)
    state = state_dict_from_hf(config, _read_hf_state(hf_dir))
    model = model_from_state_dict(config, state, source=f"weights in {hf_dir}")
    save_weights(model, output)
    return model


def export_hf(
    ckpt: str | os.PathLike,
    output: str | os.PathLike,
    dtype: str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    tokenizer: str | os.PathLike | None = None,
    verify: bool = True,
) -> str | None:
    """Write a Mula checkpoint (weights file or Lightning .ckpt) as a transformers directory.

    `dtype`: "float32", "bfloat16" or "float16" (default: as stored). Writes config.json and
    safetensors shards of at most `max_shard_bytes` (with an index when there are several) into a
    temporary sibling directory that is renamed to `output` only when complete. With the tokenizer
    (`tokenizer`, a tokenizer.json or a directory holding one; default: the one the checkpoint's run
    recorded) it also writes tokenizer.json, tokenizer_config.json and generation_config.json.
    The checkpoint is verified against its manifest first (`verify_for_reading`; `verify=False`
    exports a damaged one anyway, for forensics).

    Returns None when a tokenizer was exported, else the reason why none was (the model is written
    either way). A `tokenizer` that does not exist, is not a tokenizer or has more tokens than the
    model raises before anything is written.
    """
    from safetensors.torch import save_file

    ckpt, output = Path(ckpt), Path(output)
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype!r}.")
    if not ckpt.exists():
        raise FileNotFoundError(f"Checkpoint {ckpt} does not exist.")
    _check_new_output(output)
    verify_for_reading(ckpt, verify)  # before anything else reads it (the tokenizer lookup does)
    tok, no_tokenizer = hf_tokenizer.resolve_tokenizer(ckpt, None if tokenizer is None else str(tokenizer))
    config, state = read_checkpoint(ckpt, verify=False)  # verified above
    check_router_bias(state, config)
    model_from_state_dict(config, state, source=str(ckpt))  # validates names and shapes
    if tok is not None:
        hf_tokenizer.check_fits(tok, config)
    target = _DTYPES[dtype] if dtype else next(iter(state.values())).dtype
    hf_config = config_to_hf(config, target, hf_tokenizer.special_token_ids(tok) if tok else None)

    with atomic_write(output) as tmp:  # an empty directory at `output` (checked above) is replaced
        tmp.mkdir(parents=True)
        shards: list[tuple[Path, list[str]]] = []
        shard: dict[str, Tensor] = {}
        size = total = 0

        def flush() -> None:
            nonlocal shard, size
            path = tmp / f"shard-{len(shards)}.safetensors"
            save_file(shard, path, metadata={"format": "pt"})  # transformers requires the "pt" tag
            shards.append((path, list(shard)))
            shard, size = {}, 0

        for name, tensor in iter_hf_tensors(config, state):
            # an owned contiguous copy: safetensors refuses views that share storage (expert slices)
            tensor = tensor.to(target, copy=True, memory_format=torch.contiguous_format)
            nbytes = tensor.numel() * tensor.element_size()
            if shard and size + nbytes > max_shard_bytes:
                flush()
            shard[name] = tensor
            size += nbytes
            total += nbytes
        flush()

        if len(shards) == 1:
            shards[0][0].rename(tmp / "model.safetensors")
        else:
            weight_map = {}
            for n, (path, names) in enumerate(shards, start=1):
                final = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
                path.rename(tmp / final)
                weight_map.update(dict.fromkeys(names, final))
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if tok is not None:
            hf_tokenizer.write_tokenizer(tok, config, tmp)
    return no_tokenizer or None
