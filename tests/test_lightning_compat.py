"""mula.training.lightning_compat: the private Lightning names resolve, and the tested range is the one required."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import lightning
from packaging.specifiers import SpecifierSet

from mula.training import lightning_compat

ROOT = Path(__file__).resolve().parents[1]


def test_tested_range_is_the_requirement_and_holds_the_installed_lightning():
    (requirement,) = re.findall(
        r'^\s*"lightning([^"]*)",$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE
    )
    assert SpecifierSet(requirement) == SpecifierSet(lightning_compat.TESTED_LIGHTNING)
    assert lightning.__version__ in SpecifierSet(lightning_compat.TESTED_LIGHTNING)


def test_private_names_are_the_lightning_objects():
    for name in lightning_compat.__all__:
        assert getattr(lightning_compat, name) is not None
    env = object()
    trainer = SimpleNamespace(_accelerator_connector=SimpleNamespace(cluster_environment=env))
    assert lightning_compat.cluster_environment(trainer) is env
    real = lightning.pytorch.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert lightning_compat.cluster_environment(real) is not None


# The one private Lightning hook Mula overrides: Lightning gives a custom strategy no public way to
# choose its launcher (DDPStrategy overrides the same method).
PRIVATE_OVERRIDES_ALLOWED = {("XPUMoEStrategy", "_configure_launcher")}


def _sources() -> list[Path]:
    return [p for d in ("mula", "strategies", "callbacks") for p in sorted((ROOT / d).rglob("*.py"))]


def test_private_lightning_names_are_imported_in_lightning_compat_only():
    import ast

    found = []
    for path in _sources():
        if path == ROOT / "mula" / "training" / "lightning_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
                "lightning",
                "pytorch_lightning",
            ):
                found += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert not found, found


def _lightning_classes() -> list[type]:
    """Every class of mula/, strategies/ and callbacks/ with a Lightning base class (modules imported)."""
    import importlib
    import inspect

    out = []
    for path in _sources():
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        if name.startswith("mula.downstream") or name.endswith("__main__"):  # lm-eval extra; a script
            continue
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if (
                inspect.isclass(cls)
                and cls.__module__ == name
                and any(b.__module__.startswith("lightning.") for b in cls.__mro__[1:])
            ):
                out.append(cls)
    return out


def _overridden(cls: type) -> list[tuple[str, type]]:
    """(method name, the Lightning class it overrides) for each method `cls` defines itself."""
    out = []
    for name, value in vars(cls).items():
        if name.startswith("__") or not callable(getattr(value, "__func__", value)):
            continue
        base = next(
            (b for b in cls.__mro__[1:] if b.__module__.startswith("lightning.") and name in vars(b)), None
        )
        if base is not None:
            out.append((name, base))
    return out


def test_no_private_lightning_method_is_overridden_outside_the_allowed_one():
    found = [
        f"{cls.__module__}.{cls.__name__}.{name} (of {base.__name__})"
        for cls in _lightning_classes()
        for name, base in _overridden(cls)
        if name.startswith("_") and (cls.__name__, name) not in PRIVATE_OVERRIDES_ALLOWED
    ]
    assert not found, found


def _own_overrides(cls: type) -> list[tuple[type, str, object]]:
    """(Mula class, method name, function) for every method that a Mula class in `cls`'s MRO (mixins
    such as OptimizerSteps included) defines and a Lightning class in that MRO also defines."""
    lightning_bases = [b for b in cls.__mro__ if b.__module__.startswith("lightning.")]
    out = []
    for own in cls.__mro__:
        if own.__module__.split(".")[0] not in ("mula", "strategies", "callbacks"):
            continue
        for name, value in vars(own).items():
            if name.startswith("__"):
                continue
            func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if callable(func) and any(name in vars(b) for b in lightning_bases):
                out.append((own, name, func))
    return out


def test_overridden_hooks_are_marked_override():
    classes = _lightning_classes()
    assert {cls.__name__ for cls in classes} >= {"MulaCLI", "PlanCLI", "MulaSaveConfig", "StepProgressBar"}
    assert {cls.__name__ for cls in classes} >= {"XPUMoEStrategy", "MulaLightningModule", "AnomalyGuard"}
    unmarked = {
        f"{own.__module__}.{own.__name__}.{name}"
        for cls in classes
        for own, name, func in _own_overrides(cls)
        if not getattr(func, "__override__", False)
    }
    assert not unmarked, sorted(unmarked)
