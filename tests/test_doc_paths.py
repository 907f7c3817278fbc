"""Every repository path that README.md and docs/*.md name exists (issue 49, "Docs that name real files").

What is checked, in every line of every document (fenced blocks included):

1. Rooted paths: a token that begins with one of the repository's top-level directories (`TOP_DIRS`:
   `mula/`, `strategies/`, `callbacks/`, `tests/`, `recipes/`, `scripts/`, `benchmarks/`, `docs/`, `.ci/`),
   in backticks or not, resolves against the repository root. A trailing `/` names a directory.
2. Module and page names alone: inline code (backticks) holding a relative name that ends in `.py`, `.md`
   or `.sh` (`pipeline/split.py`, `pipeline.md`) names a repository file: some file's path ends with it.
   When the line also names rooted directories (a table row `mula/plan/` | `memory.py`, ...), the name
   must lie under one of them.
3. Dotted module paths in inline code (`mula.training.module.MulaLightningModule`, `python -m mula.cli`,
   `strategies.XPUMoEStrategy`): the longest prefix naming a module of `mula`, `strategies` or `callbacks`
   is a file, and the next name is defined at that module's top level.
4. Tree blocks (a fenced block without a language whose first line is `name/   description`: README's
   "Layout", architecture.md's "The tree"): each entry resolves against the directory its indentation
   puts it in, exactly; a file or directory name in an entry's description (`config.py`, `moe/`) lies
   under that entry (or is a rooted path, rule 1).

Not checked, by rule (stated so that the check is strict where it applies and never flaky):

- anything that is not under a top-level directory of the repository: what a run creates (`runs/...`,
  `data/...`, `.venv/...`, `checkpoints/`, `wandb/`, `metrics.csv`, `config.yaml`), user files
  (`my_task.yaml`, `eval.yaml`), cluster paths (`/lus/...`, `/path/to/...`), Python modules of other
  packages (`torch.distributed.pipelining`);
- the part of a rooted path from a placeholder on (`<name>`, `{a,b}`, `*`, `$VAR`, `...`): only the
  directory before it is checked (`recipes/strategies/<strategy>.yaml` checks `recipes/strategies/`);
- what a documented command or script writes (`WRITTEN`), other repositories' files (`ELSEWHERE`), and
  `mula.lock`, the run-directory lock file (a file name, not a module); each with the reason.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

TOP_DIRS = ("mula", "strategies", "callbacks", "tests", "recipes", "scripts", "benchmarks", "docs", ".ci")
TOP_FILES = ("README.md", "pyproject.toml")
PACKAGES = ("mula", "strategies", "callbacks")  # importable from the repository root (rule 3)
NAMED_EXTENSIONS = (".py", ".md", ".sh")  # rule 2: names that are always repository files, never run outputs
TREE_EXTENSIONS = (".py", ".md", ".sh", ".yaml", ".toml", ".txt", ".png")  # rule 4: file names in a tree

# paths a documented command writes, so that no run of it has to precede this test
WRITTEN = {
    "recipes/machines/this-host.yaml": "mula calibrate --devices 2 --output recipes/machines/this-host.yaml",
    "recipes/machines/mycluster.yaml": "srun ... mula calibrate --output recipes/machines/mycluster.yaml",
    "summary.md": "scripts/device-check writes it under $OUT",
}
# files of the reference code (Optimus-LM) the docs cite, and file names that are not modules
ELSEWHERE = {
    "run_experiment.sh": "Optimus-LM's launch script",
    "optimus/config_utils.py": "Optimus-LM's model-name parser",
    "mula.lock": "the run-directory lock file (docs/resilience.md)",
}

FENCE = re.compile(r"^\s*```(\w*)\s*$")
CODE_SPAN = re.compile(r"`([^`]+)`")
_TOP = "|".join(re.escape(d) for d in TOP_DIRS)
ROOTED = re.compile(rf"(?<![\w./~$-])((?:{_TOP})/[^\s`'\"()\[\],;|:=]*)")
PLACEHOLDER = re.compile(r"<|\{|\*|\$|\.\.\.|…")
BARE_NAME = re.compile(r"^[\w.-]+(?:/[\w.-]+)*$")
DOTTED = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+)")
TREE_WORD = re.compile(r"(?<![\w./-])([\w][\w.-]*(?:/[\w.-]+)*/?)")


@dataclass(frozen=True)
class Miss:
    document: str
    line: int
    path: str
    why: str

    def __str__(self) -> str:
        return f"{self.document}:{self.line}: {self.path} ({self.why})"


def _repository_files(root: Path) -> set[str]:
    """Every file and directory under the top-level directories, as root-relative posix paths ("a/b/")."""
    found: set[str] = set()
    for top in TOP_DIRS:
        for dirpath, dirnames, filenames in os.walk(root / top):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.endswith(".egg-info")]
            rel = Path(dirpath).relative_to(root).as_posix()
            found.add(rel + "/")
            found.update(f"{rel}/{name}" for name in filenames)
    found.update(name for name in TOP_FILES if (root / name).is_file())
    return found


class Checker:
    """Resolves the paths of a document's text against a repository root."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = _repository_files(root)

    # -- resolution --------------------------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        path = path.removeprefix("./")
        return path in self.files or (path + "/") in self.files

    def under(self, directory: str, name: str) -> bool:
        """`name` (a file or `dir/`) is `directory`/name or lies deeper under `directory`."""
        directory = directory.rstrip("/") + "/" if directory else ""
        suffix = "/" + name.strip("/")
        for path in self.files:
            if path.startswith(directory) and (path.rstrip("/") == (directory + name).rstrip("/")
                                               or path.rstrip("/").endswith(suffix)):  # fmt: skip
                if not name.endswith("/") or path.endswith("/"):
                    return True
        return False

    def rooted(self, token: str) -> tuple[str, bool] | None:
        """(the checked part of a rooted token, whether it exists); None if nothing is left to check."""
        token = token.rstrip(".")
        cut = PLACEHOLDER.search(token)
        if cut:
            token = token[: cut.start()]
            token = token[: token.rfind("/") + 1]  # the directory before the placeholder
        if not token or token in WRITTEN:
            return None
        return token, self.exists(token)

    def module(self, dotted: str) -> str | None:
        """Why a dotted name does not resolve, or None when it does."""
        parts = dotted.split(".")
        base = self.root / parts[0]
        for i, part in enumerate(parts[1:], start=1):
            if (base / part / "__init__.py").is_file():
                base = base / part
                continue
            if (base / f"{part}.py").is_file():
                if i + 1 < len(parts) and parts[i + 1] not in _top_level_names(base / f"{part}.py"):
                    return f"{'.'.join(parts[: i + 1])} defines no {parts[i + 1]}"
                return None
            if part not in _top_level_names(base / "__init__.py"):
                return f"no module {'.'.join(parts[: i + 1])}, and {'.'.join(parts[:i])} defines no {part}"
            return None
        return None

    # -- one document ------------------------------------------------------------------------------------
    def check(self, text: str, document: str) -> list[Miss]:
        """What `text` (a markdown document called `document`) names that does not exist, in line order."""
        misses: list[Miss] = []
        lines = text.splitlines()
        prose: list[tuple[int, str]] = []  # (line number, line) of the paragraph being read
        i = 0
        while i <= len(lines):
            match = FENCE.match(lines[i]) if i < len(lines) else None
            if i == len(lines) or match or not lines[i].strip():
                misses += self._paragraph(prose, document)
                prose = []
            if i == len(lines):
                break
            if match:
                end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
                block = lines[i + 1 : end]
                if match.group(1) in ("", "text") and _is_tree(block):
                    misses += self._tree(block, i + 2, document)
                else:
                    for number, line in enumerate(block, start=i + 2):
                        misses += self._rooted_in(line, number, document)
                i = end + 1
                continue
            if lines[i].strip():
                prose.append((i + 1, lines[i]))
            i += 1
        return misses

    def _rooted_in(self, line: str, number: int, document: str) -> list[Miss]:
        misses = []
        for token in ROOTED.findall(line):
            checked = self.rooted(token)
            if checked and not checked[1]:
                misses.append(Miss(document, number, checked[0], "no such file or directory"))
        return misses

    def _paragraph(self, prose: list[tuple[int, str]], document: str) -> list[Miss]:
        """Rules 1-3 on a paragraph (inline code may run across its lines; a table row is a line)."""
        if not prose:
            return []
        misses: list[Miss] = []
        context: dict[int, list[str]] = {}  # line number -> the rooted directories that line names
        for number, line in prose:
            misses += self._rooted_in(line, number, document)
            tokens = [t.rstrip(".") for t in ROOTED.findall(line)]
            context[number] = [t if t.endswith("/") else t.rsplit("/", 1)[0] + "/" for t in tokens]
        text = "\n".join(line for _, line in prose)
        for span in CODE_SPAN.finditer(text):
            number = prose[text.count("\n", 0, span.start())][0]
            code = " ".join(span.group(1).split()).removeprefix("./")
            if code in ELSEWHERE or code in WRITTEN:
                continue
            if BARE_NAME.match(code) and code.endswith(NAMED_EXTENSIONS) and not ROOTED.fullmatch(code):
                near = context[number]
                if near and not any(self.under(directory, code) for directory in near):
                    misses.append(Miss(document, number, code, f"not under {', '.join(sorted(set(near)))}"))
                elif not near and not self.under("", code):
                    misses.append(Miss(document, number, code, "no repository file has this name"))
            for dotted in DOTTED.findall(code):
                why = self.module(dotted)
                if why:
                    misses.append(Miss(document, number, dotted, why))
        return misses

    def _tree(self, block: list[str], first: int, document: str) -> list[Miss]:
        """Rule 4. The block's description column is where its first line's description starts; a line
        indented to it continues the previous entry's description, and a name starting left of it is an
        entry (`cli.py  __main__.py`, `a.py, b.py`)."""
        misses: list[Miss] = []
        column = _entries(block[0], len(block[0]))[1]
        stack: list[tuple[int, str]] = []  # (indent, directory) of the enclosing entries
        context = ""
        for number, line in enumerate(block, start=first):
            if not line.strip():
                continue
            indent = len(line) - len(line.lstrip())
            if indent >= column:
                description = line  # a continuation of the previous entry's description
            else:
                while stack and stack[-1][0] >= indent:
                    stack.pop()
                parent = stack[-1][1] if stack else ""
                entries, start = _entries(line, column)
                description = line[start:]
                context = parent
                for entry in entries:
                    path = parent + entry
                    if not (path in self.files if entry.endswith("/") else self.exists(path)):
                        misses.append(Miss(document, number, path, "tree entry: no such file or directory"))
                    if entry.endswith("/") and context == parent:
                        context = path
                if context != parent:
                    stack.append((indent, context))
            for word in TREE_WORD.findall(description):
                word = word.rstrip(".")
                is_dir = word.endswith("/") and len(word) > 1 and word[-2].isalnum()
                if not (is_dir or word.endswith(TREE_EXTENSIONS)) or word in WRITTEN or word in ELSEWHERE:
                    continue
                if ROOTED.fullmatch(word) and self.exists(word):
                    continue
                if not self.under(context, word):
                    misses.append(Miss(document, number, word, f"not under {context or 'the repository'}"))
        return misses


def _entries(line: str, column: int) -> tuple[list[str], int]:
    """A tree line's entries (the file and directory names starting left of `column`) and the column its
    description starts at."""
    entries = []
    for match in re.finditer(r"[^\s,]+,?", line):
        word = match.group(0).rstrip(",")
        if match.start() >= column or not (word.endswith("/") or word.endswith(TREE_EXTENSIONS)):
            return entries, match.start()
        entries.append(word)
    return entries, len(line)


def _is_tree(block: list[str]) -> bool:
    return bool(block) and bool(re.match(r"^[\w.-]+/\s{2,}\S", block[0]))


_NAMES: dict[Path, set[str]] = {}


def _top_level_names(path: Path) -> set[str]:
    """The names a module defines at its top level (and string constants, for a module `__getattr__`)."""
    if path not in _NAMES:
        tree = ast.parse(path.read_text()) if path.is_file() else ast.Module(body=[], type_ignores=[])
        names: set[str] = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        if "__getattr__" in names:
            names.update(
                n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            )
        if path.name == "__init__.py":  # a package's submodules are its attributes too
            names.update(p.stem for p in path.parent.glob("*.py"))
            names.update(p.name for p in path.parent.iterdir() if (p / "__init__.py").is_file())
        _NAMES[path] = names
    return _NAMES[path]


CHECKER = Checker(ROOT)


@pytest.mark.parametrize("document", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_a_document_names_exists(document: Path) -> None:
    misses = CHECKER.check(document.read_text(), document.relative_to(ROOT).as_posix())
    assert not misses, "paths named in the document that do not exist:\n" + "\n".join(map(str, misses))


def test_the_top_level_directories_are_the_tracked_ones() -> None:
    """TOP_DIRS is what git tracks at the top level, so that a new top-level directory is checked too."""
    try:
        listed = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    tracked = {line.split("/")[0] for line in listed.splitlines() if "/" in line}
    assert tracked == set(TOP_DIRS)


PLANTED = """\
The model lives in `mula/model.py` and its MoE in mula/model/moe/; see docs/nowhere.md.
`mula plan` reads `recipes/strategies/<strategy>.yaml` and writes runs/x/metrics.csv.
| `mula/plan/` | `memory.py`, `layout_rules.py` |
The module is `mula.module.MulaLightningModule`, the strategy `strategies.XPUMoEStrategy`.

```
mula/         the package
  model/      the model (config.py, model.py, moe/)
  hf.py       Hugging Face interop
```
"""


def test_the_checker_fails_on_a_document_naming_files_that_do_not_exist() -> None:
    """A planted bug: each stale name is reported with its line, and nothing else is."""
    misses = {(m.line, m.path) for m in CHECKER.check(PLANTED, "planted.md")}
    assert misses == {
        (1, "mula/model.py"),
        (1, "docs/nowhere.md"),
        (3, "layout_rules.py"),
        (4, "mula.module.MulaLightningModule"),
        (8, "model.py"),
        (9, "mula/hf.py"),
    }, misses
