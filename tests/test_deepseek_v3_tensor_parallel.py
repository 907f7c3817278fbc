"""DeepSeek-V3 (multi-head latent attention) under tensor parallelism, 1 process vs 4 gloo ranks.

MLA is split as Megatron and torchtitan split it (`strategies.tensor_parallel._split_latent_attention`):
the low-rank down projections and the latent norms replicated, the up projections column-parallel by
heads, `o_proj` row-parallel; backward all-reduces the latents' and the shared RoPE key's gradients, so
every replicated weight's gradient is complete on each rank.

Reference: one process, the tiny DeepSeek-V3 preset (MLA with a q latent, a dense first block, a shared
expert, sigmoid group-limited routing with the balancing bias) at the harness's vocabulary, the harness
of tests/test_qwen3_tensor_parallel.py (6 steps, fp32, global-norm clipping) at tests/test_deepseek_v3_dist.py's
lr of 1e-3 (this model's own training amplifies rounding at 1e-2). Runs on W = 4: T = 2 x E = 2 (DP = 2)
with torch's AdamW, and T = 2 with sequence parallelism and the sharded optimizer (E = 1, DP = 2),
compared by the equality rule (tests/equality.py); dropping the TP sum of the shared RoPE key's gradient
must break it. The sharded run's per-rank bytes equal `mula plan`'s and each run's DTensor collective
bytes the step-time model's; each run's step-2 checkpoint resumes at T = 1 x E = 2 (DP = 4) and continues
the one-process run by the same rule.
"""

from __future__ import annotations

import lightning.pytorch as L
import pytest
from dist_helpers import assert_plan_bytes, lightning_env, run_distributed
from test_qwen3_tensor_parallel import (
    RUNS,
    _fit,
    _layout,
    _Metered,
    assert_every_rank_matches,
    resume_without_t,
)
from test_tensor_parallel import STEPS, WORLD

from mula.model.config import resolve_config
from mula.plan import plan_memory
from mula.plan.step_time import comm_volumes
from strategies import XPUMoEStrategy

MODEL = (
    "deepseek-v3-tiny",
    {"vocab_size": 256, "max_position_embeddings": 64, "router_bias_update_rate": 1e-3},
)
LR = 1e-3


class _DropSharedKeySum(L.Callback):
    """The bug this guards against: the shared RoPE key's gradient taken as complete (each rank's heads)."""

    def on_train_start(self, trainer, pl_module) -> None:
        for module in pl_module.modules():
            if hasattr(module, "kv_a_proj_with_mqa"):
                module.kv_a_proj_with_mqa._forward_hooks.clear()


def _run(rank: int, world: int, root: str) -> dict:
    from mula.training.memory_meter import grad_bytes, param_bytes

    lightning_env(rank, world)
    out = {}
    for key, (ep, sp, shard) in RUNS.items():
        strategy = XPUMoEStrategy(
            tensor_parallel_size=2, expert_parallel_size=ep, sequence_parallel=sp, shard_optimizer=shard
        )
        record, params, trainer = _fit(strategy, rank // 2, world // 2, f"{root}/{key}", model=MODEL, lr=LR)
        meter = next(c for c in trainer.callbacks if isinstance(c, _Metered))
        out[key] = {**record, "params": params, "tp_bytes": meter.bytes}
        if shard:
            opt = strategy._sharded_optimizer()
            module = trainer.lightning_module
            out["memory"] = {"params": param_bytes(module), "grads": grad_bytes(module, opt), **opt.metrics()}
    out.update(resume_without_t(rank, world, root, model=MODEL, lr=LR))
    strategy = XPUMoEStrategy(tensor_parallel_size=2, expert_parallel_size=2, shard_optimizer=False)
    record, params, _ = _fit(strategy, rank // 2, world // 2, extra=[_DropSharedKeySum()], model=MODEL, lr=LR)
    out["dropped"] = {**record, "params": params}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, list[dict]]:
    record, params, _ = _fit(None, model=MODEL, lr=LR)
    root = str(tmp_path_factory.mktemp("deepseek-v3-tp"))
    return {**record, "params": params}, run_distributed(_run, WORLD, root)


@pytest.mark.parametrize("key", list(RUNS))
def test_deepseek_v3_under_tensor_parallelism_matches_single_process(runs, key: str) -> None:
    """Expert counts, losses and gradient norms of every step, then every parameter and router bias."""
    ref, out = runs
    assert any(n.endswith("attn.kv_b_proj.weight") for n in ref["params"])
    assert_every_rank_matches(ref, out, key)


@pytest.mark.parametrize("key", list(RUNS))
def test_deepseek_v3_tensor_parallel_checkpoint_resumes_without_t(runs, key: str) -> None:
    """The step-2 checkpoint of T = 2 (x E = 2 with torch's AdamW; with SP and the sharded optimizer)
    resumes at T = 1 x E = 2 (MLA's up projections whole again) and continues the one-process run."""
    ref, out = runs
    assert_every_rank_matches(ref, out, f"{key}_resumed", first_step=2)


def test_dropping_the_tp_sum_of_the_shared_key_gradient_is_caught(runs) -> None:
    """Without it kv_a_proj_with_mqa's RoPE rows train on each rank's heads only."""
    ref, out = runs
    name = "model.layers.0.attn.kv_a_proj_with_mqa.weight"
    moved = float((out[0]["dropped"]["params"][name] - ref["params"][name]).abs().max())
    assert moved > 1e-4, moved


def test_plan_matches_the_deepseek_v3_tensor_parallel_run(runs) -> None:
    """Per rank under the sharded optimizer: q_b/kv_b/o_proj split, the down projections whole."""
    _, out = runs
    plan = plan_memory(resolve_config(*MODEL), _layout("t2sp"))
    assert_plan_bytes(plan, out)


@pytest.mark.parametrize("key", list(RUNS))
def test_step_time_volumes_match_the_deepseek_v3_tensor_parallel_bytes(runs, key: str) -> None:
    """`comm_volumes`' tensor-parallel bytes are DTensor's: MLA's latents' and RoPE key's gradient
    all-reduces (no reduce-scatter of its input's gradient under SP) beside the MoE layer's collectives."""
    _, out = runs
    (volumes,) = comm_volumes(resolve_config(*MODEL), _layout(key))
    for rank_out in out:
        assert STEPS * volumes.tensor_parallel == pytest.approx(rank_out[key]["tp_bytes"], rel=1e-9), key
