"""The module paths of Mula 0.1's flat `mula/`, kept importable for one release.

Mula 0.2 groups `mula/` into rooms (docs/architecture.md). A saved `config.yaml` names classes by
their old module path (`mula.csv_logger.CSVLogger`), and user code may import old paths
(`from mula.module import MulaLightningModule`): each old name is an alias of its new module whose
attributes are the new module's own objects, so `isinstance` and class identity hold. Importing an
old path warns once (FutureWarning: a user's config, not only a developer, should see it) with the
new path. Removed in Mula 0.3.

Torch-free: installed by `mula/__init__.py`; the new module is imported only when an old path is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

REMOVED_IN = "0.3"

# old module -> new module; a package's submodules move with it (mula.moe.layer -> mula.model.moe.layer)
MOVED: dict[str, str] = {
    "mula.config": "mula.model.config",
    "mula.config_checks": "mula.model.config_checks",
    "mula.presets": "mula.model.presets",
    "mula.layers": "mula.model.layers",
    "mula.mla": "mula.model.mla",
    "mula.param_names": "mula.model.param_names",
    "mula.activation_checkpointing": "mula.model.activation_checkpointing",
    "mula.compile": "mula.model.compile",
    "mula.moe": "mula.model.moe",
    "mula.kernels": "mula.model.kernels",
    "mula.hf_config": "mula.hf.config",
    "mula.hf_weights": "mula.hf.weights",
    "mula.hf_qwen3_moe": "mula.hf.qwen3_moe",
    "mula.hf_deepseek_v3": "mula.hf.deepseek_v3",
    "mula.hf_tokenizer": "mula.hf.tokenizer",
    "mula.parallel_layout": "mula.layout.parallel_layout",
    "mula.layout_rules": "mula.layout.rules",
    "mula.sharding_options": "mula.layout.sharding_options",
    "mula.flat_buffers": "mula.layout.flat_buffers",
    "mula.module": "mula.training.module",
    "mula.csv_logger": "mula.training.csv_logger",
    "mula.progress_bar": "mula.training.progress_bar",
    "mula.host_allocator": "mula.training.host_allocator",
    "mula.lightning_compat": "mula.training.lightning_compat",
    "mula.memory_meter": "mula.training.memory_meter",
    "mula.entry": "mula.commands.entry",
    "mula.tools": "mula.commands.tools",
    "mula.report": "mula.commands.report",
    "mula.lightning_cli": "mula.commands.lightning_cli",
    "mula.constructor_refusals": "mula.commands.constructor_refusals",
}


def new_path(old: str) -> str | None:
    """The module an old path now names, or None when `old` did not move."""
    for prefix, new in MOVED.items():
        if old == prefix or old.startswith(prefix + "."):
            return new + old[len(prefix) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Makes the old module a view of the new one: every attribute read is the new module's."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module object, filled in below

    def exec_module(self, module: types.ModuleType) -> None:
        target = importlib.import_module(self.new)
        warnings.warn(
            f"`{module.__name__}` is now `{self.new}`; the old path works until Mula {REMOVED_IN} "
            f"(in a saved config.yaml, replace the class_path's module)",
            FutureWarning,
            stacklevel=2,
        )
        module.__doc__ = target.__doc__
        module.__getattr__ = lambda name: getattr(target, name)  # type: ignore[method-assign]
        module.__dir__ = lambda: dir(target)  # type: ignore[method-assign]


class _MovedPathFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths only; every other name goes on to the regular finders."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        new = new_path(fullname)
        if new is None:
            return None
        spec = importlib.util.find_spec(new)
        if spec is None:
            return None
        return importlib.util.spec_from_loader(
            fullname, _AliasLoader(new), is_package=spec.submodule_search_locations is not None
        )


def install() -> None:
    """Put the finder first on `sys.meta_path`, once per process."""
    if not any(isinstance(finder, _MovedPathFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedPathFinder())


install()
