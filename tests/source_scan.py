"""What the compat tests (tests/test_lightning_compat.py, tests/test_torch_compat.py) read of the code:
the layers' source files, attribute names looked up by a string, and the classes built on a library's."""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Callable
from pathlib import Path

LAYERS = ("mula", "strategies", "callbacks")
STRING_LOOKUPS = ("getattr", "hasattr", "setattr", "delattr")


def layer_sources(root: Path) -> list[Path]:
    """Every module file of mula/, strategies/ and callbacks/ under `root`, in a stable order."""
    return [p for d in LAYERS for p in sorted((root / d).rglob("*.py"))]


def string_lookup(node: ast.AST) -> str | None:
    """The attribute name of `getattr(x, "name", ...)` (or hasattr, setattr, delattr) given as a literal;
    None for any other node."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in STRING_LOOKUPS
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[1].value
    return None


def classes_with_base(root: Path, from_library: Callable[[str], bool]) -> list[type]:
    """Every class defined in the layers whose base classes include one from a module `from_library`
    accepts (its `__module__`); the modules are imported (lm-eval's extra and scripts are left out)."""
    out = []
    for path in layer_sources(root):
        name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        if name.startswith("mula.downstream") or name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if (
                inspect.isclass(cls)
                and cls.__module__ == name
                and any(from_library(b.__module__) for b in cls.__mro__[1:])
            ):
                out.append(cls)
    return out
