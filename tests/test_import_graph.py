"""The import graph of mula/, strategies/ and callbacks/: no circle, and no import against the layers.

Layers, top to bottom (DESIGN.md): callbacks -> strategies -> mula. A circle means none of its modules
can be read, tested or changed alone, so it counts whether the import is at module level, inside a
function or under `TYPE_CHECKING`: a deferred import hides a circle, it does not break it. A package's
`__init__` re-exporting its own members is not a circle of design (its members import each other, not
the package's re-exports, which the graph resolves to the member itself). Nor may a module import one
of ours by a literal module name (`importlib.import_module("strategies...")`), which would hide an edge.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("mula", "strategies", "callbacks")  # bottom to top


def modules(root: Path) -> dict[str, Path]:
    """Every module of the layers' packages, by dotted name (a package by its own name)."""
    found = {}
    for package in LAYERS:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _owner(name: str, mods: dict[str, Path]) -> str | None:
    """The module `name` (a module, or an attribute of one) lives in."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_edges(root: Path) -> dict[str, set[str]]:
    """module -> the modules of the layers it imports, anywhere in its file."""
    mods = modules(root)
    edges: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                # `from pkg import member` is an import of the member module when it is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                owner = _owner(target, mods)
                if owner is not None and owner != name:
                    edges[name].add(owner)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            component.sort()
            package_and_member = len(component) == 2 and component[1].startswith(component[0] + ".")
            if len(component) > 1 and not package_and_member:
                found.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Imports from a lower layer into a higher one."""
    level = {package: i for i, package in enumerate(LAYERS)}
    return sorted(
        f"{m} -> {t}"
        for m, targets in edges.items()
        for t in targets
        if level[t.split(".")[0]] > level[m.split(".")[0]]
    )


_BY_NAME = {"import_module", "__import__", "locate", "find_spec"}


def string_imports(root: Path) -> list[str]:
    """Imports of the layers' own modules by a literal module name (`importlib.import_module("mula.x")`,
    `__import__`, `pydoc.locate`, `find_spec`): the import graph cannot see them, so none may exist. A
    recipe's class_path arrives as data, not a literal, and `mula/moved_paths.py` maps old names."""
    found = []
    for name, path in modules(root).items():
        if name == "mula.moved_paths":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
                continue
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            target = node.args[0].value
            if func in _BY_NAME and isinstance(target, str) and target.split(".")[0] in LAYERS:
                found.append(f"{name}:{node.lineno}: {func}({target!r})")
    return found


def test_no_import_circle_and_no_upward_import():
    edges = import_edges(ROOT)
    assert len(edges) > 150  # the whole code base was read
    assert circles(edges) == []
    assert upward(edges) == []
    assert string_imports(ROOT) == []


def _plant(root: Path, files: dict[str, str]) -> None:
    for package in LAYERS:
        (root / package).mkdir()
        (root / package / "__init__.py").write_text("")
    for name, text in files.items():
        (root / name).write_text(textwrap.dedent(text))


def test_a_planted_circle_and_an_upward_import_are_found(tmp_path):
    """The checks can fail: a circle closed only by a deferred import inside a function and one closed
    by a `TYPE_CHECKING` import are both found, and so is `mula` importing `strategies`; a package
    re-exporting its member is not a circle."""
    _plant(
        tmp_path,
        {
            "mula/a.py": "from mula.b import f\n",
            "mula/b.py": "def f():\n    from mula import a\n",
            "mula/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mula.d import D\n",
            "mula/d.py": "from .c import *\n",
            "mula/e.py": "import strategies.s\n",
            "strategies/s.py": "from mula.a import f\n",
            "strategies/__init__.py": "from strategies.s import f\n",
            "callbacks/k.py": "from strategies import f\n",
            "mula/g.py": "import importlib\nA = importlib.import_module('strategies.s')\nB = importlib.import_module('numpy')\n",
        },
    )
    edges = import_edges(tmp_path)
    assert sorted(circles(edges)) == [["mula.a", "mula.b"], ["mula.c", "mula.d"]]
    assert upward(edges) == ["mula.e -> strategies.s"]
    assert string_imports(tmp_path) == ["mula.g:2: import_module('strategies.s')"]
