"""The covering array of the layout matrix (tests/layout_coverage.py `ROWS`), each row against one process.

Every row turns on several features of `mula.layout.features` at once -- two parallel dimensions of size
2 on 4 gloo ranks (one row: E = 4 on 8), an optimizer sharding, offload, a recompute setting, compile, bf16-true, a model
family's attention and routing -- and trains 4 steps of the probe's tiny MoE (tests/composition.py).
fp32 rows equal the plain model in one process (eager, nothing recomputed, torch's AdamW) by the suite's
equality rule (tests/equality.py); bf16-true rows equal one process of the same optimizer in bf16 by
bf16's rule. Under offload, every rank's host updates start during backward (speculation). The rows train in 4-rank launches of
`ROWS_PER_LAUNCH` rows each (a launch's bf16 references in one 1-rank launch), so the matrix costs a few
process starts, not one per row, and no test waits for more than a few rows; the compiled rows compile
through AOTAutograd (tests/composition.py `COMPILE_BACKEND` says why). An fp32 row whose near-tied expert choice rounding flipped (every moved choice within its
reference's near ties) trains again, it and its reference, on the next data seed (`DATA_SEEDS`); a routing
difference near ties do not explain fails at once.
"""

from __future__ import annotations

import pytest
from composition import assert_row_matches, fit_row, master_distances, skip_updates_on
from dist_helpers import lightning_env, run_distributed
from equality import first_flip
from layout_coverage import ROWS

from mula.layout.features import probe

WORLD = 4  # every row's ranks but the one with a dimension of size 4 (8 ranks)
# rows per launch: a launch trains its rows one after another, so one test's work (the first test of a
# launch waits for it) is a few rows, well inside pytest's timeout on a slow, loaded 2-core host, where
# all rows in one launch took over 600 s; the launches share one run directory (the compiled rows' cache)
ROWS_PER_LAUNCH = 3
# data seeds a row may train on: a row whose near-tied expert choice rounding flipped (in 4 steps of a few
# thousand choices, some within FLIP_MARGIN of a tie: on one host's rounding, not another's) trains again on
# the next; the last seed's flip fails the test (equality.py's rule)
DATA_SEEDS = 3


def _launches() -> list[list[int]]:
    """The rows' indexes by launch: consecutive rows of one world size, at most `ROWS_PER_LAUNCH` each."""
    out: list[list[int]] = []
    for i, row in enumerate(ROWS):
        world = probe(row).world_size
        if out and len(out[-1]) < ROWS_PER_LAUNCH and probe(ROWS[out[-1][0]]).world_size == world:
            out[-1].append(i)
        else:
            out.append([i])
    return out


LAUNCHES = _launches()
_DONE: dict[int, tuple[list[list[dict]], list[dict]]] = {}


def _train(
    rank: int, world: int, rows: tuple, root: str, reference: bool, plant: str = "", seeds: tuple = ()
) -> list[dict]:
    lightning_env(rank, world)
    for optimizer in plant.split(","):
        if optimizer:
            skip_updates_on(1, optimizer)
    seeds = seeds or (0,) * len(rows)
    return [fit_row(row, None if reference else rank, root, seed) for row, seed in zip(rows, seeds)]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    """The run directory every launch of the module trains in (one Inductor cache for the compiled rows)."""
    return str(tmp_path_factory.mktemp("rows"))


def _launch(index: int, root: str) -> tuple[list[dict], dict]:
    """Every rank's run of row `index` and its reference, from the launch that trains the rows around it
    (started by the first test that needs it)."""
    number = next(n for n, rows in enumerate(LAUNCHES) if index in rows)
    if number not in _DONE:
        rows = tuple(ROWS[i] for i in LAUNCHES[number])
        world = probe(rows[0]).world_size
        bf16 = [i for i, row in enumerate(rows) if "bf16-true" in row]
        runs = run_distributed(_train, world, rows, root, False)
        refs: dict[int, dict] = {}
        if bf16:  # one process of XPUMoEStrategy: a process group of its own
            refs = dict(zip(bf16, run_distributed(_train, 1, tuple(rows[i] for i in bf16), root, True)[0]))
        for i, row in enumerate(rows):
            if i in refs:
                continue
            refs[i] = fit_row(row, None, root)
            # a near-tied choice that rounding flipped (every moved choice within the reference's near
            # ties; any other difference fails in first_flip): the row again on the next data seed
            for seed in range(1, DATA_SEEDS):
                if not any(first_flip(r[i], refs[i], what=f"row {LAUNCHES[number][i]}") for r in runs):
                    break
                refs[i] = fit_row(row, None, root, seed)
                again = run_distributed(_train, world, (row,), root, False, "", (seed,))
                for rank_runs, rerun in zip(runs, again):
                    rank_runs[i] = rerun[0]
        _DONE[number] = (runs, [refs[i] for i in range(len(rows))])
    runs, refs = _DONE[number]
    at = LAUNCHES[number].index(index)
    return [rank_runs[at] for rank_runs in runs], refs[at]


@pytest.mark.parametrize("index", range(len(ROWS)), ids=[",".join(sorted(row)) for row in ROWS])
def test_row_matches_one_process(root, index: int) -> None:
    runs, ref = _launch(index, root)
    held: set = set()
    for rank, run in enumerate(runs):
        held |= run["params"].keys()
        assert_row_matches(run, ref, ROWS[index], f"row {index} rank {rank}")
        if (
            "offload" in ROWS[index]
        ):  # the host updates overlap backward in every layout offload composes with
            assert run["optim"]["optim/offload_speculated"] > 0, (index, rank)
    assert held == ref["params"].keys()  # the ranks (their stages) hold the whole model


def test_a_rank_that_skips_its_updates_fails_the_bf16_rows(root) -> None:
    """The bf16-true rows compare what the steps move: with data-parallel rank 1 dropping its shard's
    updates (sharded Muon's matrices and AdamW's buckets: the row's two optimizers), its parameters' fp32
    masters stand a whole move from the reference's, though its bf16 losses and weights barely change."""
    index = next(
        i for i, row in enumerate(ROWS) if {"bf16-true", "Muon"} <= row and probe(row).dp_size == WORLD
    )
    _, ref = _launch(index, root)
    planted = run_distributed(_train, WORLD, (ROWS[index],), root, False, "adamw,muon")
    with pytest.raises(AssertionError, match="fp32 masters"):
        assert_row_matches(planted[0][0], ref, ROWS[index], "planted")
    worst = master_distances(planted[0][0], ref)
    matrices = {n for n in worst if n.endswith("proj.weight") or ".experts." in n}
    assert max(worst[n] for n in matrices) > 0.9  # Muon's updates dropped
    assert max(v for n, v in worst.items() if n not in matrices) > 0.9  # AdamW's
