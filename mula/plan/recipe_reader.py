"""Read a `mula plan` command line (recipe files, dotted overrides, plan options) without Lightning.

`mula fit`'s parser is LightningCLI's: it imports Lightning (6 s on a 2-core host) to learn the
Trainer's options. The planner needs a dozen values, so `mula plan` first tries this reader, which
composes the same YAML files with the same rules and checks every key against the `__init__`
signatures of the Trainer, `MulaLightningModule`, `MulaDataModule` and `XPUMoEStrategy`, read from
their source files with `ast` (nothing is imported). Whatever it is not sure to read exactly as
jsonargparse would -- an unknown key, a value of the wrong type, a required argument left out,
`--help`, `--print_config`, another strategy class, a construct listed below -- makes it answer
None, and `mula plan` goes through the full parser, which reads it (slowly) or reports the error.
`tests/test_plan_reader.py` checks that both read every shipped recipe composition the same way, and
`mula fit` checks it once per run on its own command line (`mula.plan.reader_check`): a difference is reported
as a bug in this reader. jsonargparse's composition rules are what this reader copies, so its minor
version is pinned in pyproject.toml.

Why not jsonargparse itself: it composes through the parser's argument types, and those are the
classes' signatures, which it reads from the imported classes (the Trainer, the strategy); importing
them imports Lightning and torch, the seconds this reader exists to save.

The rules (jsonargparse's, as `mula fit` applies them):

* `-c/--config FILE` files apply in order; a later file's section block (`trainer: {...}`) merges
  into the sections key by key; a dotted key (`trainer.max_steps: 10`, `--data.seq_len=64`) sets
  one value.
* `config: other.yaml` inside a file applies that file first (its path relative to the including
  file). A file with `config:` and a section block replaces that whole section in jsonargparse; this
  reader leaves such files to the full parser.
* A value that is a mapping (`model.overrides`, `optimizer_options`) is replaced as a whole; a
  dotted key below it (`--model.overrides.num_layers=2`) sets one entry.
* `trainer.strategy` with a `class_path` merges `init_args` into the current strategy of the same
  class and starts from the new class's defaults otherwise; keys below `strategy.` other than
  `class_path` are its `init_args`.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import shlex
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

# The jsonargparse release whose composition rules this reader copies (pyproject.toml pins the same);
# with another one installed, every command line goes to the full parser.
TESTED_JSONARGPARSE = "==4.53.*"
SECTIONS = ("trainer", "model", "data")
_STRATEGY_CLASSES = ("strategies.XPUMoEStrategy", "strategies.xpu_moe.XPUMoEStrategy")
# set through a link from another key (`--verify`), so jsonargparse refuses them as keys
_LINK_TARGETS = {("model", "verify_init_weights")}
# what the planner reads, with the types jsonargparse would accept (others are checked by `mula fit`)
_PLANNED_TYPES: dict[str, dict[str, Any]] = {
    "": {"seed_everything": bool | int, "verify": bool},
    "trainer": {
        "accelerator": str, "devices": int | str | list[int], "num_nodes": int,
        "precision": str | int | None,
    },
    "model": {
        "config": str | dict, "overrides": dict | None, "activation_checkpointing": str | list[str],
        "no_decay": list[str], "optimizer": str,
    },
    "data": {"data_dir": str, "seq_len": int, "global_batch_size": int, "micro_batch_size": int},
    "strategy": {
        "expert_parallel_size": int, "shard_optimizer": bool, "optimizer_options": dict | None,
        "pipeline_parallel_size": int, "pipeline_schedule": str, "pipeline_virtual_stages": int,
        "pipeline_stage_layers": list[int] | None, "tensor_parallel_size": int, "sequence_parallel": bool,
    },
}  # fmt: skip


class NeedsFullParser(Exception):
    """The command line holds something this reader does not read exactly as jsonargparse would."""


_REQUIRED = object()  # a parameter without a default
_NOT_LITERAL = object()  # a default that is an expression (not needed by the planner)


def init_parameters(source: str, class_name: str) -> dict[str, Any]:
    """`class_name.__init__`'s parameters in `source` (a file path): name -> literal default,
    `_REQUIRED` or `_NOT_LITERAL`. Read with `ast`, so nothing is imported (`signatures` caches it)."""
    tree = ast.parse(Path(source).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return _parameters(item.args)
    raise NeedsFullParser(f"{class_name} not found in {source}")


def _parameters(args: ast.arguments) -> dict[str, Any]:
    if args.vararg or args.kwarg:
        raise NeedsFullParser("a signature with *args/**kwargs")
    positional = args.posonlyargs + args.args
    defaults = [_REQUIRED] * (len(positional) - len(args.defaults)) + list(args.defaults)
    pairs = list(zip(positional, defaults))[1:]  # drop self
    pairs += list(zip(args.kwonlyargs, [_REQUIRED if d is None else d for d in args.kw_defaults]))
    out = {}
    for arg, default in pairs:
        if default is _REQUIRED:
            out[arg.arg] = _REQUIRED
            continue
        try:
            out[arg.arg] = ast.literal_eval(default)
        except ValueError:
            out[arg.arg] = _NOT_LITERAL
    return out


def _package_dir(name: str) -> Path:
    """A top-level package's directory, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise NeedsFullParser(f"package {name} not found")
    return Path(list(spec.submodule_search_locations)[0])


@functools.lru_cache(maxsize=1)
def signatures() -> dict[str, dict[str, Any]]:
    """The parameters (with defaults) of each recipe section and of `XPUMoEStrategy`."""
    mula_dir = Path(__file__).resolve().parents[1]
    return {
        "trainer": init_parameters(str(_package_dir("lightning") / "pytorch/trainer/trainer.py"), "Trainer"),
        "model": init_parameters(str(mula_dir / "training/module.py"), "MulaLightningModule"),
        "data": init_parameters(str(mula_dir / "data/datamodule.py"), "MulaDataModule"),
        "strategy": init_parameters(str(_package_dir("strategies") / "xpu_moe.py"), "XPUMoEStrategy"),
    }


def matches(value: Any, tp: Any) -> bool:
    """Whether `value` (read from YAML) is of type `tp` as jsonargparse would accept it (the few types
    `_PLANNED_TYPES` and the plan options use)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, t) for t in typing.get_args(tp))
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(matches(v, item) for v in value)
    if tp is None or tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp)


class _Namespace:
    """The sections being composed, the other top-level keys, and the keys every file and flag set."""

    def __init__(self, top_level: dict[str, Any]) -> None:
        self.sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
        self.top: dict[str, Any] = {}
        self.top_level = top_level  # accepted top-level keys -> type

    def apply_file(self, path: Path) -> None:
        """Apply one recipe file (its `config:` include first)."""
        if not path.is_file():
            raise NeedsFullParser(f"no file {path}")
        content = yaml.safe_load(path.read_text())
        if content is None:
            return
        if not isinstance(content, dict):
            raise NeedsFullParser(f"{path} is not a mapping")
        if "config" in content:
            if list(content)[0] != "config" or not isinstance(content["config"], str):
                raise NeedsFullParser("config: must be the file's first key and one path")
            if any(k in SECTIONS and isinstance(v, dict) for k, v in content.items()):
                raise NeedsFullParser("a section block next to config: replaces the section")
            include = Path(content["config"])
            self.apply_file(include if include.is_absolute() else path.parent / include)
        for key, value in content.items():
            if key != "config":
                self.apply(key, value)

    def apply(self, key: str, value: Any) -> None:
        """Set a dotted key (`trainer.devices`) or merge a section block (`trainer: {...}`)."""
        parts = key.split(".")
        head = parts[0]
        if head in SECTIONS:
            if len(parts) > 1:
                self._assign(head, parts[1:], value)
            elif isinstance(value, dict):
                for k, v in value.items():
                    if "." in str(k):
                        raise NeedsFullParser("a dotted key inside a section block")
                    self._assign(head, [str(k)], v)
            else:
                raise NeedsFullParser(f"--{head} given a file or a non-mapping")
        elif len(parts) == 1 and head in self.top_level:
            self.top[head] = value
        else:
            raise NeedsFullParser(f"unknown key {key}")

    def _assign(self, section: str, path: list[str], value: Any) -> None:
        key = path[0].removesuffix("+")
        params = signatures()[section]
        if key not in params or (section, key) in _LINK_TARGETS:
            raise NeedsFullParser(f"unknown key {section}.{key}")
        target = self.sections[section]
        if section == "trainer" and key == "strategy":
            self._assign_strategy(path[1:], value)
        elif path[0].endswith("+") and len(path) == 1:
            # a list appended to, as jsonargparse does (callbacks: the planner reads FaultTolerantCheckpoint's
            # async_save, whose staging copy is in its host bytes)
            current = target.get(key) or []
            current = current if isinstance(current, list) else [current]
            target[key] = current + (value if isinstance(value, list) else [value])
        elif path[0].endswith("+") or len(path) == 1:
            target[key] = value
        elif key == "overrides" or key not in _PLANNED_TYPES[section]:
            # below a mapping value (model.overrides) or inside a class the planner ignores (a logger)
            target[key] = _set_in(target.get(key), path[1:], value)
        else:
            raise NeedsFullParser(f"a dotted key below {section}.{key}")

    def _assign_strategy(self, path: list[str], value: Any) -> None:
        trainer = self.sections["trainer"]
        current = trainer.get("strategy")
        if not path:
            if isinstance(value, str):
                trainer["strategy"] = value
                return
            if not isinstance(value, dict) or set(value) - {"class_path", "init_args"}:
                raise NeedsFullParser("a strategy that is not {class_path, init_args}")
            if "class_path" in value:
                self._set_class_path(value["class_path"])
            self._merge_init_args(value.get("init_args") or {})
        elif path[0] == "class_path" and len(path) == 1:
            self._set_class_path(value)
        else:
            rest = path[1:] if path[0] == "init_args" else path
            if not isinstance(current, dict) or not rest:
                raise NeedsFullParser("strategy options without a strategy class")
            init = current["init_args"]
            if len(rest) == 1:
                self._merge_init_args({rest[0]: value})
            elif rest[0] == "optimizer_options":
                init["optimizer_options"] = _set_in(init.get("optimizer_options"), rest[1:], value)
            else:
                raise NeedsFullParser("a dotted key below a strategy option")

    def _set_class_path(self, class_path: Any) -> None:
        """Another class starts from its defaults (another strategy class is kept only to be replaced:
        `_read` leaves a final one to the full parser)."""
        if not isinstance(class_path, str):
            raise NeedsFullParser("a class_path that is not a string")
        current = self.sections["trainer"].get("strategy")
        same = isinstance(current, dict) and _same_class(current["class_path"], class_path)
        if not same:
            self.sections["trainer"]["strategy"] = {"class_path": class_path, "init_args": {}}

    def _merge_init_args(self, init_args: dict[str, Any]) -> None:
        current = self.sections["trainer"].get("strategy")
        if not isinstance(current, dict):
            raise NeedsFullParser("strategy options without a strategy class")
        params = signatures()["strategy"] if current["class_path"] in _STRATEGY_CLASSES else None
        for k, v in init_args.items():
            if params is not None and k not in params:
                raise NeedsFullParser(f"unknown strategy option {k}")
            current["init_args"][k] = v


def _same_class(a: str, b: str) -> bool:
    return a == b or (a in _STRATEGY_CLASSES and b in _STRATEGY_CLASSES)


def _set_in(mapping: Any, path: list[str], value: Any) -> dict[str, Any]:
    """A copy of `mapping` (a dict or None) with the entry at `path` set to `value`."""
    if mapping is not None and not isinstance(mapping, dict):
        raise NeedsFullParser("a dotted key below a value that is not a mapping")
    out = dict(mapping or {})
    out[path[0]] = _set_in(out.get(path[0]), path[1:], value) if len(path) > 1 else value
    return out


def _tokens(argv: list[str], flags: set[str]) -> list[tuple[str, str]]:
    """(key, raw value) pairs of the command line, `config` for each `-c/--config FILE`; `flags` are the
    yes/no options (`--search`, `--no_search`)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-c", "--config"):
            if i + 1 >= len(argv):
                raise NeedsFullParser("-c without a file")
            out.append(("config", argv[i + 1]))
            i += 2
            continue
        if not arg.startswith("--") or arg in ("--help", "--print_config"):
            raise NeedsFullParser(f"argument {arg}")
        name, eq, raw = arg[2:].partition("=")
        if name in flags and not eq:
            out.append((name, "true"))
            i += 1
            continue
        if name.startswith("no_") and name[3:] in flags and not eq:
            out.append((name[3:], "false"))
            i += 1
            continue
        if name.startswith("print_config"):
            raise NeedsFullParser(f"argument {arg}")
        if not eq:
            if i + 1 >= len(argv):
                raise NeedsFullParser(f"{arg} without a value")
            raw = argv[i + 1]
            i += 1
        out.append((name, raw))
        i += 1
    return out


def read_plan_command(argv: list[str], options: dict[str, tuple[Any, Any]]) -> dict[str, Any] | None:
    """`run_plan`'s keyword arguments (trainer, model, data as dicts with the signatures' defaults,
    plus the plan options) for `mula plan ARGV`, or None when the full parser must read it.

    `options`: the plan's own options, name -> (type, default) (`mula.plan.command.PLAN_OPTIONS`).
    """
    if not tested_jsonargparse():
        return None
    try:
        return _read(argv, options)
    except (NeedsFullParser, OSError, yaml.YAMLError):
        return None


@functools.lru_cache(maxsize=1)
def tested_jsonargparse() -> bool:
    """Whether the installed jsonargparse is the release `TESTED_JSONARGPARSE` names (read without importing it)."""
    try:
        installed = importlib.metadata.version("jsonargparse")
    except importlib.metadata.PackageNotFoundError:
        return False
    return installed.split(".")[:2] == TESTED_JSONARGPARSE.removeprefix("==").split(".")[:2]


def _read(argv: list[str], options: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    top_level = {**_PLANNED_TYPES[""], **{name: tp for name, (tp, _) in options.items()}}
    ns = _Namespace(top_level)
    flags = {name for name, (tp, _) in options.items() if tp is bool}
    for key, raw in _tokens(argv, flags):
        if key == "config":
            ns.apply_file(Path(raw))
        else:
            ns.apply(key, yaml.safe_load(raw) if raw != "" else "")
    out: dict[str, Any] = {}
    sigs = signatures()
    for section in SECTIONS:
        merged = {k: v for k, v in sigs[section].items() if v is not _NOT_LITERAL}
        merged.update(ns.sections[section])
        missing = [key for key, value in merged.items() if value is _REQUIRED]
        if missing:
            raise NeedsFullParser(f"{section}.{missing[0]} is required")
        for key, value in ns.sections[section].items():  # the signature's defaults are right as they are
            tp = _PLANNED_TYPES[section].get(key)
            if tp is not None and not matches(value, tp):
                raise NeedsFullParser(f"{section}.{key}: {value!r}")
        out[section] = merged
    strategy = out["trainer"].get("strategy")
    if isinstance(strategy, dict):
        if strategy["class_path"] not in _STRATEGY_CLASSES:
            raise NeedsFullParser(f"strategy class {strategy['class_path']}")
        for key, value in strategy["init_args"].items():
            tp = _PLANNED_TYPES["strategy"].get(key)
            if tp is not None and not matches(value, tp):
                raise NeedsFullParser(f"trainer.strategy.{key}: {value!r}")
    for name, (tp, default) in options.items():
        value = ns.top.get(name, default)
        if not matches(value, tp):
            raise NeedsFullParser(f"--{name}: {value!r}")
        out[name] = value
    for name, tp in _PLANNED_TYPES[""].items():
        if name in ns.top and not matches(ns.top[name], tp):
            raise NeedsFullParser(f"--{name}: {ns.top[name]!r}")
    return out


def header_command(text: str, program: str) -> list[str]:
    """The arguments of the `#   <program> ...` command in a recipe file's header comment (backslash
    continuations joined): the commands the paper recipes say they were planned and trained with."""
    lines = [line.removeprefix("#").strip() for line in text.splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(lines) if line.startswith(program))
    command = ""
    for line in lines[start:]:
        command += " " + line.removesuffix("\\")
        if not line.endswith("\\"):
            break
    return shlex.split(command)[len(program.split()) :]
