"""A `mula` process imports torchmetrics without the optional packages it never uses.

Lightning imports torchmetrics, and torchmetrics, at import time, imports every optional package it finds
installed for metrics Mula never computes: `scipy.signal` (audio), `matplotlib.pyplot` (`Metric.plot`) and
transformers' `AutoModel` (BERTScore, CLIPScore). That is about 1.8 s of CPU at the start of every `mula`
process and of every rank it launches. Mula's metrics are `MeanMetric` and its own `Metric`s, which need none
of them, so while torchmetrics itself is imported these three read as not installed to it (its availability
checks are lightning_utilities' `package_available` and `RequirementCache`). Only torchmetrics' own answers
change: a package imported later by anyone imports as usual, and lightning_utilities' checks answer truly
again afterwards (Lightning's own, e.g. matplotlib for its learning-rate finder plot).

Only the `mula` command (`mula.commands.entry.main`, also when called in-process) and the test apps ask for
this (`skip_torchmetrics_optional_imports()`, before the first import of Lightning): a process that imports
`mula` as a library keeps torchmetrics whole. Torch-free and cheap to call; nothing is imported until
torchmetrics is.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator

# what torchmetrics imports at import time only for metrics Mula does not use
HIDDEN = frozenset({"scipy", "matplotlib", "transformers"})


def _top_name(requirement: str) -> str:
    from packaging.requirements import Requirement

    return Requirement(requirement).name


@contextlib.contextmanager
def _hidden_from_availability_checks() -> Iterator[None]:
    """While inside, lightning_utilities says the HIDDEN packages are not installed."""
    from lightning_utilities.core import imports

    package_available = imports.package_available
    check_requirement = imports.RequirementCache._check_requirement

    # (torchmetrics keeps this one under its own name: it asks only while it is imported)
    def available(name: str) -> bool:
        return name.split(".")[0] not in HIDDEN and package_available(name)

    def check(self: imports.RequirementCache) -> None:
        if self.requirement and _top_name(self.requirement) in HIDDEN:
            self.available = False
            self.message = f"{self.requirement!r} is not imported by torchmetrics in a `mula` process"
            return
        check_requirement(self)

    imports.package_available = available
    imports.RequirementCache._check_requirement = check
    try:
        yield
    finally:
        imports.package_available = package_available
        imports.RequirementCache._check_requirement = check_requirement


class _HidingLoader(importlib.abc.Loader):
    """torchmetrics' own loader, run inside `_hidden_from_availability_checks`."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        # the module keeps torchmetrics' own loader (resources, reloads)
        module.__loader__ = module.__spec__.loader = self.loader
        with _hidden_from_availability_checks():
            self.loader.exec_module(module)


class _TorchmetricsFinder(importlib.abc.MetaPathFinder):
    """Finds torchmetrics as the other finders do, once, and wraps its loader."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname != "torchmetrics":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _HidingLoader(spec.loader)
        return spec


def skip_torchmetrics_optional_imports() -> None:
    """Make this process's first import of torchmetrics skip scipy, matplotlib and transformers (see the
    module docstring). No effect once torchmetrics is imported; calling it twice is harmless."""
    if "torchmetrics" in sys.modules or any(isinstance(f, _TorchmetricsFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchmetricsFinder())
