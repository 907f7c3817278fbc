"""Multi-token prediction (mula.model.mtp) under XPUMoEStrategy, 1 process vs 4 gloo ranks: a tiny
DeepSeek-V3 -- the layout probe's model (tests/composition.py) with MLA, sigmoid group-limited routing
with the balancing bias, a dense first block, a shared expert -- with one MTP module (an MoE block)
trains as one process at E = 2 (DP = 4), C = 2 (DP = 2), C = 2 x E = 2 with the sharded optimizer
(ZeRO-1) and T = 2 x E = 2 without sequence parallelism (the covering array's rows take it with SP), by
the suite's equality rule (tests/equality.py: step losses, the MTP term included, and
gradient norms, expert choices, then every weight). Pipeline stages refuse MTP (mula.layout.rules).

Under C each rank holds a slice of every depth's shifted ids and targets, and its MTP cross-entropy is
scaled to its slice's share of the batch's real targets (the last slice holds the padded ones): each rank
taking the mean over its own real targets instead must break C = 2's equality.
"""

from __future__ import annotations

import pytest
from composition import assert_row_matches, fit_row
from dist_helpers import lightning_env, run_distributed

DEEPSEEK = {"MLA", "DeepSeek-routing", "dense-first-blocks", "MTP"}
SHARED = {"num_shared_experts": 1, "shared_expert_intermediate_size": 16}  # the probe's model has none
RUNS = {"E2": {"E"}, "C2": {"C"}, "C2xE2-ZeRO-1": {"C", "E", "ZeRO-1"}, "T2xE2": {"T", "E"}}


def _plant_local_mean() -> None:
    """The tempting bug: each CP rank's MTP cross-entropy the mean over its own real targets."""
    import torch.nn.functional as F

    import mula.training.module as module
    from mula.model.mtp import IGNORE_INDEX

    def local_mean(logits, targets, depth, seq_len, shards):
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    module.mtp_cross_entropy = local_mean


def _run(rank: int, world: int, root: str) -> dict:
    lightning_env(rank, world)
    out = {key: fit_row(DEEPSEEK | dims, rank, root, overrides=SHARED) for key, dims in RUNS.items()}
    _plant_local_mean()
    out["planted"] = fit_row(DEEPSEEK | RUNS["C2"], rank, root, overrides=SHARED)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, list[dict]]:
    root = str(tmp_path_factory.mktemp("mtp"))
    # every run's reference: the plain model in one process on the same global batches (fit_row's)
    ref = fit_row(DEEPSEEK | RUNS["E2"], None, root, overrides=SHARED)
    return ref, run_distributed(_run, 4, root)


@pytest.mark.parametrize("key", list(RUNS))
def test_mtp_trains_as_one_process(runs, key: str) -> None:
    ref, out = runs
    assert any(n.startswith("model.mtp.0.") for n in ref["params"]) and any(
        ".shared_experts." in n for n in ref["params"]
    )
    for rank, rank_out in enumerate(out):
        assert rank_out[key]["params"].keys() == ref["params"].keys()
        assert_row_matches(rank_out[key], ref, DEEPSEEK | RUNS[key], f"{key} rank {rank}")


def test_a_local_mean_under_context_parallelism_breaks_equality(runs) -> None:
    ref, out = runs
    with pytest.raises(AssertionError):
        assert_row_matches(out[0]["planted"], ref, DEEPSEEK | RUNS["C2"], "planted")
