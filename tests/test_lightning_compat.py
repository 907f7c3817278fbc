"""mula.training.lightning_compat: the private Lightning names resolve, and the tested range is the one required."""

from __future__ import annotations

import ast
import re
import textwrap
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import lightning
from packaging.specifiers import SpecifierSet
from source_scan import classes_with_base, layer_sources, string_lookup

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
    real._signal_connector.received_sigterm = True  # as Lightning's SIGTERM handler records it
    assert real.received_sigterm
    lightning_compat.forget_lightning_sigterm(real)
    assert not real.received_sigterm


def test_sigterm_agreement_runs_on_the_first_batch_of_logging_steps_only():
    """Lightning's per-batch SIGTERM broadcast (a host sync per micro-batch) is the one its epoch loop
    calls before every batch; after `sigterm_agreement_on_logging_steps` it runs once per logging step."""
    import inspect

    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)
    agreed = []

    class Loop:
        def _broadcast_sigterm_tensor(self) -> None:
            agreed.append(trainer.global_step + 1)  # the step whose batch comes next

    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=Loop()), global_step=0, log_every_n_steps=3)
    lightning_compat.sigterm_agreement_on_logging_steps(trainer)
    for step in range(7):  # two micro-batches per step
        trainer.global_step = step
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert agreed == [3, 6]
    trainer.log_every_n_steps = 0  # a run that never logs never agrees (PreemptionHandler still does)
    trainer.global_step = 8
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert agreed == [3, 6]


def test_process_group_timeout_is_the_strategy_argument():
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    assert lightning_compat.process_group_timeout(DDPStrategy(timeout=timedelta(seconds=7))) == timedelta(
        seconds=7
    )
    assert lightning_compat.process_group_timeout(SingleDeviceStrategy("cpu")) is None


# The one private Lightning hook Mula overrides: Lightning gives a custom strategy no public way to
# choose its launcher (DDPStrategy overrides the same method).
PRIVATE_OVERRIDES_ALLOWED = {("XPUMoEStrategy", "_configure_launcher")}


def _sources() -> list[Path]:
    return layer_sources(ROOT)


def test_private_lightning_names_are_imported_in_lightning_compat_only():
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
    return classes_with_base(ROOT, lambda module: module.startswith("lightning."))


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
    such as callbacks' CheckpointSaving included) defines and a Lightning class in that MRO also defines."""
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


# Where private names may be read through a string: Lightning's here, torch's in mula/torch_compat.py
# (torch's own objects are left to tests/test_torch_compat.py).
COMPAT_MODULES = {"mula/training/lightning_compat.py", "mula/torch_compat.py"}


def _torch_names(tree: ast.Module) -> set[str]:
    """The names a module binds to torch or a part of it (`import torch.distributed as dist`, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {
                (a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "torch"
            }
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node: ast.expr) -> str | None:
    """The name an attribute chain starts from (`torch` for `torch.nn.functional`)."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_string_lookups(root: Path) -> list[str]:
    """`getattr(x, "_name")` (or hasattr, setattr, delattr) in mula/, strategies/ and callbacks/ outside
    the compat modules, save on torch's objects; dunder names are Python's, not private."""
    found = []
    for package in ("mula", "strategies", "callbacks"):
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in COMPAT_MODULES:
                continue
            tree = ast.parse(path.read_text(), rel)
            torch_names = _torch_names(tree)
            for node in ast.walk(tree):
                name = string_lookup(node)
                if name is None:
                    continue
                dunder = name.startswith("__") and name.endswith("__")
                if name.startswith("_") and not dunder and _root(node.args[0]) not in torch_names:
                    found.append(f"{rel}:{node.lineno}: {node.func.id}(..., {name!r})")
    return found


def test_no_private_name_is_read_through_a_string_outside_the_compat_modules():
    """A private Lightning attribute goes through a named lightning_compat function; our own objects
    initialise their attributes where they are built, so nothing reads them by a string."""
    assert private_string_lookups(ROOT) == []


def test_a_planted_private_name_read_through_a_string_is_found(tmp_path):
    """The scan can fail: a Lightning private read, our own attribute tested and set through strings are
    found in each package; torch's names (however imported), dunder names, non-literal names and the
    compat module are not."""
    files = {
        "mula/a.py": """
            def f(trainer, strategy, name):
                return getattr(trainer, "_signal_connector", None), hasattr(strategy.x, "_timeout"), getattr(trainer, name)
        """,
        "strategies/b.py": """
            import torch
            import torch.distributed as dist
            from torch.distributed import _functional_collectives as funcol
            ok = getattr(torch, "_grouped_mm", None), hasattr(dist, "_x"), getattr(funcol, "_y"), getattr(int, "__name__")
        """,
        "callbacks/c.py": """
            class C:
                def __init__(self):
                    setattr(self, "_writer", None)
        """,
        "mula/training/lightning_compat.py": """
            def connector(trainer):
                return getattr(trainer, "_signal_connector")
        """,
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    assert sorted(private_string_lookups(tmp_path)) == [
        "callbacks/c.py:4: setattr(..., '_writer')",
        "mula/a.py:3: getattr(..., '_signal_connector')",
        "mula/a.py:3: hasattr(..., '_timeout')",
    ]


# Public names read through a string: a capability of Mula's own objects is declared (a Protocol or a
# typed attribute: `MulaStrategy`, `ShardedOptimizer`, `mula_module`, the callbacks' `_peers`) and asked
# with `isinstance`, and a torch-version shim lives in mula/torch_compat.py. What stays is an optional
# member of another library's object, each listed here with the reason it is optional.
PUBLIC_LOOKUPS_ALLOWED: dict[tuple[str, str], str] = {
    ("mula/checkpoint/atomic.py", "O_DIRECTORY"): "os: POSIX only",
    ("mula/checkpoint/atomic.py", "syncfs"): "libc through ctypes: glibc >= 2.14 only",
    ("mula/data/prepare.py", "sched_getaffinity"): "os: Linux only",
    ("mula/training/host_allocator.py", "mallopt"): "libc through ctypes: glibc only",
    ("mula/checkpoint/lock.py", "cluster_environment"): "Lightning: only a parallel strategy has one",
    ("mula/plan/dry_run.py", "rank"): "Lightning's rank_zero_only: set on the function once a rank is known",
    ("mula/training/devices.py", "max_memory_allocated"): "torch's device modules differ by backend",
    ("mula/training/devices.py", "get_device_name"): "torch's device modules differ by backend",
    ("mula/training/devices.py", "is_bf16_supported"): "torch's device modules differ by backend",
    ("strategies/model_setup.py", "reset_parameters"): "torch's convention: a module that initialises "
    "its own parameters defines it, a container does not",
    # torch-version shims still outside mula/torch_compat.py (its `reduce_scatter_single`,
    # `all_gather_single` and `xpu_available` are the replacements)
}


def public_string_lookups(root: Path) -> list[str]:
    """`getattr(x, "name")` (or hasattr, setattr, delattr) of a public, non-dunder literal name in mula/,
    strategies/ and callbacks/ outside the compat modules, each as 'path:line: call'; (path, name) pairs
    of PUBLIC_LOOKUPS_ALLOWED are left out."""
    found = []
    for path in layer_sources(root):
        rel = path.relative_to(root).as_posix()
        if rel in COMPAT_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            name = string_lookup(node)
            if name is None or name.startswith("_") or (rel, name) in PUBLIC_LOOKUPS_ALLOWED:
                continue
            found.append(f"{rel}:{node.lineno}: {node.func.id}(..., {name!r})")
    return sorted(found)


def test_no_public_name_is_read_through_a_string_but_an_allowed_one():
    """A capability is asked with `isinstance` against its declared contract, not looked up by name."""
    assert public_string_lookups(ROOT) == []


def test_every_allowed_public_lookup_is_still_there():
    """An allowed lookup that is gone leaves the list (so the list stays the real exceptions)."""
    seen = set()
    for path in layer_sources(ROOT):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            name = string_lookup(node)
            if name is not None:
                seen.add((rel, name))
    assert set(PUBLIC_LOOKUPS_ALLOWED) <= seen, sorted(set(PUBLIC_LOOKUPS_ALLOWED) - seen)


def test_a_planted_public_capability_read_through_a_string_is_found(tmp_path):
    """The scan can fail: a capability of our own objects asked by name in each package, a torch name
    read by a string outside torch_compat, and an allowed name in another file are found; dunder names,
    non-literal names, private names (the scan above), the compat modules and an allowed pair are not."""
    files = {
        "mula/a.py": """
            def f(strategy, module, name):
                return getattr(strategy, "shard_optimizer", False), getattr(module, "optimizer", "adamw"), getattr(module, name)
        """,
        "strategies/b.py": """
            import torch.distributed as dist
            def g(opt):
                return hasattr(opt, "reduce_gradients"), getattr(dist, "reduce_scatter_single", None), getattr(opt, "__class__")
        """,
        "callbacks/c.py": """
            def h(callback, os):
                setattr(callback, "heartbeat", None)
                return getattr(os, "sched_getaffinity", None), getattr(callback, "_private")
        """,
        "mula/data/prepare.py": """
            import os
            cores = hasattr(os, "sched_getaffinity")
        """,
        "mula/torch_compat.py": """
            import torch
            xpu = getattr(torch, "xpu", None)
        """,
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    assert public_string_lookups(tmp_path) == [
        "callbacks/c.py:3: setattr(..., 'heartbeat')",
        "callbacks/c.py:4: getattr(..., 'sched_getaffinity')",
        "mula/a.py:3: getattr(..., 'optimizer')",
        "mula/a.py:3: getattr(..., 'shard_optimizer')",
        "strategies/b.py:4: getattr(..., 'reduce_scatter_single')",
        "strategies/b.py:4: hasattr(..., 'reduce_gradients')",
    ]
