"""Tensor parallelism inside pipeline stages (T = 2 x P = 2 on 4 gloo ranks) against one process.

Each stage's modules are split over its own TP group (ranks [0, 1] hold stage 0, [2, 3] stage 1);
the hidden state goes from every TP rank of stage 0 to its TP peer of stage 1 -- the whole sequence
without sequence parallelism, the rank's 1/T of it with -- and the last stage's loss is
vocabulary-parallel. fp32, 6 steps with global-norm clipping, the harness of
tests/test_tensor_parallel.py: every logged loss and gradient norm within 1e-5 (relative), every
parameter (each stage's, gathered to its full tensor) within 1e-4. Dense RMS model (RMSNorm, QK-norm
over all heads, GQA) with torch's AdamW, with the sharded optimizer, and with sequence parallelism.
"""

from __future__ import annotations

from dist_helpers import lightning_env, run_distributed
from test_tensor_parallel import RMS, WORLD, _assert_matches, _fit

from strategies import XPUMoEStrategy

# (key, sequence_parallel, shard_optimizer)
RUNS = (("adamw", False, False), ("sharded", False, True), ("sp_sharded", True, True))


def _run(rank: int, world: int) -> dict:
    lightning_env(rank, world)
    out = {}
    for key, sp, shard in RUNS:
        strategy = XPUMoEStrategy(
            tensor_parallel_size=2, pipeline_parallel_size=2, sequence_parallel=sp, shard_optimizer=shard
        )
        losses, params = _fit(RMS, strategy, 0, 1)  # DP = 4 / (2 x 2) = 1: one data-parallel rank
        assert strategy.data_parallel_size == 1
        out[key] = {"losses": losses.losses, "norms": losses.norms, "params": params}
    return out


def _assert_stages_match(runs: list[dict], key: str, ref, ref_params: dict) -> None:
    """Every rank's losses and norms, and each stage's parameters on each of its TP ranks, match the
    reference; the stages together hold every parameter of the model."""
    held: set = set()
    for rank_out in runs:
        params = rank_out[key]["params"]
        held |= params.keys()
        _assert_matches(rank_out[key], ref, {n: v for n, v in ref_params.items() if n in params})
    assert held == ref_params.keys()


def test_tensor_parallel_stages_match_single_process() -> None:
    ref, ref_params = _fit(RMS, None)
    runs = run_distributed(_run, WORLD)
    for key, _, _ in RUNS:
        _assert_stages_match(runs, key, ref, ref_params)
