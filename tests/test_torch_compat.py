"""mula.torch_compat: every private torch name Mula uses is declared there, resolves on the installed torch,
and no other module of mula/, strategies/ or callbacks/ reaches one.

The scan's rule, read with `ast` (module level and inside functions alike), in every module but
mula/torch_compat.py:
* an import of a private torch module (a dotted part starting with `_` under `torch`) or of a private
  name from a torch module;
* an attribute chain from a name bound to torch or to something imported from it (`torch._C`,
  `dist._x`, `DTensor._y`) that has a private part;
* any other read or write `obj._name` (one leading underscore) off an object that is not `self`, `cls`
  or `super()`, and the same name as a string in `getattr`/`hasattr`/`setattr`/`delattr`, unless the
  name is one Mula's own code defines (a function, class, module or class attribute, or `self._name`)
  and is not one of torch's declared names; or it belongs to another library (`OTHER_LIBRARIES`).
mula/training/lightning_compat.py owns Lightning's private names, so only the torch rules apply to it.
A private torch method or protocol member that a Mula class defines is declared in DEFINED_FOR_TORCH.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from pathlib import Path

import torch
from source_scan import classes_with_base, layer_sources, string_lookup

from mula import torch_compat

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mula", "strategies", "callbacks")
TORCH_COMPAT = Path("mula/torch_compat.py")
LIGHTNING_COMPAT = Path("mula/training/lightning_compat.py")

# Underscored names of other libraries that the scan cannot tell from torch's, each with its owner. A
# torch name never belongs here (it goes into mula/torch_compat.py), nor a private Lightning one (it
# goes into mula/training/lightning_compat.py).
OTHER_LIBRARIES = {
    "_exit": "os._exit, the standard library's exit without cleanup (public despite its name)",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _torch_names() -> set[str]:
    """The last part of every private torch name torch_compat declares: never counted as Mula's own."""
    return {key.rpartition(".")[2] for key in torch_compat.PRIVATE_NAMES} | set(
        torch_compat.DEFINED_FOR_TORCH
    )


def own_names(trees: list[ast.Module]) -> set[str]:
    """Private names Mula's code defines: functions, classes, module and class attributes, `self._x`."""
    found: set[str] = set()
    for tree in trees:
        scopes = [tree.body] + [n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        for body in scopes:
            for node in body:
                targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                found |= {t.id for t in targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                found |= {a.asname for a in node.names if a.asname}
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                found.add(node.attr)
    return {name for name in found if _private(name)} - _torch_names()


def _torch_bound(tree: ast.Module) -> set[str]:
    """Names the module binds to torch or to something imported from it (`torch`, `dist`, `DTensor`)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    bound.add(a.asname or "torch")
        elif (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").split(".")[0] == "torch"
            and not node.level
        ):
            bound |= {a.asname or a.name for a in node.names}
    return bound


OUR_PACKAGES = ("mula", "strategies", "callbacks", "benchmarks", "tests")


def _foreign_bound(tree: ast.Module) -> frozenset[str]:
    """Names the module binds to another library than torch and Mula's own packages (`imports` of
    `from lightning_utilities.core import imports`): their private names are that library's."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            tops = [(a.name.split(".")[0], a.asname or a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            tops = [(node.module.split(".")[0], a.asname or a.name) for a in node.names]
        else:
            continue
        bound |= {name for top, name in tops if top != "torch" and top not in OUR_PACKAGES}
    return frozenset(bound)


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _is_ours(node: ast.expr) -> bool:
    """`self`, `cls` or `super()`: the object is Mula's own (overrides are checked by class, below)."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _torch_private(
    obj: ast.expr, name: str, bound: set[str], own: set[str] | None, foreign: frozenset[str] = frozenset()
) -> bool:
    """Whether reading `name` (private) off `obj` reaches torch: `obj` comes from a name bound to torch,
    or `name` is nobody else's and `obj` is not a name bound to another library (`foreign`). `own` None:
    only the first counts (a module owning another library's)."""
    root = _root(obj)
    if isinstance(root, ast.Name) and root.id in bound:
        return True
    if isinstance(root, ast.Name) and root.id in foreign:  # another library's private name
        return False
    if own is None or _is_ours(obj):
        return False
    return name not in own and name not in OTHER_LIBRARIES


def private_torch_uses(root: Path, files: list[Path]) -> list[str]:
    """'path:line: what' for every use of a private torch name in `files` (paths under `root`)."""
    trees = {path: ast.parse(path.read_text(), str(path)) for path in files}
    own = own_names(list(trees.values()))
    found: list[tuple[Path, int, str]] = []
    for path, tree in trees.items():
        rel = path.relative_to(root)
        if rel == TORCH_COMPAT:
            continue
        bound = _torch_bound(tree)
        foreign = _foreign_bound(tree) - bound
        owned = None if rel == LIGHTNING_COMPAT else own
        for node in ast.walk(tree):
            what = None
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "torch"]
                bad = [n for n in names if any(_private(p) for p in n.split("."))]
                what = f"import {', '.join(bad)}" if bad else None
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                parts = node.module.split(".")
                bad = [a.name for a in node.names if _private(a.name) or any(_private(p) for p in parts)]
                what = f"from {node.module} import {', '.join(bad)}" if bad else None
            elif (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and _torch_private(node.value, node.attr, bound, owned, foreign)
            ):
                what = ast.unparse(node)
            elif (
                (looked_up := string_lookup(node)) is not None
                and _private(looked_up)
                and _torch_private(node.args[0], looked_up, bound, owned, foreign)
            ):
                what = f"{node.func.id}({ast.unparse(node.args[0])}, {node.args[1].value!r})"
            if what:
                found.append((rel, node.lineno, what))
    return [f"{rel}:{line}: {what}" for rel, line, what in sorted(found)]


def _sources(root: Path) -> list[Path]:
    return layer_sources(root)


def test_no_module_but_torch_compat_uses_a_private_torch_name():
    found = private_torch_uses(ROOT, _sources(ROOT))
    assert not found, "private torch names belong in mula/torch_compat.py:\n" + "\n".join(found)


def test_the_scan_finds_a_planted_private_use(tmp_path):
    files = {
        "mula/torch_compat.py": "import torch._C\n",  # the one module allowed them
        "mula/training/lightning_compat.py": (
            "import torch\n"
            "def f(trainer):\n"
            "    return trainer._connector, torch._C\n"  # Lightning's name is its own; torch's is not
        ),
        "mula/ok.py": (
            "import os\n"
            "from lightning_utilities.core import imports\n"
            "class A:\n"
            "    _flag = False\n"
            "    def __init__(self):\n"
            "        self._x = 1\n"
            "    def _helper(self):\n"
            "        return self._y, getattr(self, '_z', None), super()._apply\n"
            "def f(a, b):\n"
            "    return a._x, a._helper(), A._flag, b.__dict__, getattr(a, '_x'), os._exit\n"
            "def g():\n"
            "    return imports.RequirementCache._check_requirement\n"  # another library's private name
        ),
        "mula/bad.py": (
            "import torch\n"
            "import torch._dynamo\n"
            "from torch.distributed._functional_collectives import all_reduce\n"
            "from torch.optim.optimizer import _get_fused_kernels_supported_devices\n"
            "from torch.distributed.tensor import DTensor\n"
            "def f(mesh, p, _x):\n"
            "    torch._C._current_graph_task_id()\n"
            "    mesh._flatten('dp')\n"
            "    p._local_tensor.data = p\n"
            "    getattr(torch, '_grouped_mm', None)\n"
            "    hasattr(p, '_spec')\n"
            "    DTensor._x\n"  # `_x` is one of ours above, but off torch's object
            "    p._apply\n"  # declared in torch_compat: never one of ours
        ),
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = private_torch_uses(tmp_path, _sources(tmp_path))
    assert found == [
        "mula/bad.py:2: import torch._dynamo",
        "mula/bad.py:3: from torch.distributed._functional_collectives import all_reduce",
        "mula/bad.py:4: from torch.optim.optimizer import _get_fused_kernels_supported_devices",
        "mula/bad.py:7: torch._C",
        "mula/bad.py:7: torch._C._current_graph_task_id",
        "mula/bad.py:8: mesh._flatten",
        "mula/bad.py:9: p._local_tensor",
        "mula/bad.py:10: getattr(torch, '_grouped_mm')",
        "mula/bad.py:11: hasattr(p, '_spec')",
        "mula/bad.py:12: DTensor._x",
        "mula/bad.py:13: p._apply",
        "mula/training/lightning_compat.py:3: torch._C",
    ]


def _resolve(dotted: str) -> object:
    """The object a dotted path from `torch` names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def test_every_declared_private_name_resolves_on_the_installed_torch():
    missing = []
    for dotted in torch_compat.PRIVATE_NAMES:
        try:
            _resolve(dotted)
        except (ImportError, AttributeError) as e:
            missing.append(f"{dotted}: {e}")
    for name, owner in torch_compat.DEFINED_FOR_TORCH.items():
        if not hasattr(_resolve(owner), name):
            missing.append(f"{owner}.{name}")
    assert not missing, missing


def test_every_version_shim_reads_a_name_the_tested_torch_has():
    """The public names only some torch releases have: each is on the installed torch (the tested range
    has them all; the stand-ins are for older stacks), and each entry answers."""
    for dotted in torch_compat.VERSION_SHIMS:
        _resolve(dotted)
    import torch.distributed as dist

    assert torch_compat.reduce_scatter_single is dist.reduce_scatter_single
    assert torch_compat.all_gather_single is dist.all_gather_single
    assert torch_compat.public_grouped_mm() is torch.nn.functional.grouped_mm
    assert torch_compat.xccl_available() == dist.is_xccl_available()
    assert torch_compat.xpu_available() == torch.xpu.is_available()


def test_every_entry_is_declared_and_every_declaration_has_its_entry():
    tables = {"TESTED_TORCH", "PRIVATE_NAMES", "DEFINED_FOR_TORCH", "VERSION_SHIMS"}
    entries = set(torch_compat.__all__) - tables
    declared = set(torch_compat.PRIVATE_NAMES.values()) | set(torch_compat.VERSION_SHIMS.values())
    assert declared == entries
    assert all(getattr(torch_compat, name) is not None for name in entries)


def test_entries_answer_on_the_installed_torch():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(torch_compat.running_backward())
            return grad

    assert not torch_compat.running_backward()
    Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert seen == [True]
    assert issubclass(torch_compat.local_shards_wrapper_class(), torch.Tensor)
    assert isinstance(torch_compat.graph_break_count(), int)
    assert torch_compat.FUNCTIONAL_ALL_REDUCE_HAS_BACKWARD  # true in the whole tested range
    (norm,) = torch_compat.foreach_norm([torch.tensor([3.0, 4.0])])
    assert norm.item() == 5.0


def test_the_installed_torch_is_in_the_tested_range():
    def version(text: str) -> tuple[int, int]:
        major, minor = text.split("+")[0].split(".")[:2]
        return int(major), int(minor)

    oldest, newest = (version(v) for v in torch_compat.TESTED_TORCH)
    assert oldest <= newest
    assert oldest <= version(torch.__version__) <= newest, (torch.__version__, torch_compat.TESTED_TORCH)


def test_the_package_allows_exactly_the_tested_torch_releases():
    """pyproject.toml's torch requirement is TESTED_TORCH: from the oldest to the newest minor release."""
    import re

    text = (ROOT / "pyproject.toml").read_text()
    (low, high), *rest = re.findall(r'"torch>=([0-9.]+),<([0-9.]+)"', text)
    assert rest == []
    oldest, newest = torch_compat.TESTED_TORCH
    major, minor = newest.split(".")
    assert (low, high) == (oldest, f"{major}.{int(minor) + 1}")


def _classes_with_torch_bases() -> list[type]:
    """Every class of mula/, strategies/ and callbacks/ with a torch base class (modules imported)."""
    return classes_with_base(ROOT, lambda module: module.split(".")[0] == "torch")


def _defined_in_body(cls: type) -> set[str]:
    """The names `cls`'s own class body defines (not those its metaclass adds, such as `_abc_impl`)."""
    (node,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    assert isinstance(node, ast.ClassDef)
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(item.name)
        targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_private_torch_members_a_mula_class_defines_are_declared():
    classes = _classes_with_torch_bases()
    assert {cls.__name__ for cls in classes} >= {"Router", "Mula", "EPShardedAdamW", "GroupedMM"}
    found = set()
    for cls in classes:
        torch_bases = [b for b in cls.__mro__ if b.__module__.split(".")[0] == "torch"]
        own = [c for c in cls.__mro__ if c.__module__.split(".")[0] in PACKAGES]  # mixins included
        found |= {
            f"{c.__module__}.{c.__qualname__}.{name} (of {b.__module__}.{b.__qualname__})"
            for c in own
            for name in _defined_in_body(c)
            if _private(name) and name not in torch_compat.DEFINED_FOR_TORCH
            for b in torch_bases
            if name in vars(b)
        }
    assert not found, sorted(found)
