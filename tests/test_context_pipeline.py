"""Context parallelism across pipeline stages (C = 2 x P = 2 on 4 gloo ranks) against one process.

Rank order (docs/context-parallel.md): CP inside the stage, so ranks [0, 1] hold stage 0 and [2, 3]
stage 1, CP groups [0, 1] and [2, 3], pipeline groups [0, 2] and [1, 3]: CP rank c of stage 0 sends
its slice of every sequence's hidden state to CP rank c of stage 1. The harness of
tests/test_context_parallel.py (sequences of 1,024 tokens, fp32, 6 steps with global-norm clipping,
4 micro-batches per step on the one data-parallel rank): the tiny MoE (a dense block on stage 0, an
MoE block with a shared expert and the router-bias update on stage 1) with the sharded optimizer, and
the tiny dense model (GQA, QK-norm) with torch's AdamW. Compared by the suite's equality rule
(tests/equality.py): the step's expert counts, every logged loss (total; aux and z) and every global
gradient norm, then every parameter and router bias of each stage after the last step; the stages
together hold the whole model. Validation through the stages (each CP rank's slice) of the trained
model gives one process's val/loss. The planner's per-rank bytes of this layout equal those of one
measured step.
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import lightning_env, run_distributed
from equality import LOSS_RTOL, assert_same_training, assert_same_weights, seeded
from test_context_parallel import GQA, MICRO, MOE, SEQ, SERIES, STEPS, WORLD, _fit
from test_pipeline import _Batches  # a loader of fixed batches
from test_plan_measured_pipeline import assert_stage_bytes, measure_step
from test_plan_volumes_tp import assert_planned

from strategies import XPUMoEStrategy

# key -> (preset, overrides, sharded optimizer)
RUNS = {
    "moe": ("mula-tiny-moe", MOE, True),
    "dense": ("mula-tiny-dense", GQA, False),
}
VAL = 2  # validation batches of MICRO sequences


def _val_batches() -> list[torch.Tensor]:
    return [
        torch.randint(0, 256, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(seeded(7 + k)))
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
        assert (topo.rank("cp"), topo.rank("pp"), strategy.data_parallel_size) == (rank % 2, rank // 2, 1)
        run["val"] = _validate(run.pop("trainer"))
        out[key] = run
    return out


def test_context_parallel_stages_match_single_process() -> None:
    """Expert counts, losses (logged and per step; aux and z) and gradient norms of every step, then
    val/loss and each stage's parameters and router bias, equal one process's on the same global batches
    (the equality rule, tests/equality.py)."""
    refs = {}
    for key, (preset, overrides, _) in RUNS.items():
        ref = _fit(preset, overrides, None, keep_trainer=True)
        ref["val"] = _validate(ref.pop("trainer"))
        refs[key] = ref
    out = run_distributed(_run, WORLD)
    for key, ref in refs.items():
        assert len(ref["losses"]) == STEPS
        held: set = set()
        for rank, rank_out in enumerate(out):
            run, what = rank_out[key], f"{key} rank {rank}"
            assert len(run["counts"]) == (STEPS if key == "moe" else 0)
            held |= run["params"].keys()
            assert_same_training(run, ref, series=SERIES, what=what)  # the trained models then agree
            torch.testing.assert_close(
                run["val"], ref["val"], rtol=LOSS_RTOL, atol=0, msg=lambda m, w=what: f"{w} val/loss: {m}"
            )
            assert_same_weights(run["params"], ref["params"], what=what)
        assert held == ref["params"].keys()


# the planner against one measured step (the harness of tests/test_tensor_pipeline.py): 4 MoE blocks,
# two per stage, so that activations dominate; C = 2 halves every per-token term
PLAN_MOE = {"vocab_size": 512, "num_layers": 4, "max_position_embeddings": 512}
PLAN_B, PLAN_SEQ, PLAN_MICROS = 2, 256, 4
PLAN_LAYOUTS = (True, False)  # shard_optimizer


def _measure(rank: int, world: int) -> list[dict]:
    from mula.bench.collectives import CollectiveSteps

    lightning_env(rank, world)
    out = []
    for shard in PLAN_LAYOUTS:
        strategy = XPUMoEStrategy(context_parallel_size=2, pipeline_parallel_size=2, shard_optimizer=shard)
        strategy.pipeline_microbatches = PLAN_MICROS  # what MulaDataModule sets
        gen = torch.Generator().manual_seed(0)  # one data-parallel rank: every rank reads the same
        batch = torch.randint(0, PLAN_MOE["vocab_size"], (PLAN_MICROS * PLAN_B, PLAN_SEQ + 1), generator=gen)
        # step 2 counted (a steady step: the first sends its stages' one-time messages), step 3 logs: the
        # counted step carries no logging collectives
        counted = CollectiveSteps([2])
        logged = measure_step(world, strategy, "mula-tiny-moe", PLAN_MOE, batch, [counted], steps=3)
        out.append({**logged, "stage": strategy.topology.rank("pp"), "collectives": counted.counts[2]})
    return out


def test_the_plan_of_each_stage_matches_measured_bytes() -> None:
    """`mula plan` of a C = 2 x P = 2 layout: each rank's parameter, gradient and optimizer bytes equal
    what it holds after one real step, activations within 10 % (the stage's 1/C of every sequence); the
    bytes and calls of every kind of collective a stage's step issues equal the plan's
    (`mula.plan.collective_kinds.planned_collectives`, counted by `mula bench`'s meter)."""

    from mula.model.config import resolve_config
    from mula.plan import Layout
    from mula.plan.collective_kinds import planned_collectives
    from mula.plan.memory import plan_stage

    config = resolve_config("mula-tiny-moe", PLAN_MOE)
    measured = run_distributed(_measure, WORLD)
    for index, shard in enumerate(PLAN_LAYOUTS):
        layout = Layout(
            world_size=WORLD, cp_size=2, pp_size=2, micro_batch=PLAN_B, seq_len=PLAN_SEQ,
            micro_batches=PLAN_MICROS, shard_optimizer=shard, collectives="rooted",
        )  # fmt: skip
        layout.parallel.validate(config)
        planned = planned_collectives(config, layout)
        for rank, logged in enumerate(measured):
            row = logged[index]
            assert row["stage"] == rank // 2  # CP inside the stage: ranks [0, 1] hold stage 0
            plan = plan_stage(config, layout, row["stage"])
            where = f"shard={shard} rank {rank}"
            assert_stage_bytes(plan, row, shard, where)
            # not vacuous: the plan of the whole sequence per rank misses the activations
            whole = plan_stage(config, layout.replace(cp_size=1), row["stage"]).activations
            assert whole != pytest.approx(row["mem/activation_bytes"], rel=0.10), where
            assert_planned(row["collectives"], planned[row["stage"]], where)
            assert row["collectives"]["sent"]["send_recv"] > 0, where
