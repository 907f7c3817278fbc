"""Hugging Face interop, one module per concern (docs/models.md).

- `convert.py`: `from_hf` / `to_hf` (in memory) and `import_hf` / `export_hf` (files on disk);
- `config.py`: config.json <-> `MulaConfig` (OLMoE and OLMo), dispatching to the families' own
  mappings in `qwen3_moe.py` and `deepseek_v3.py`;
- `weights.py`: the weight names and expert layouts;
- `tokenizer.py`: the run's tokenizer carried into an export.

`mula.hf` keeps its public functions: `from mula.hf import export_hf` works as before. They load on
first use, so importing `mula.hf.config` alone does not import the conversions.
"""

from __future__ import annotations

from typing import Any

# the public names of `mula.hf` (convert.py's own and those it re-exports)
_CONVERT = (
    "MAX_SHARD_BYTES",
    "ROUTER_BIAS",
    "SUPPORTED",
    "check_router_bias",
    "check_softmax_routing",
    "config_from_hf",
    "config_to_hf",
    "export_hf",
    "from_hf",
    "import_hf",
    "iter_hf_tensors",
    "shared_config_fields",
    "state_dict_from_hf",
    "to_hf",
    "unsupported_architecture",
)
__all__ = list(_CONVERT)


def __getattr__(name: str) -> Any:
    if name in _CONVERT:
        from mula.hf import convert

        return getattr(convert, name)
    raise AttributeError(f"module 'mula.hf' has no attribute {name!r}")
