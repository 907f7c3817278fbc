"""Every layout sentence reaches a `mula fit` user as one line: `mula: error: <sentence>`, exit status 2.

The sentences live once each, under a key, in the `Sentences` tables of the modules that own the checks
(`TABLES`: mula/layout/rules.py, which `ParallelLayout.validate` runs, and the sharded optimizer's
options, mula/layout/sharding_options.py). Each command line here names the key of the sentence it must
print and the values that render it, and must print exactly that sentence, alone: under 200
characters, on one line, without jsonargparse's Union wrapper or a namespace dump. Each command line
runs in-process in an empty directory (the refusal comes before any data is prepared or any rank is
started).

The source of mula/, strategies/ and callbacks/ is read with `ast`: a `Sentences` table outside
`TABLES`, a refusal raised under a key no table has, a key no check raises, a key without a command line
(or a reason in `UNREACHABLE`), and a sentence written out again in an exception elsewhere each fail.
"""

from __future__ import annotations

import ast
import re
import string
import textwrap
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from source_scan import layer_sources

from mula.commands.entry import main
from mula.layout import rules, sharding_options
from mula.layout.sentences import Sentences

ROOT = Path(__file__).resolve().parents[1]
TINY_MOE = str(ROOT / "recipes" / "mula-tiny-moe.yaml")
TINY_DENSE = str(ROOT / "recipes" / "mula-tiny-dense.yaml")
S = "--trainer.strategy.init_args."

# every table of refusal sentences, by the file that holds it
TABLES: dict[str, Sentences] = {
    "mula/layout/rules.py": rules.SENTENCES,
    "mula/layout/sharding_options.py": sharding_options.SENTENCES,
}


def _all_sentences() -> dict[str, str]:
    out: dict[str, str] = {}
    for path, table in TABLES.items():
        shared = set(out) & set(table)
        assert not shared, f"{path} reuses keys of another table: {sorted(shared)}"
        out.update(table)
    return out


SENTENCES = _all_sentences()


class Case(NamedTuple):
    """A `mula fit` command line (recipe, devices, extra arguments) and the sentence it must print: its
    key and the values that render it."""

    recipe: str
    devices: int
    args: list[str]
    key: str
    values: dict[str, Any] = {}  # noqa: RUF012 (never mutated)


# the tiny MoE has 4 layers, 4 heads, 16 experts and 2 micro-batches of 8 sequences per step on one
# data-parallel rank
CASES: dict[str, Case] = {
    "size below 1": Case(TINY_MOE, 2, [f"{S}expert_parallel_size=0"], "at-least-1", {"name": "expert_parallel_size", "size": 0}),
    "EP larger than W": Case(TINY_MOE, 2, [f"{S}expert_parallel_size=4"], "ep-above-world", {"ep_size": 4, "world_size": 2}),
    "W not divisible by E": Case(TINY_MOE, 4, [f"{S}expert_parallel_size=3"], "world-not-divisible-by-size",
                                 {"world_size": 4, "size": "expert_parallel_size=3"}),
    "W not divisible by C": Case(TINY_MOE, 2, [f"{S}context_parallel_size=4"], "world-not-divisible-by-size",
                                 {"world_size": 2, "size": "context_parallel_size=4"}),
    "W not divisible by T": Case(TINY_MOE, 2, [f"{S}tensor_parallel_size=4"], "world-not-divisible-by-size",
                                 {"world_size": 2, "size": "tensor_parallel_size=4"}),
    "W not divisible by P": Case(TINY_MOE, 2, [f"{S}pipeline_parallel_size=4"], "world-not-divisible-by-size",
                                 {"world_size": 2, "size": "pipeline_parallel_size=4"}),
    "W not divisible by T x E": Case(TINY_MOE, 6, [f"{S}tensor_parallel_size=2", f"{S}expert_parallel_size=2"],
                                     "world-not-divisible-by-sizes",
                                     {"world_size": 6, "sizes": "tensor_parallel_size=2 x expert_parallel_size=2", "product": 4}),
    "EP of a dense model": Case(TINY_DENSE, 2, [f"{S}expert_parallel_size=2"], "ep-of-dense-model", {"ep_size": 2}),
    "experts not divisible by EP": Case(TINY_MOE, 3, [f"{S}expert_parallel_size=3"], "experts-not-divisible",
                                        {"num_experts": 16, "ep_size": 3}),
    "heads not divisible by T": Case(TINY_MOE, 8, [f"{S}tensor_parallel_size=8"], "tp-split",
                                     {"count": 4, "what": "attention heads", "tp_size": 8}),
    "capacity with T": Case(TINY_MOE, 2, [f"{S}tensor_parallel_size=2", "--model.overrides.capacity_factor=1.25"],
                            "capacity-with-split-tokens", {"by": "tensor_parallel_size=2"}),
    "heads not divisible by C": Case(TINY_MOE, 8, [f"{S}context_parallel_size=8"], "cp-split",
                                     {"count": 4, "what": "attention heads", "by": "context_parallel_size=8"}),
    "sequence not divisible by C": Case(TINY_MOE, 2, [f"{S}context_parallel_size=2", "--data.seq_len=255"], "sequence-split",
                                        {"seq_len": 255, "cp_size": 2}),
    "unknown schedule": Case(TINY_MOE, 2, [f"{S}pipeline_schedule=zero-bubble"], "unknown-schedule",
                             {"schedules": "1f1b, interleaved-1f1b, gpipe", "schedule": "zero-bubble"}),
    "virtual stages below 1": Case(TINY_MOE, 2, [f"{S}pipeline_virtual_stages=0"], "at-least-1",
                                   {"name": "pipeline_virtual_stages", "size": 0}),
    "virtual stages without interleaving": Case(TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", f"{S}pipeline_virtual_stages=2"],
                                                "virtual-stages-schedule", {"virtual_stages": 2, "schedule": "1f1b"}),
    "virtual stages without stages": Case(TINY_MOE, 2, [f"{S}pipeline_schedule=interleaved-1f1b", f"{S}pipeline_virtual_stages=2"],
                                          "virtual-stages-without-stages", {"virtual_stages": 2}),
    "more stages than layers": Case(TINY_MOE, 8, [f"{S}pipeline_parallel_size=8"], "more-stages-than-layers",
                                    {"num_layers": 4, "stages": 8}),
    "stage layers of another length": Case(TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", f"{S}pipeline_stage_layers=[4]"],
                                           "stage-layers-length", {"entries": 1, "stages": 2}),
    "a stage without layers": Case(TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", f"{S}pipeline_stage_layers=[0, 4]"],
                                   "stage-without-layers", {"counts": [0, 4]}),
    "stage layers of another sum": Case(TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", f"{S}pipeline_stage_layers=[1, 2]"],
                                        "stage-layers-sum", {"counts": [1, 2], "total": 3, "num_layers": 4}),
    "tied embeddings across stages": Case(TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", "--model.overrides.tie_embeddings=true"],
                                          "tied-embeddings-across-stages"),
    "MTP across stages, sharded": Case(TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", "--model.overrides.mtp_depth=1"],
                                      "mtp-across-stages", {"mtp_depth": 1, "pp_size": 2}),
    "global aux loss across stages": Case(TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", "--model.overrides.aux_loss_scope=global"],
                                          "global-aux-loss-across-stages", {"pp_size": 2}),
    "fewer micro-batches than stages": Case(TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", "--data.micro_batch_size=16"],
                                            "fewer-micro-batches-than-stages", {"schedule": "1f1b", "pp_size": 2, "micro_batches": 1}),
    "interleaved rounds": Case(TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", f"{S}pipeline_schedule=interleaved-1f1b",
                                             f"{S}pipeline_virtual_stages=2", "--data.global_batch_size=40"],
                               "interleaved-rounds", {"pp_size": 2, "micro_batches": 5, "rounds": 2}),
    "ZeRO-2 across stages": Case(TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", f"{S}optimizer_options={{zero_stage: 2}}"],
                                 "zero-2-across-stages"),
    "batch split": Case(TINY_MOE, 2, ["--data.micro_batch_size=3"], "batch-split",
                        {"global_batch": 16, "dp_world": 2, "micro_batch": 3}),
    "bf16 weights without masters": Case(TINY_MOE, 2, [f"{S}shard_optimizer=false", "--trainer.precision=bf16-true"],
                                         "master-weights", {"precision": "bf16-true", "strategy": "XPUMoEStrategy"}),
    "sequence parallelism without TP": Case(TINY_DENSE, 2, [f"{S}sequence_parallel=true"], "sequence-parallel-without-tp"),
    "bucket size": Case(TINY_MOE, 2, [f"{S}bucket_size_mb=0"], "bucket-size", {"bucket_size_mb": 0.0}),
    "reduce dtype": Case(TINY_MOE, 2, [f"{S}optimizer_options={{reduce_dtype: int32}}"], "reduce-dtype",
                         {"dtypes": "float32, bfloat16, float16, float64", "dtype": "int32"}),
    "ZeRO stage": Case(TINY_MOE, 2, [f"{S}optimizer_options={{zero_stage: 3}}"], "zero-stage", {"zero_stage": 3}),
    "bucket numel": Case(TINY_MOE, 2, [f"{S}optimizer_options={{bucket_numel: 0}}"], "bucket-numel", {"bucket_numel": 0, "align": 16}),
    "max grad norm": Case(TINY_MOE, 2, [f"{S}optimizer_options={{max_grad_norm: -1}}"], "max-grad-norm", {"max_grad_norm": -1}),
    "tail buckets below 0": Case(TINY_MOE, 2, [f"{S}optimizer_options={{offload: true, offload_tail_buckets: -1}}"], "at-least-0",
                                 {"name": "offload_tail_buckets", "value": -1}),
    "tail buckets without offload": Case(TINY_MOE, 2, [f"{S}optimizer_options={{offload_tail_buckets: 1}}"],
                                         "tail-buckets-without-offload"),
    "clip after step": Case(TINY_MOE, 2, [f"{S}optimizer_options={{clip_after_step: -1}}"], "at-least-0",
                            {"name": "clip_after_step", "value": -1}),
    "collectives": Case(TINY_MOE, 2, [f"{S}optimizer_options={{collectives: nccl}}"], "collectives", {"collectives": "nccl"}),
    "unknown optimizer option": Case(TINY_MOE, 2, [f"{S}optimizer_options={{zero_stag: 1}}"], "unknown-option",
                                     {"name": "zero_stag", "hint": " (did you mean 'zero_stage'?)"}),
    "Muon with T": Case(TINY_DENSE, 2, [f"{S}tensor_parallel_size=2", f"{S}shard_optimizer=false", "--model.optimizer=muon"],
                        "muon-with-tp", {"tp_size": 2}),
    "Muon with offload": Case(TINY_MOE, 2, [f"{S}shard_optimizer=true", f"{S}optimizer_options={{offload: true}}", "--model.optimizer=muon"],
                              "muon-offload"),
}  # fmt: skip

# keys of sentences no command line reaches, and why
UNREACHABLE = {
    "world-below-1": "Lightning refuses devices=0 before any layout exists",
}


def _refusal(case: Case, capsys) -> str:
    """The one `mula: error:` line the command line of `case` prints (exit status 2)."""
    args = ["fit", "-c", case.recipe, "--trainer.accelerator=cpu", f"--trainer.devices={case.devices}",
            "--trainer.strategy=strategies.XPUMoEStrategy", *case.args]  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        main(args)
    assert stopped.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mula: error: ")]
    assert len(lines) == 1, lines
    return lines[0]


def check_printed(name: str, case: Case, line: str) -> None:
    """`line` is the sentence of `case.key` rendered with `case.values`, alone and short."""
    assert len(line) < 200 and "Union" not in line and "Namespace(" not in line, line
    sentence = re.sub(r"^mula: error: (\w+: )?", "", line)
    expected = SENTENCES[case.key].format(**case.values)
    assert sentence == expected, f"{name}: printed {sentence!r}, its sentence ({case.key}) is {expected!r}"


_PRINTED: dict[str, str] = {}  # case -> its line, as the parametrized test saw it


def _printed(name: str, tmp_path: Path, monkeypatch, capsys) -> str:
    if name not in _PRINTED:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.delenv("MULA_TRACEBACK", raising=False)
        monkeypatch.setattr("sys.argv", ["mula"])
        _PRINTED[name] = _refusal(CASES[name], capsys)
        assert not list(tmp_path.iterdir()), "a refusal must come before anything is written"
    return _PRINTED[name]


@pytest.mark.parametrize("name", list(CASES))
def test_a_layout_refusal_prints_its_sentence_alone(name, tmp_path, monkeypatch, capsys) -> None:
    check_printed(name, CASES[name], _printed(name, tmp_path, monkeypatch, capsys))


def test_a_case_expecting_another_sentence_fails(tmp_path, monkeypatch, capsys) -> None:
    """The check can fail: a case whose key is another case's, or whose values are another case's of
    the same key, does not pass on the line its command line prints."""
    for name, other in (("batch split", "ZeRO stage"), ("size below 1", "virtual stages below 1")):
        (tmp_path / name).mkdir()
        line = _printed(name, tmp_path / name, monkeypatch, capsys)
        check_printed(name, CASES[name], line)
        swapped = CASES[name]._replace(key=CASES[other].key, values=CASES[other].values)
        with pytest.raises(AssertionError, match=re.escape(f"{name}: printed")):
            check_printed(name, swapped, line)


def test_every_case_renders_its_sentence_and_every_sentence_has_a_case() -> None:
    for name, case in CASES.items():
        assert case.key in SENTENCES, f"{name}: no sentence has the key {case.key!r}"
        fields = {f for _, f, _, _ in string.Formatter().parse(SENTENCES[case.key]) if f is not None}
        assert set(case.values) == fields, (
            f"{name}: values {sorted(case.values)}, its sentence needs {sorted(fields)}"
        )
    missing = set(SENTENCES) - {case.key for case in CASES.values()} - set(UNREACHABLE)
    assert not missing, f"sentences no command line here prints: {sorted(missing)}"
    assert set(UNREACHABLE) <= set(SENTENCES), "an UNREACHABLE sentence no longer exists"


# ----- the source: where tables are, which keys are raised, no sentence written twice -----------------


def _trees(root: Path) -> dict[str, ast.Module]:
    return {p.relative_to(root).as_posix(): ast.parse(p.read_text(), str(p)) for p in layer_sources(root)}


def table_files(root: Path) -> set[str]:
    """The files of the layers that build a `Sentences` table."""
    return {
        rel
        for rel, tree in _trees(root).items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Sentences"
    }


def raised_keys(root: Path) -> dict[str, list[str]]:
    """key -> 'path:line' of each `<table>.refuse(key, ...)` in the layers (a key that is not a string
    literal is listed under '<not a literal>')."""
    out: dict[str, list[str]] = {}
    for rel, tree in _trees(root).items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "refuse"
            ):
                arg = node.args[0] if node.args else None
                literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                out.setdefault(arg.value if literal else "<not a literal>", []).append(f"{rel}:{node.lineno}")
    return out


def _template(text: str) -> str:
    """A template's text with `{}` for each field."""
    return "".join(lit + ("{}" if f is not None else "") for lit, f, _, _ in string.Formatter().parse(text))


def _raised_text(node: ast.Call) -> str | None:
    """The text of `SomethingError(<string or f-string>, ...)`, with `{}` for each formatted value."""
    name = getattr(node.func, "id", None) or getattr(node.func, "attr", None) or ""
    if not name.endswith(("Error", "Exception")) or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr):
        return "".join(p.value if isinstance(p, ast.Constant) else "{}" for p in arg.values)
    return None


# a literal stretch this long shared with a table's sentence is that sentence written again
SHARED_CHARACTERS = 50


def written_again(root: Path, sentences: dict[str, str]) -> list[str]:
    """'path:line: key' for each exception in the layers whose text is a table's sentence (with `{}` for
    the values), or shares SHARED_CHARACTERS characters of one."""
    templates = {key: _template(text) for key, text in sentences.items()}
    n = SHARED_CHARACTERS
    stretches = {key: {t[i : i + n] for i in range(len(t) - n + 1)} for key, t in templates.items()}
    found = []
    for rel, tree in _trees(root).items():
        for node in ast.walk(tree):
            text = _raised_text(node) if isinstance(node, ast.Call) else None
            if text is None:
                continue
            windows = {text[i : i + n] for i in range(len(text) - n + 1)}
            found += [
                f"{rel}:{node.lineno}: {key}"
                for key, template in templates.items()
                if text == template or not windows.isdisjoint(stretches[key])
            ]
    return found


def test_each_sentence_is_raised_from_its_table_and_written_once() -> None:
    assert table_files(ROOT) == set(TABLES), "a table of refusal sentences the cases here do not read"
    raised = raised_keys(ROOT)
    unknown = {key: where for key, where in raised.items() if key not in SENTENCES}
    assert not unknown, f"refusals under keys no table has: {unknown}"
    assert set(SENTENCES) <= set(raised), f"sentences no check raises: {sorted(set(SENTENCES) - set(raised))}"
    assert written_again(ROOT, SENTENCES) == []


def test_a_planted_table_key_or_copy_is_found(tmp_path) -> None:
    """The scans can fail: a second table, a key no table has, a sentence written out again (whole, or
    its long literal part under another beginning) are found; another sentence is not."""
    files = {
        "mula/a.py": """
            from mula.layout.sentences import Sentences
            MORE = Sentences({"x": "x."})
        """,
        "strategies/b.py": """
            def f(seq_len, cp, SENTENCES):
                if seq_len % cp:
                    raise ValueError(
                        f"The sequence length {seq_len} is not divisible by context_parallel_size={cp}; choose a "
                        "sequence length that splits into equal slices."
                    )
                raise SENTENCES.refuse("no-such-key")
        """,
        "callbacks/c.py": """
            def g(offload):
                if offload:
                    raise ValueError("Sharded Muon does not offload its state to the host (the host update is AdamW's).")
                raise RuntimeError("The sequence length is fine.")
        """,
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    assert table_files(tmp_path) == {"mula/a.py"}
    assert raised_keys(tmp_path) == {"no-such-key": ["strategies/b.py:8"]}
    assert sorted(written_again(tmp_path, SENTENCES)) == [
        "callbacks/c.py:4: muon-offload",
        "strategies/b.py:4: sequence-split",
    ]
