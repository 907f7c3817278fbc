"""Four dimensions at once: context x tensor x pipeline (C = 2 x T = 2 x P = 2 on 8 gloo ranks), and with
experts (C = 2 x T = 2 x P = 2 x E = 2 on 16), against one process.

Rank order (docs/context-parallel.md), innermost first: TP, CP, EP, stage. At C = T = P = 2, ranks 0-3
hold stage 0 and 4-7 stage 1; TP groups [0, 1], [2, 3], ...; CP groups [0, 2], [1, 3], ...; pipeline
groups [0, 4], [1, 5], .... Each stage's T x C ranks split its layers by heads (TP) and its sequences by
slices (CP: Ulysses exchanges each TP rank's heads over its CP group); TP rank t of CP rank c of stage 0
sends its hidden state (its 1/T of the CP slice under sequence parallelism) to the same (c, t) of stage 1.
The harness of tests/test_context_parallel.py (sequences of 1,024 tokens, fp32, 6 steps with global-norm
clipping, 4 micro-batches per step on the one data-parallel rank): the tiny MoE (a dense block on stage 0,
an MoE block with a shared expert and the router-bias update on stage 1, 4 KV heads so that C x T splits
them) with sequence parallelism and the sharded optimizer, and the tiny dense model (QK-norm over all
heads) with torch's AdamW. Compared by the suite's equality rule (tests/equality.py): the step's expert
counts, every logged loss (total; aux and z) and gradient norm, then every parameter (gathered from its
TP shards and EP ranks) and router bias of each stage after the last step, the stages together holding
the whole model; validation through the stages of the trained MoE gives one process's val/loss. The
MoE's checkpoint of step 2 (sharded optimizer state, TP-split parameters: global tensors in DCP) resumes
at C = 2 x E = 2 and continues the one-process run by the same rule.
"""

from __future__ import annotations

import torch
from dist_helpers import lightning_env, run_distributed
from equality import LOSS_RTOL, assert_same_training, assert_same_weights
from test_context_parallel import DENSE, MOE, SERIES, STEPS, _fit
from test_context_pipeline import _validate

from strategies import XPUMoEStrategy

MOE4 = {**MOE, "num_kv_heads": 4}  # C x T = 4 splits the KV heads too
# key -> (preset, overrides, E, sequence parallel, sharded optimizer)
RUNS = {
    "moe_sp": ("mula-tiny-moe", MOE4, 1, True, True),
    "dense": ("mula-tiny-dense", DENSE, 1, False, False),
}
EXPERT_RUNS = {"moe_e2": ("mula-tiny-moe", MOE4, 2, True, True)}
RESHARDED = "moe_sp"  # its step-2 checkpoint resumes at C = 2 x E = 2


def _run(rank: int, world: int, runs: dict, root: str | None = None) -> dict:
    lightning_env(rank, world)
    out = {}
    for key, (preset, overrides, ep, sp, shard) in runs.items():
        strategy = XPUMoEStrategy(
            context_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2, expert_parallel_size=ep,
            sequence_parallel=sp, shard_optimizer=shard,
        )  # fmt: skip
        ep_rank = rank // 4 % ep  # the data-parallel index: EP ranks read different sequences
        save_dir = f"{root}/{key}" if root is not None and key == RESHARDED else None
        run = _fit(
            preset, overrides, strategy, ep_rank, ep, keep_trainer=True, world=world, save_dir=save_dir
        )
        topo = strategy.topology
        coords = (topo.rank("tp"), topo.rank("cp"), topo.rank("ep"), topo.rank("pp"))
        assert coords == (rank % 2, rank // 2 % 2, ep_rank, rank // (4 * ep)), coords
        assert (strategy.data_parallel_rank, strategy.data_parallel_size) == (ep_rank, ep)
        trainer = run.pop("trainer")
        if preset.endswith("moe"):
            run["val"] = _validate(trainer)
        out[key] = run
    return out


def _resume(rank: int, world: int, root: str) -> dict:
    """C = 2 x E = 2 (4 ranks, two data-parallel EP ranks) resumes the 4D MoE run from its step-2 checkpoint."""
    lightning_env(rank, world)
    strategy = XPUMoEStrategy(context_parallel_size=2, expert_parallel_size=2, shard_optimizer=True)
    preset, overrides, *_ = RUNS[RESHARDED]
    return _fit(
        preset, overrides, strategy, rank // 2, 2, ckpt_path=f"{root}/{RESHARDED}/epoch=0-step=2.ckpt",
        first_step=2, world=world,
    )  # fmt: skip


def _assert_match(out: list[dict], runs: dict) -> dict:
    """Every rank of every run against its one-process reference; returns the references."""
    refs = {}
    for key, (preset, overrides, *_) in runs.items():
        ref = refs[key] = _fit(preset, overrides, None, keep_trainer=True)
        trainer = ref.pop("trainer")
        if preset.endswith("moe"):
            ref["val"] = _validate(trainer)
        assert len(ref["losses"]) == STEPS
        held: set = set()
        for rank, rank_out in enumerate(out):
            run, what = rank_out[key], f"{key} rank {rank}"
            assert len(run["counts"]) == (STEPS if preset.endswith("moe") else 0)
            held |= run["params"].keys()
            assert_same_training(run, ref, series=SERIES, what=what)  # the trained models then agree
            if "val" in ref:
                torch.testing.assert_close(
                    run["val"], ref["val"], rtol=LOSS_RTOL, atol=0, msg=lambda m, w=what: f"{w} val: {m}"
                )
            assert_same_weights(run["params"], ref["params"], what=what)
        assert held == ref["params"].keys()
    return refs


def test_context_tensor_pipeline_matches_single_process_and_reshards(tmp_path) -> None:
    """C = 2 x T = 2 x P = 2: expert counts, losses and gradient norms of every step, val/loss, then each
    stage's parameters and router bias on each of its ranks (the equality rule). The MoE run's step-2
    checkpoint resumes at C = 2 x E = 2 (no T, no P; 4 ranks) and continues the one-process run."""
    refs = _assert_match(run_distributed(_run, 8, RUNS, str(tmp_path)), RUNS)
    resumed = run_distributed(_resume, 4, str(tmp_path))
    for rank, run in enumerate(resumed):
        what = f"4D -> C=2 x E=2 rank {rank}"
        assert len(run["losses"]) == STEPS - 2
        assert_same_training(run, refs[RESHARDED], first_step=2, series=SERIES, what=what)
        assert_same_weights(run["params"], refs[RESHARDED]["params"], what=what)


def test_context_tensor_pipeline_with_experts_matches_single_process() -> None:
    """C = 2 x T = 2 x P = 2 x E = 2 (16 ranks): the same, each EP rank holding half of the experts."""
    _assert_match(run_distributed(_run, 16, EXPERT_RUNS), EXPERT_RUNS)
