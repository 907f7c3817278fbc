"""The registry of layout features (`mula.layout.features`), its matrix, and the suite's coverage of it.

Every pair of features and every triple of parallel dimensions the validator accepts must be compared
with one process by a run of the suite (tests/layout_coverage.py: the covering array's rows, trained by
tests/test_composition.py, and the declared 4D test), or refused with one sentence. Each row must cover
a combination no other run covers, so removing any one of them fails here; docs/layouts.md is what
scripts/layouts-doc writes.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from layout_coverage import DECLARED, ROWS, coverage, render_markdown

from mula.layout.features import FEATURES, closure, combinations, probe, refusal

ROOT = Path(__file__).resolve().parents[1]


def test_every_accepted_combination_is_compared_with_one_process() -> None:
    table = coverage()
    uncovered = [sorted(combo) for combo, (refused, runs) in table.items() if refused is None and not runs]
    assert uncovered == []
    # not vacuous: the matrix holds every pair and triple, most of them accepted
    assert len(table) == len(combinations()) > 150
    assert sum(refused is None for refused, _ in table.values()) > 150


@pytest.mark.parametrize("index", range(len(ROWS)))
def test_removing_any_row_uncovers_a_combination(index: int, monkeypatch) -> None:
    """Each row is needed: without it some accepted combination is covered by no run (the CI time the
    matrix costs buys coverage, and a row deleted from the suite is caught)."""
    import layout_coverage

    monkeypatch.setattr(layout_coverage, "ROWS", ROWS[:index] + ROWS[index + 1 :])
    table = layout_coverage.coverage()
    assert any(refused is None and not runs for refused, runs in table.values())


def test_rows_are_accepted_runs_of_four_ranks() -> None:
    for row in ROWS:
        assert refusal(row) is None, sorted(row)
        assert closure(row) == row
        assert probe(row).world_size == 4


@pytest.mark.parametrize("test", sorted(DECLARED))
def test_declared_runs_exist(test: str) -> None:
    """A declared test is a test of the suite (its file and function), and its features are accepted."""
    path, name = test.split("::")
    module = importlib.import_module(Path(path).stem)
    assert callable(getattr(module, name)), test
    assert refusal(DECLARED[test]) is None


def test_refusals_are_one_sentence() -> None:
    for combo, (refused, _) in coverage().items():
        if refused is not None:
            assert refused.endswith(".") and "\n" not in refused, (sorted(combo), refused)


@pytest.mark.parametrize(
    ("features", "needle"),
    [
        ({"X"}, "Unknown layout feature(s) ['X']"),
        ({"P", "P-GPipe"}, "P and P-GPipe are one setting (P); choose one."),
        ({"recompute-full", "recompute-moe"}, "recompute-full recomputes every part already"),
    ],
)
def test_a_feature_set_that_is_not_one_run_is_one_sentence(features: set, needle: str) -> None:
    with pytest.raises(ValueError, match=__import__("re").escape(needle)):
        closure(features)


def test_features_bring_what_they_need() -> None:
    assert closure({"SP"}) == {"SP", "T"}
    assert closure({"offload"}) == {"offload", "ZeRO-1"}
    assert closure({"offload", "ZeRO-2"}) == {"offload", "ZeRO-2"}
    run = probe({"C", "P-interleaved", "recompute-moe", "recompute-norms", "bf16-true"})
    assert run.strategy == {
        "context_parallel_size": 2, "pipeline_parallel_size": 2, "pipeline_schedule": "interleaved-1f1b",
        "pipeline_virtual_stages": 2, "shard_optimizer": False,
    }  # fmt: skip
    assert (run.activation_checkpointing, run.precision, run.world_size) == (["moe", "norms"], "bf16-true", 4)
    assert len({f.name for f in FEATURES}) == len(FEATURES)


def test_docs_layouts_is_what_the_script_writes() -> None:
    assert (ROOT / "docs" / "layouts.md").read_text() == render_markdown()
    run = subprocess.run(
        [sys.executable, "scripts/layouts-doc", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
