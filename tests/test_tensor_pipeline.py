"""Tensor parallelism inside pipeline stages (T = 2 x P = 2 on 4 gloo ranks) against one process.

Each stage's modules are split over its own TP group (ranks [0, 1] hold stage 0, [2, 3] stage 1);
the hidden state goes from every TP rank of stage 0 to its TP peer of stage 1 -- the whole sequence
without sequence parallelism, the rank's 1/T of it with -- and the last stage's loss is
vocabulary-parallel. fp32, 6 steps with global-norm clipping, the harness of
tests/test_tensor_parallel.py, compared by the suite's equality rule (tests/equality.py): every logged
loss and gradient norm (and, for the MoE model, the step's global expert counts), then every parameter
(each stage's, gathered to its full tensor; the router bias) after the last step. Dense RMS model
(RMSNorm, QK-norm over all heads, GQA) with torch's AdamW, with the sharded optimizer, and with
sequence parallelism; the MoE model of tests/test_tensor_parallel_moe.py (a dense block on stage 0,
an MoE block with a shared expert and the router-bias update on stage 1) with torch's AdamW: stage 0
holds no MoE block, yet joins the step's expert-count all-reduce (it hung before). The planner's
per-stage bytes are checked against one measured step of the dense layouts. Downstream evaluation's
forward of the trained SP model (`spread_forward`, 7 tokens padded for SP's split) gives the whole
logits on the last stage's TP ranks. Checkpoints reshard across T x P: the step-2 checkpoint of the
sharded-optimizer run resumes at T = 1 x P = 1 (DP = 4) and that run's step-4 checkpoint back at
T = 2 x P = 2; the MoE run's step-2 checkpoint resumes at P = 2 without T (DP = 2); each continues the
one-process run by the same rule.
"""

from __future__ import annotations

import torch
from dist_helpers import lightning_env, run_distributed
from equality import assert_compared_through
from test_plan_measured_pipeline import assert_stage_bytes, measure_step
from test_tensor_parallel import RMS, STEPS, WORLD, _assert_matches, _fit
from test_tensor_parallel_moe import MOE  # a dense block, then an MoE block with a shared expert

from mula.model.config import resolve_config
from mula.model.transformer import Mula
from strategies import XPUMoEStrategy

# (key, model, sequence_parallel, shard_optimizer); MOE: a dense block (stage 0), an MoE block (stage 1)
RUNS = (
    ("adamw", RMS, False, False),
    ("sharded", RMS, False, True),
    ("sp_sharded", RMS, True, True),
    ("moe", MOE, False, False),
)
# resumes, in order: (key, the run of RUNS it continues, the run whose checkpoint it loads, that checkpoint's
# step, T, P). The sharded-optimizer run out of T = 2 x P = 2 into no T and no P (DP = 4: the optimizer's
# state over 4 ranks instead of 1) and from there back; the MoE run's stages kept without T (DP = 2).
RESUMES = (
    ("sharded_t1p1", "sharded", "sharded", 2, 1, 1),
    ("sharded_back", "sharded", "sharded_t1p1", 4, 2, 2),
    ("moe_p2", "moe", "moe", 2, 1, 2),
)
SAVED = {source for _, _, source, *_ in RESUMES}
SETTINGS = {key: (model, shard) for key, model, _, shard in RUNS}  # what a resume keeps of its run


def _run(rank: int, world: int, root: str) -> dict:
    lightning_env(rank, world)
    out = {}
    for key, model, sp, shard in RUNS:
        strategy = XPUMoEStrategy(
            tensor_parallel_size=2, pipeline_parallel_size=2, sequence_parallel=sp, shard_optimizer=shard
        )
        save_dir = f"{root}/{key}" if key in SAVED else None
        losses, params = _fit(model, strategy, 0, 1, save_dir=save_dir)  # DP = 4 / (2 x 2) = 1
        assert strategy.data_parallel_size == 1
        out[key] = {**losses.record(), "params": params}
        if key == "sp_sharded":  # downstream evaluation's forward, 7 tokens: padded for SP's split
            with torch.no_grad():
                out["logits"] = strategy.spread_forward().logits(EVAL_TOKENS)
    for key, base, source, step, tp, pp in RESUMES:
        model, shard = SETTINGS[base]
        strategy = XPUMoEStrategy(tensor_parallel_size=tp, pipeline_parallel_size=pp, shard_optimizer=shard)
        dp_rank, dp_size = rank // (tp * pp), world // (tp * pp)  # data parallelism outermost
        ckpt = f"{root}/{source}/epoch=0-step={step}.ckpt"
        save_dir = f"{root}/{key}" if key in SAVED else None
        losses, params = _fit(
            model, strategy, dp_rank, dp_size, save_dir=save_dir, ckpt_path=ckpt, first_step=step
        )
        assert (strategy.data_parallel_rank, strategy.data_parallel_size) == (dp_rank, dp_size)
        out[key] = {**losses.record(), "params": params}
    return out


EVAL_TOKENS = torch.arange(14).reshape(2, 7)


def _assert_stages_match(runs: list[dict], key: str, ref, ref_params: dict, first_step: int = 0) -> None:
    """Every rank's losses and norms (and expert counts), and each stage's parameters on each of its TP
    ranks, match the reference (from its step `first_step` on) by the equality rule; the stages together
    hold every parameter of the model."""
    held: set = set()
    for rank, rank_out in enumerate(runs):
        params = rank_out[key]["params"]
        held |= params.keys()
        mine = {n: v for n, v in ref_params.items() if n in params}
        _assert_matches(rank_out[key], ref, mine, what=f"{key} rank {rank}", first_step=first_step)
    assert held == ref_params.keys()


def test_tensor_parallel_stages_match_single_process_and_reshard(tmp_path) -> None:
    refs = {id(model): _fit(model, None) for model in (RMS, MOE)}
    runs = run_distributed(_run, WORLD, str(tmp_path))
    # the MoE runs' routing is recorded (every rank: the global counts), so that the rule can compare it
    assert len(refs[id(MOE)][0].record()["near_ties"]) == STEPS
    assert all(len(r["moe"]["counts"]) == STEPS for r in runs)
    for key, model, _, _ in RUNS:
        _assert_stages_match(runs, key, *refs[id(model)])
    # checkpoints (global tensors in DCP) resumed at another layout continue the one-process run, if the run
    # that saved one followed the reference to it (equality.py: top-k flips; a dense model always does)
    first = {key: 0 for key, *_ in RUNS}
    for key, base, source, step, _, _ in RESUMES:
        first[key] = step
        ref = refs[id(SETTINGS[base][0])]
        assert all(len(r[key]["losses"]) == STEPS - step for r in runs)
        assert_compared_through(
            runs[0][source], ref[0].record(), step - first[source], first[source], f"{source} saving"
        )
        _assert_stages_match(runs, key, *ref, first_step=step)
    assert runs[0]["logits"] is None and runs[1]["logits"] is None
    # the trained SP model's logits, whole, on the last stage's TP ranks (2, 3)
    whole = Mula(resolve_config("mula-tiny-dense", RMS))
    whole.load_state_dict({n.removeprefix("model."): v for n, v in refs[id(RMS)][1].items()})
    expected = whole(EVAL_TOKENS).logits.detach()
    for rank in (2, 3):
        torch.testing.assert_close(runs[rank]["logits"], expected, rtol=0, atol=1e-4)


# the planner against one measured step: a larger RMS model, so activations dominate the per-step noise
PLAN_RMS = dict(
    vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
    max_position_embeddings=256, norm="rmsnorm", qk_norm=True,
)  # fmt: skip
PLAN_B, PLAN_SEQ, PLAN_MICROS = 2, 128, 4
# (sequence_parallel, shard_optimizer)
PLAN_LAYOUTS = ((False, True), (True, True), (False, False))


def _measure(rank: int, world: int) -> list[dict]:
    lightning_env(rank, world)
    out = []
    for sp, shard in PLAN_LAYOUTS:
        strategy = XPUMoEStrategy(
            tensor_parallel_size=2, pipeline_parallel_size=2, sequence_parallel=sp, shard_optimizer=shard
        )
        strategy.pipeline_microbatches = PLAN_MICROS  # what MulaDataModule sets
        gen = torch.Generator().manual_seed(0)  # one data-parallel rank: every rank reads the same
        batch = torch.randint(0, PLAN_RMS["vocab_size"], (PLAN_MICROS * PLAN_B, PLAN_SEQ + 1), generator=gen)
        logged = measure_step(world, strategy, "mula-tiny-dense", PLAN_RMS, batch)
        out.append({**logged, "stage": strategy.topology.rank("pp")})
    return out


def test_the_plan_of_each_stage_matches_measured_bytes() -> None:
    """`mula plan` of a T = 2 x P = 2 layout: each rank's parameter, gradient and optimizer bytes equal
    what it holds after one real step (its stage's TP shards), activations within 10 %."""
    from mula.model.config import resolve_config
    from mula.plan import Layout
    from mula.plan.memory import plan_stage

    config = resolve_config("mula-tiny-dense", PLAN_RMS)
    measured = run_distributed(_measure, WORLD)
    for index, (sp, shard) in enumerate(PLAN_LAYOUTS):
        layout = Layout(
            world_size=WORLD, tp_size=2, pp_size=2, sequence_parallel=sp, micro_batch=PLAN_B,
            seq_len=PLAN_SEQ, micro_batches=PLAN_MICROS, shard_optimizer=shard, collectives="rooted",
        )  # fmt: skip
        layout.parallel.validate(config)
        for rank, logged in enumerate(measured):
            row = logged[index]
            assert row["stage"] == rank // 2  # TP innermost: ranks [0, 1] hold stage 0
            plan = plan_stage(config, layout, row["stage"])
            where = f"sp={sp} shard={shard} rank {rank}"
            assert_stage_bytes(plan, row, shard, where)
            # not vacuous: the stage's plan without T misses the shards it holds
            flat = plan_stage(config, layout.replace(tp_size=1, sequence_parallel=False), row["stage"])
            assert flat.param_tensor_bytes != row["mem/param_bytes"], where
        assert measured[0][index]["mem/param_bytes"] != measured[2][index]["mem/param_bytes"]
