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
from layout_coverage import DECLARED, ROWS, coverage, exercises, render_markdown

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


def test_rows_are_accepted_runs_of_four_ranks_and_one_of_eight() -> None:
    for row in ROWS:
        assert refusal(row) is None, sorted(row)
        assert closure(row) == row
    sizes = [probe(row).world_size for row in ROWS]
    assert sizes.count(8) == 1 and set(sizes) == {4, 8}
    big = probe(ROWS[sizes.index(8)])  # a dimension of size 4, its expert state sharded over EDP groups of 2
    assert big.strategy["expert_parallel_size"] == 4 and big.layout.size("edp") == 2


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


def test_a_run_counts_only_where_the_groups_it_exercises_have_two_ranks() -> None:
    """A sharded optimizer on a shard group of one shards nothing: T x P on 4 ranks leaves every dense
    replica group one rank, E x T every expert-data-parallel group."""
    assert not exercises(closure({"T", "P", "ZeRO-1"}), frozenset({"ZeRO-1", "T"}))
    assert exercises(closure({"T", "ZeRO-1"}), frozenset({"ZeRO-1", "T"}))
    assert not exercises(closure({"E", "SP", "ZeRO-2"}), frozenset({"E", "ZeRO-2"}))
    assert exercises(closure({"E", "SP", "ZeRO-2"}), frozenset({"T", "ZeRO-2"}))
    assert not exercises(closure({"P", "C"}), frozenset({"P", "E"}))  # no E at all: ep is one rank


def test_grouped_query_attention_is_a_feature() -> None:
    run = probe({"GQA", "C"})
    assert (run.overrides["num_heads"], run.overrides["num_kv_heads"]) == (4, 2)
    assert refusal({"GQA", "C"}) is None and refusal({"GQA", "T"}) is None
    assert "key/value heads" in refusal({"GQA", "C", "T"})  # 2 KV heads over C x T = 4 ranks
    with pytest.raises(ValueError, match="no KV heads to group"):
        closure({"GQA", "MLA"})


def test_features_bring_what_they_need() -> None:
    assert closure({"SP"}) == {"SP", "T"}
    assert closure({"offload"}) == {"offload", "ZeRO-1"}
    assert closure({"offload", "ZeRO-2"}) == {"offload", "ZeRO-2"}
    run = probe({"C", "P-interleaved", "recompute-moe", "recompute-norms", "bf16-true"})
    assert run.strategy == {
        "context_parallel_size": 2, "pipeline_parallel_size": 2, "pipeline_schedule": "interleaved-1f1b",
        "pipeline_virtual_stages": 2, "shard_optimizer": True, "optimizer_options": {"zero_stage": 1},
    }  # fmt: skip
    assert closure({"bf16-true"}) == {"bf16-true", "ZeRO-1"}  # its fp32 masters are the sharded optimizer's
    assert (run.activation_checkpointing, run.precision, run.world_size) == (["moe", "norms"], "bf16-true", 4)
    assert len({f.name for f in FEATURES}) == len(FEATURES)


def test_docs_layouts_is_what_the_script_writes() -> None:
    assert (ROOT / "docs" / "layouts.md").read_text() == render_markdown()
    run = subprocess.run(
        [sys.executable, "scripts/layouts-doc", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr


def test_the_registry_refuses_what_mula_fit_refuses() -> None:
    """One validation (`mula.layout.run_check.check_run`) for the registry, `mula plan`, the strategy and
    `mula fit`: bf16 weights without fp32 masters is the sentence `mula fit` stops a DDP run with."""
    from lightning.pytorch.strategies import DDPStrategy

    from mula.layout.parallel_layout import ParallelLayout
    from mula.layout.run_check import RunSettings, check_run
    from mula.training.module import check_master_weights

    with pytest.raises(ValueError) as fit:
        check_master_weights("bf16-true", DDPStrategy())
    with pytest.raises(ValueError) as run:
        check_run(RunSettings(ParallelLayout(4), precision="bf16-true", strategy="DDPStrategy"))
    assert str(run.value) == str(fit.value) and "keeps no fp32 masters" in str(fit.value)
    assert refusal({"bf16-true", "P"}) is None  # the registry's bf16-true run has its masters
