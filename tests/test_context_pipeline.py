"""Context parallelism across pipeline stages (C = 2 x P = 2 on 4 gloo ranks) against one process.

Rank order (docs/context-parallel.md): CP inside the stage, so ranks [0, 1] hold stage 0 and [2, 3]
stage 1, CP groups [0, 1] and [2, 3], pipeline groups [0, 2] and [1, 3]: CP rank c of stage 0 sends
its slice of every sequence's hidden state to CP rank c of stage 1. The harness of
tests/test_context_parallel.py (sequences of 1,024 tokens, fp32, 6 steps with global-norm clipping,
4 micro-batches per step on the one data-parallel rank): the tiny MoE (a dense block on stage 0, an
MoE block with a shared expert and the router-bias update on stage 1) with the sharded optimizer, and
the tiny dense model (GQA, QK-norm) with torch's AdamW. Every logged loss (total; aux and z), every
global gradient norm within 1e-5 (relative), the step's expert counts equal, every parameter of each
stage within 1e-4; the stages together hold the whole model. Validation through the stages (each CP
rank's slice) gives one process's val/loss. The planner's per-rank bytes of this layout equal those
of one measured step.
"""

from __future__ import annotations

import torch
from dist_helpers import lightning_env, run_distributed
from test_context_parallel import GQA, MICRO, MOE, SEQ, STEPS, WORLD, _close, _fit
from test_pipeline import _Batches  # a loader of fixed batches

from strategies import XPUMoEStrategy

# key -> (preset, overrides, sharded optimizer)
RUNS = {
    "moe": ("mula-tiny-moe", MOE, True),
    "dense": ("mula-tiny-dense", GQA, False),
}
VAL = 2  # validation batches of MICRO sequences


def _val_batches() -> list[torch.Tensor]:
    return [
        torch.randint(0, 256, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(7 + k))
        for k in range(VAL)
    ]


def _validate(trainer) -> float:
    trainer.validate(trainer.lightning_module, _Batches(_val_batches()), verbose=False)
    return float(trainer.callback_metrics["val/loss"])


def _run(rank: int, world: int) -> dict:
    lightning_env(rank, world)
    out = {}
    for key, (preset, overrides, shard) in RUNS.items():
        strategy = XPUMoEStrategy(context_parallel_size=2, pipeline_parallel_size=2, shard_optimizer=shard)
        run = _fit(preset, overrides, strategy, 0, 1, keep_trainer=True)
        topo = strategy.topology
        assert (topo.cp_rank, topo.pp_rank, strategy.data_parallel_size) == (rank % 2, rank // 2, 1)
        run["val"] = _validate(run.pop("trainer"))
        out[key] = run
    return out


def test_context_parallel_stages_match_single_process() -> None:
    """Losses (logged and per step; aux and z), gradient norms, expert counts, val/loss and each stage's
    parameters equal one process's on the same global batches."""
    refs = {}
    for key, (preset, overrides, _) in RUNS.items():
        ref = _fit(preset, overrides, None, keep_trainer=True)
        ref["val"] = _validate(ref.pop("trainer"))
        refs[key] = ref
    out = run_distributed(_run, WORLD)
    for key, ref in refs.items():
        assert len(ref["losses"]) == STEPS
        held: set = set()
        for rank_out in out:
            run = rank_out[key]
            for what in ("losses", "norms", "aux", "z", "logged_loss"):
                _close(run[what], ref[what], 1e-5, f"{key} {what}")
            _close([run["val"]], [ref["val"]], 1e-5, f"{key} val/loss")
            for mine, theirs in zip(run["counts"], ref["counts"], strict=True):
                assert torch.equal(mine, theirs)
            held |= run["params"].keys()
            for name, value in run["params"].items():
                torch.testing.assert_close(value, ref["params"][name], rtol=0, atol=1e-4, msg=name)
        assert held == ref["params"].keys()
