"""mula.lightning_compat: the private Lightning names resolve, and the tested range is the one required."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import lightning
from packaging.specifiers import SpecifierSet

from mula import lightning_compat

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
# modules whose overriding methods all carry @override (typing_extensions.override)
OVERRIDES_MARKED = ("mula.cli", "mula.progress_bar")


def _sources() -> list[Path]:
    return [p for d in ("mula", "strategies", "callbacks") for p in sorted((ROOT / d).rglob("*.py"))]


def test_private_lightning_names_are_imported_in_lightning_compat_only():
    import ast

    found = []
    for path in _sources():
        if path == ROOT / "mula" / "lightning_compat.py":
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


def test_overridden_hooks_are_marked_override():
    classes = [cls for cls in _lightning_classes() if cls.__module__ in OVERRIDES_MARKED]
    assert {cls.__name__ for cls in classes} >= {"MulaCLI", "PlanCLI", "MulaSaveConfig", "StepProgressBar"}
    unmarked = [
        f"{cls.__name__}.{name}"
        for cls in classes
        for name, _ in _overridden(cls)
        if name != "__init__"
        and not getattr(getattr(vars(cls)[name], "__func__", vars(cls)[name]), "__override__", False)
    ]
    assert not unmarked, unmarked
