"""Hugging Face interop: Mula <-> transformers' OLMoE (MoE), OLMo (dense), Qwen3-MoE and DeepSeek-V3.

The conversion in memory and on disk is here; config.json <-> `MulaConfig` is `mula.hf.config` (with
Qwen3-MoE's and DeepSeek-V3's own fields in `mula.hf.qwen3_moe` and `mula.hf.deepseek_v3`), and the weight
names and expert layouts are `mula.hf.weights`; their public names are importable from here too.

- `from_hf(model)` / `to_hf(model)`: in-memory conversion (needs `transformers`, imported lazily).
- `import_hf(hf_dir, output)` / `export_hf(ckpt, output)`: files on disk, used by `mula import-hf` /
  `mula export-hf`. They read and write config.json + safetensors directly and do not need
  `transformers` at all. The export carries the run's tokenizer (`mula.hf.tokenizer`).

On disk the experts use the per-expert layout `model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight`
(and the 4.x-style `rope_theta` in config.json): transformers 4.x loads it natively and 5.x fuses it
into `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]` on load (its "qwen2_moe" conversion
mapping), as do vLLM and the original OLMoE checkpoints. Both layouts are accepted when reading.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mula.checkpoint import (
    atomic_write,
    model_from_state_dict,
    read_checkpoint,
    save_weights,
    verify_for_reading,
)
from mula.hf import tokenizer as hf_tokenizer
from mula.hf.config import SUPPORTED, config_from_hf, config_to_hf, unsupported_architecture
from mula.hf.config import check_softmax_routing as check_softmax_routing  # re-exported, as below
from mula.hf.config import shared_config_fields as shared_config_fields
from mula.hf.deepseek_v3 import held_mtp_depth, is_mtp_key
from mula.hf.weights import ROUTER_BIAS as ROUTER_BIAS
from mula.hf.weights import check_router_bias, iter_hf_tensors, state_dict_from_hf
from mula.model.transformer import Mula

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_SHARD_BYTES = 5 * 1024**3


# ----- in memory -------------------------------------------------------------------------------
def from_hf(hf_model: Any) -> Mula:
    """A `Mula` with the weights of a transformers `OlmoeForCausalLM`, `OlmoForCausalLM` or
    `Qwen3MoeForCausalLM`."""
    cls_name = type(hf_model).__name__
    if cls_name not in SUPPORTED.values():
        raise unsupported_architecture(cls_name)
    d = hf_model.config.to_dict()
    name = Path(str(d.get("_name_or_path") or "custom")).name or "custom"
    # clone: the Mula model must not share storage with the transformers model
    hf_state = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    config = held_mtp_depth(config_from_hf(d, name=name), list(hf_state))  # transformers holds no MTP
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
    # transformers' model has no MTP modules (DeepSeek-V3's `model.layers.61`): they stay behind
    hf_state = {k: v for k, v in hf_state.items() if not is_mtp_key(config, k)}
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
    hf_state = _read_hf_state(hf_dir)
    config = held_mtp_depth(config, list(hf_state))
    state = state_dict_from_hf(config, hf_state)
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
