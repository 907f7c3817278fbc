"""The covering array of the layout matrix (tests/layout_coverage.py `ROWS`), each row against one process.

Every row turns on several features of `mula.layout.features` at once -- two parallel dimensions of size
2 on 4 gloo ranks, an optimizer sharding, offload, a recompute setting, compile, bf16-true, a model
family's attention and routing -- and trains 4 steps of the probe's tiny MoE (tests/composition.py).
fp32 rows equal the plain model in one process (eager, nothing recomputed, torch's AdamW) by the suite's
equality rule (tests/equality.py); bf16-true rows equal one process of the same optimizer in bf16 by
bf16's rule. Under offload, every rank's host updates start during backward (speculation). All rows train in one 4-rank launch (and the bf16 references in one 1-rank launch), so the
matrix costs one process start, not one per row; the compiled rows share one Inductor cache.
"""

from __future__ import annotations

import tempfile

import pytest
from composition import assert_row_matches, fit_row
from dist_helpers import lightning_env, run_distributed
from layout_coverage import ROWS

from mula.layout.features import probe

WORLD = 4


def _train(rank: int, world: int, rows: tuple, root: str, reference: bool) -> list[dict]:
    lightning_env(rank, world)
    return [fit_row(row, None if reference else rank, root) for row in rows]


@pytest.fixture(scope="module")
def results() -> tuple[list[list[dict]], dict[int, dict]]:
    """Every rank's run of every row, and each row's reference."""
    assert {probe(row).world_size for row in ROWS} == {WORLD}
    bf16 = [i for i, row in enumerate(ROWS) if "bf16-true" in row]
    with tempfile.TemporaryDirectory() as root:
        runs = run_distributed(_train, WORLD, ROWS, root, False)
        refs = dict(zip(bf16, run_distributed(_train, 1, tuple(ROWS[i] for i in bf16), root, True)[0]))
        for i, row in enumerate(ROWS):
            if i not in refs:
                refs[i] = fit_row(row, None, root)
    return runs, refs


@pytest.mark.parametrize("index", range(len(ROWS)), ids=[",".join(sorted(row)) for row in ROWS])
def test_row_matches_one_process(results, index: int) -> None:
    runs, refs = results
    held: set = set()
    for rank, rank_runs in enumerate(runs):
        run = rank_runs[index]
        held |= run["params"].keys()
        assert_row_matches(run, refs[index], ROWS[index], f"row {index} rank {rank}")
        if (
            "offload" in ROWS[index]
        ):  # the host updates overlap backward in every layout offload composes with
            assert run["optim"]["optim/offload_speculated"] > 0, (index, rank)
    assert held == refs[index]["params"].keys()  # the ranks (their stages) hold the whole model
