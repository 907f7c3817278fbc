"""Context parallelism with tensor parallelism (C = 2 x T = 2 on 4 gloo ranks) against one process.

Rank order (docs/context-parallel.md): TP innermost, then CP: TP groups [0, 1] and [2, 3], CP groups
[0, 2] and [1, 3]. Each TP rank computes 1/T of the heads of its CP rank's 1/C of the sequence; Ulysses
exchanges those heads over its CP group (C x T must divide the heads and KV heads). An MoE layer routes
1/T of the CP slice on each rank; its router losses are summed over TP (identity backward) and then over
CP (summed backward). The harness of tests/test_context_parallel.py (sequences of 1,024 tokens, fp32,
6 steps with global-norm clipping, 4 micro-batches per step on the one data-parallel rank): the tiny
dense model (QK-norm over all heads) with torch's AdamW, the tiny MoE (a dense first block, a shared
expert, the router-bias update) with sequence parallelism and the sharded optimizer. Compared by the
suite's equality rule (tests/equality.py): the step's expert counts, every logged loss (total; aux and
z) and every global gradient norm, then every parameter (gathered from its TP shards) and router bias
after the last step. The planner's per-rank bytes, activations and Ulysses all-to-all volumes of this
layout against one measured step.
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import lightning_env, run_distributed
from equality import assert_same_training, assert_same_weights
from test_context_parallel import DENSE, MOE, SERIES, STEPS, WORLD, _AllToAllBytes, _fit
from test_plan_measured_pipeline import assert_stage_bytes, measure_step
from test_plan_measured_tp import MOE as PLAN_TP_MOE

from mula.model.config import resolve_config
from mula.plan import Layout
from mula.plan.memory import plan_stage
from mula.plan.step_time import comm_volumes, context_parallel_sends
from strategies import XPUMoEStrategy

MOE4 = {**MOE, "num_kv_heads": 4}  # C x T = 4 splits the KV heads too
# key -> (preset, overrides, sequence parallel, sharded optimizer)
RUNS = {
    "dense": ("mula-tiny-dense", DENSE, False, False),
    "moe_sp": ("mula-tiny-moe", MOE4, True, True),
}


def _run(rank: int, world: int) -> dict:
    lightning_env(rank, world)
    out = {}
    for key, (preset, overrides, sp, shard) in RUNS.items():
        strategy = XPUMoEStrategy(
            context_parallel_size=2, tensor_parallel_size=2, sequence_parallel=sp, shard_optimizer=shard
        )
        out[key] = _fit(preset, overrides, strategy, 0, 1)
        topo = strategy.topology
        assert (topo.rank("tp"), topo.rank("cp"), strategy.data_parallel_size) == (rank % 2, rank // 2, 1)
    return out


def test_context_and_tensor_parallel_match_single_process() -> None:
    """Expert counts, losses (logged and per step; aux and z) and gradient norms of every step, then every
    parameter and router bias, on every rank (the equality rule, tests/equality.py)."""
    refs = {key: _fit(preset, overrides, None) for key, (preset, overrides, _, _) in RUNS.items()}
    out = run_distributed(_run, WORLD)
    for key, ref in refs.items():
        assert len(ref["losses"]) == STEPS
        for rank, rank_out in enumerate(out):
            run, what = rank_out[key], f"{key} rank {rank}"
            assert len(run["counts"]) == (STEPS if key == "moe_sp" else 0)
            assert run["params"].keys() == ref["params"].keys()
            assert_same_training(run, ref, series=SERIES, what=what)
            assert_same_weights(run["params"], ref["params"], what=what)


# the planner against one measured step (the harness of tests/test_plan_measured_tp.py): an MoE block
# after a dense one, 8 heads sharing 4 KV heads (grouped: Ulysses exchanges k and v before their repeat),
# so that C x T = 4 splits them
PLAN_MOE = {**PLAN_TP_MOE, "num_heads": 8, "num_kv_heads": 4, "max_position_embeddings": 512}
PLAN_B, PLAN_SEQ = 2, 256
PLAN_LAYOUTS = ((False, True), (True, False))  # (sequence parallel, sharded optimizer)


def _measure(rank: int, world: int) -> list[dict]:
    lightning_env(rank, world)
    out = []
    for sp, shard in PLAN_LAYOUTS:
        strategy = XPUMoEStrategy(
            context_parallel_size=2, tensor_parallel_size=2, sequence_parallel=sp, shard_optimizer=shard
        )
        gen = torch.Generator().manual_seed(0)  # one data-parallel rank: every rank reads the same
        batch = torch.randint(0, PLAN_MOE["vocab_size"], (PLAN_B, PLAN_SEQ + 1), generator=gen)
        with _AllToAllBytes(2) as sent:
            logged = measure_step(world, strategy, "mula-tiny-moe", PLAN_MOE, batch)
        out.append({**logged, "ulysses": (sent.bytes, sent.calls)})
    return out


def test_the_plan_of_each_rank_matches_measured_bytes() -> None:
    """`mula plan` of a C = 2 x T = 2 layout: each rank's parameter, gradient and optimizer bytes (its TP
    shards, state sharded over its W / T replicas) equal what it holds after one real step, activations
    within 10 % (1/C of the sequence, 1/T of the heads); Ulysses' all-to-all bytes and calls (each TP
    rank's heads) exactly those the step sent."""
    config = resolve_config("mula-tiny-moe", PLAN_MOE)
    measured = run_distributed(_measure, WORLD)
    for index, (sp, shard) in enumerate(PLAN_LAYOUTS):
        layout = Layout(
            world_size=WORLD, cp_size=2, tp_size=2, sequence_parallel=sp, micro_batch=PLAN_B,
            seq_len=PLAN_SEQ, micro_batches=1, shard_optimizer=shard, collectives="rooted",
        )  # fmt: skip
        layout.parallel.validate(config)
        plan = plan_stage(config, layout, 0)
        volumes = comm_volumes(config, layout)[0]
        ulysses = context_parallel_sends(config, layout, list(range(config.num_layers)))
        assert ulysses[0] == volumes.context_parallel
        for rank, logged in enumerate(measured):
            row = logged[index]
            where = f"sp={sp} shard={shard} rank {rank}"
            assert_stage_bytes(plan, row, shard, where)
            # the Ulysses all-to-alls alone (the volumes' CP calls also count the router-loss totals)
            assert row["ulysses"] == pytest.approx(ulysses, rel=1e-12), where
            # not vacuous: the plan without C misses the activations, the one without T the parameters
            whole = plan_stage(config, layout.replace(cp_size=1), 0).activations
            assert whole != pytest.approx(row["mem/activation_bytes"], rel=0.10), where
            flat = plan_stage(config, layout.replace(tp_size=1, sequence_parallel=False), 0)
            assert flat.param_tensor_bytes != row["mem/param_bytes"], where
