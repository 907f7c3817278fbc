"""Which equality runs of the suite cover which combinations of layout features (`mula.layout.features`).

`ROWS` is a covering array: each row turns on several features at once and is trained on 4 gloo ranks
against one process by tests/test_composition.py (the run is `mula.layout.features.probe(row)`, so a
row is exactly what it trains). `DECLARED` names the other tests whose runs cover combinations the
4-rank rows cannot hold (three parallel dimensions need 8 or 16 ranks), with the features they run.

A combination is covered by a row or declared run holding all of its features, compared by the
strongest rule its features allow: a combination with bf16-true by a bf16 row (bf16's rounding,
tests/composition.py), every other by an fp32 run (the suite's equality rule, tests/equality.py).
tests/test_layouts.py fails when an accepted combination is not covered, and docs/layouts.md is
generated from this file and the registry (scripts/layouts-doc).
"""

from __future__ import annotations

import itertools

from mula.layout.features import PIPELINES, Row, closure, matrix, probe

PARTS = ("recompute-moe", "recompute-attention", "recompute-norms")
# a DeepSeek-V3-like model under E and SP with the most memory savings: one fp32 row and one bf16-true row
DEEPSEEK_E_SP = {
    "E", "SP", "ZeRO-2", "offload", "MLA", "DeepSeek-routing", "dense-first-blocks", "recompute-full", "MTP",
}  # fmt: skip
ROWS: tuple[frozenset[str], ...] = tuple(
    closure(row)
    for row in (
        # fp32, eager
        DEEPSEEK_E_SP,
        {"C", "P", "ZeRO-1", "offload", "QK-norm-per-head", "GQA", *PARTS},
        {"P-interleaved", "SP", "ZeRO-1", "MLA", "DeepSeek-routing", "recompute-full"},
        {"P-GPipe", "SP", "ZeRO-1", "offload", "QK-norm-per-head", "GQA", "dense-first-blocks", *PARTS},
        {"E", "C", "ZeRO-2", "MLA", "dense-first-blocks", "recompute-moe", "recompute-attention", "MTP"},
        {
            "E",
            "P-interleaved",
            "offload",
            "QK-norm-per-head",
            "GQA",
            "DeepSeek-routing",
            "dense-first-blocks",
            "recompute-attention",
        },  # fmt: skip
        {"E", "P-GPipe", "MLA", "DeepSeek-routing", "recompute-norms", "MTP"},
        {"C", "SP", "ZeRO-2", "offload", "QK-norm-per-head", "DeepSeek-routing", "recompute-norms", "MTP"},
        {"C", "P-interleaved", "MLA", "dense-first-blocks", "recompute-full", "MTP"},
        {"C", "P-GPipe", "ZeRO-1", "DeepSeek-routing", "QK-norm-per-head", "GQA", "recompute-full"},
        {"P", "SP", "MLA", "DeepSeek-routing", "recompute-moe"},
        # fp32 Muon (sharded or replicated), eager
        {"Muon", "P", "E", "ZeRO-1", "MLA", "DeepSeek-routing", "dense-first-blocks", "recompute-full"},
        {"Muon", "P-interleaved", "E", "QK-norm-per-head", *PARTS},
        {"Muon", "P-GPipe", "C", "ZeRO-1"},
        # fp32, compiled
        {"compile", "P", "C", "offload", "MLA", "DeepSeek-routing", "dense-first-blocks", "recompute-full"},
        {"compile", "P-interleaved", "E", "QK-norm-per-head", *PARTS},
        {"compile", "P-GPipe", "ZeRO-1"},
        {"compile", "Muon", "E", "ZeRO-2", "GQA", "MTP"},
        # bf16-true
        {"bf16-true", *DEEPSEEK_E_SP},
        {"bf16-true", "C", "P", "offload", "QK-norm-per-head", "GQA", *PARTS},
        {"bf16-true", "P-interleaved", "T", "ZeRO-1"},
        {"bf16-true", "P-GPipe", "E", "ZeRO-1", "compile"},
        {"bf16-true", "Muon", "ZeRO-1"},
        # offload's host updates where every shard group it writes has two ranks or more
        {"P-GPipe", "offload", "recompute-moe"},
    )
) + (
    # a dimension of size 4, on 8 ranks: 4 experts one per rank, their state sharded over EDP groups of 2
    Row({"E", "ZeRO-1", "offload", "GQA", "MTP"}, {"E": 4}, world=8),
)

# test node id -> the features of its run (every parallel dimension at size 2)
DECLARED: dict[str, frozenset[str]] = {
    "tests/test_context_tensor_pipeline.py::test_context_tensor_pipeline_with_experts_matches_single_process": (
        frozenset({"C", "T", "SP", "P", "E", "ZeRO-1"})
    ),
    # the MTP module on the last of two 1F1B stages (its P2xE2 case; the rows take the other schedules)
    "tests/test_mtp_dist.py::test_mtp_with_pipeline_stages_trains_as_one_process": (
        frozenset({"P", "E", "MTP", "MLA", "DeepSeek-routing", "dense-first-blocks"})
    ),
    # compiled blocks under T = 2 on 2 ranks (the MoE model with SP; the dense one without, in the same test)
    "tests/test_compile.py::test_compiled_tensor_parallel_matches_eager": frozenset({"compile", "T", "SP"}),
}
# the short label of each declared test in docs/layouts.md's pair table
DECLARED_LABELS = {test: label for test, label in zip(DECLARED, ("4D", "mtp", "cT"))}


SHARDED = frozenset({"ZeRO-1", "ZeRO-2", "offload"})


def groups_used(combo: frozenset[str]) -> set[str]:
    """The process groups (`mula.layout.parallel_layout.DIMS`) a combination's features work over: each
    parallel dimension its own; the sharded optimizer and offload the dense shard group ("replica") and,
    with experts, the expert shard group ("edp_cp")."""
    dims = {"E": "ep", "T": "tp", "SP": "tp", "C": "cp", **{p: "pp" for p in PIPELINES}}
    used = {dims[f] for f in combo if f in dims}
    if combo & SHARDED:
        used.add("replica")
        if "E" in combo:
            used.add("edp_cp")
    return used


def exercises(run: frozenset[str], combo: frozenset[str]) -> bool:
    """Whether `run` (a row or a declared test's features) works `combo`'s features over groups of two
    ranks or more: a sharded optimizer on a replica group of one shards nothing."""
    layout = probe(run).layout
    return all(layout.size(group) > 1 for group in groups_used(combo))


def covering_runs(combo: frozenset[str]) -> list[str]:
    """The rows (`row <i>`) and declared tests whose runs cover `combo` by the rule its features allow (a
    P schedule standing for P in a triple of parallel dimensions), each group the combination works over
    of two ranks or more (`exercises`)."""
    bf16 = "bf16-true" in combo

    def holds(run: frozenset[str]) -> bool:
        if ("bf16-true" in run) != bf16:
            return False
        held = all(f in run or (f == "P" and len(combo) == 3 and run & set(PIPELINES)) for f in combo)
        return held and exercises(run, combo)

    runs = [f"row {i}" for i, row in enumerate(ROWS) if holds(row)]
    return runs + [test for test, features in DECLARED.items() if holds(features)]


def coverage() -> dict[frozenset[str], tuple[str | None, list[str]]]:
    """Every combination of the matrix -> (the validator's refusal or None, the runs covering it)."""
    return {combo: (refused, [] if refused else covering_runs(combo)) for combo, refused in matrix().items()}


def _row_label(row: frozenset[str]) -> str:
    """A row's features, a dimension of another size than 2 written with it (`E=4`), and its ranks."""
    sizes = row.sizes if isinstance(row, Row) else {}
    names = [f"{f}={sizes[f]}" if f in sizes else f for f in sorted(row)]
    return f"{', '.join(names)} ({probe(row).world_size} ranks)"


def _run_label(run: str) -> str:
    """A short label of a covering run for the table: `r<i>` for a row, a declared test's own label
    (`DECLARED_LABELS`: `4D`, `mtp`)."""
    return f"r{run.split()[1]}" if run.startswith("row ") else DECLARED_LABELS[run]


def render_markdown() -> str:
    """docs/layouts.md: the features, the matrix of every pair (tested by which run, refused and why, or
    one setting), the triples of parallel dimensions, the refusals and the runs."""
    from mula.layout.features import FEATURES, PARALLEL, excluded

    table = coverage()
    reasons: list[str] = []
    lines = [
        "# Layouts: what composes with what",
        "",
        "Generated by `scripts/layouts-doc` from the registry of layout features (`mula/layout/features.py`)",
        "and the suite's equality runs (`tests/layout_coverage.py`); `tests/test_layouts.py` fails when this",
        "file drifts from them, when an accepted combination is covered by no run, and when a row could be",
        "removed without uncovering one. Every pair of features, and every triple of the parallel",
        "dimensions E, P, T and C, is either compared with one process by a run of the suite or refused by",
        "the validator (`mula fit` and `mula plan` stop with the sentence below). Nothing in between.",
        "",
        "A run turns a set of features into one tiny training run (`mula.layout.features.probe`: every",
        "parallel dimension named has size 2 unless the row says otherwise, on 4 ranks, 8 for the row with",
        "E = 4, or 16 for the four-dimensional test) and compares it with one process: fp32 runs by the",
        "suite's equality rule (tests/equality.py: losses and gradient norms of every step, then every",
        "weight), bf16-true runs by bf16's own rule (tests/composition.py: losses, gradient norms and the",
        "fp32 master weights). A run covers a combination only when every process group the combination",
        "works over has two ranks or more (`tests/layout_coverage.py` `groups_used`: each parallel",
        "dimension; the sharded optimizer and offload the dense shard group and, with E, the expert one).",
        "",
        "## Features",
        "",
        "| feature | what | turned on by |",
        "|---|---|---|",
    ]
    lines += [f"| {f.name} | {f.summary} | `{f.setting}` |" for f in FEATURES]
    lines += [
        "",
        "## Pairs",
        "",
        "`rN`: compared with one process by row N of the covering array (below); `4D`: by",
        "`tests/test_context_tensor_pipeline.py`; `mtp`: by `tests/test_mtp_dist.py` (MTP on the last of",
        "two pipeline stages); `no (N)`: refused, reason N below; `-`: one setting.",
        "",
        "| | " + " | ".join(f.name for f in FEATURES) + " |",
        "|---|" + "---|" * len(FEATURES),
    ]
    for a in FEATURES:
        cells = []
        for b in FEATURES:
            if a.name == b.name or excluded(a.name, b.name):
                cells.append("-")
                continue
            refused, runs = table[frozenset((a.name, b.name))]
            if refused is not None:
                if refused not in reasons:
                    reasons.append(refused)
                cells.append(f"no ({reasons.index(refused) + 1})")
            else:
                cells.append(_run_label(runs[0]))
        lines.append(f"| **{a.name}** | " + " | ".join(cells) + " |")
    lines += ["", "## Triples of parallel dimensions", ""]
    for triple in itertools.combinations(PARALLEL, 3):
        refused, runs = table[frozenset(triple)]
        verdict = (
            f"refused: {refused}"
            if refused
            else "compared with one process by " + ", ".join(f"`{run}`" for run in runs)
        )
        lines.append(f"- {' x '.join(triple)}: {verdict}")
    lines += ["", "## Refusals", ""]
    lines += [f"{i + 1}. {reason}" for i, reason in enumerate(reasons)]
    lines += ["", "## The runs", "", "| run | features |", "|---|---|"]
    lines += [f"| r{i} | {_row_label(row)} |" for i, row in enumerate(ROWS)]
    lines += [
        f"| {DECLARED_LABELS[test]}: `{test}` | {', '.join(sorted(features))} |"
        for test, features in DECLARED.items()
    ]
    return "\n".join(lines) + "\n"
