"""Qwen3-MoE under tensor parallelism (per-head QK-norm), 1 process vs 4 gloo ranks.

Qwen3 normalises each head's q and k on their own with one head_dim weight shared by the heads
(`qk_norm_per_head`). Under TP each rank holds its own heads: the norm needs no statistics of its TP
peers, and its weight stays whole (replicated) while its gradient on a rank covers that rank's heads
only, a partial sum completed over the TP group (`mark_tp_partial`, as the MoE router's).

Reference: one process, the same MulaLightningModule (the tiny Qwen3-MoE preset at test size: a dense
first block, then an MoE block; GQA, head_dim decoupled from hidden / heads), gradient accumulation
over the same global batches, fp32, 6 steps with global-norm clipping. Runs on W = 4: T = 2 x E = 2
(DP = 2) with torch's AdamW, and T = 2 with sequence parallelism and the sharded optimizer (E = 1,
DP = 2). Compared by the suite's equality rule (tests/equality.py): every step's global expert counts,
losses and gradient norms, then every parameter (gathered to its full tensor, experts over the EP
group). Dropping the TP sum of the QK-norm weights' partial gradients must break the equality. The
sharded run's per-rank parameter, gradient and optimizer bytes equal `mula plan`'s (the norm weights
whole on each TP rank), each run's DTensor collective bytes equal the step-time model's (no QK-norm
statistics, the norm weights' partial gradients summed), the T = 2 x E = 2 checkpoint exported
with `mula export-hf` holds the one-process export's tensors, and each run's step-2 checkpoint resumes
at T = 1 x E = 2 (DP = 4) and continues the one-process run by the same rule.
"""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from dist_helpers import assert_plan_bytes, cpu_trainer, lightning_env, run_distributed, whole_params
from equality import (
    ADAMW_EPS,
    RoutingRecord,
    assert_compared_through,
    assert_same_training,
    assert_same_weights,
    seeded,
)
from safetensors.torch import load_file
from test_strategy import _StepLosses
from test_tensor_parallel import MICRO, MICROS_PER_STEP, SEQ, STEPS, WORLD, _Batches
from test_tensor_parallel_moe import _Metered

from mula.model.config import resolve_config
from mula.plan import Layout, plan_memory
from mula.plan.step_time import comm_volumes
from mula.training.module import MulaLightningModule
from strategies import XPUMoEStrategy

PRESET = "qwen3-moe-tiny"
# the preset's structure at the harness's size (vocabulary 256, as tests/test_tensor_parallel.py's batches)
QWEN3 = dict(
    vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    num_dense_layers=1, intermediate_size=64, num_experts=4, top_k=2, expert_intermediate_size=32,
    max_position_embeddings=64,
)  # fmt: skip
# key -> (E, sequence parallel, sharded optimizer)
RUNS = {"t2e2": (2, False, False), "t2sp": (1, True, True)}
QK_NORMS = (".attn.q_norm.", ".attn.k_norm.")


def _fit(
    strategy,
    dp_rank: int = 0,
    dp_size: int = 1,
    save_dir=None,
    extra=(),
    model=(PRESET, QWEN3),
    lr=1e-2,
    ckpt_path=None,
    first_step=0,
) -> tuple[dict, dict, object]:
    """Train `model` (preset, overrides) to step 6 with `extra` callbacks (from `ckpt_path`, saved at
    `first_step`, when given; checkpoints every 2 steps into `save_dir`); (the record equality.py compares,
    every parameter and buffer as its full tensor, the trainer). tests/test_deepseek_v3_tensor_parallel.py
    uses it too."""
    batches = _Batches(dp_rank, dp_size, first_step)
    routing = RoutingRecord(near_ties=strategy is None)  # the one-process reference's near ties
    losses = _StepLosses(batches, routing)
    world = WORLD if strategy is not None else 1
    callbacks = [losses, routing, *extra] + ([_Metered()] if strategy is not None else [])
    trainer = cpu_trainer(
        world, strategy, max_steps=STEPS, accumulate_grad_batches=MICROS_PER_STEP // dp_size,
        callbacks=callbacks, gradient_clip_val=0.5, save_dir=save_dir,
    )  # fmt: skip
    torch.manual_seed(seeded(0))
    module = MulaLightningModule(
        model[0], overrides=model[1], lr=lr, min_lr=lr / 10, warmup_steps=1, decay_steps=10, eps=ADAMW_EPS
    )
    trainer.fit(module, batches, ckpt_path=ckpt_path)
    params = whole_params(trainer.lightning_module, getattr(strategy, "topology", None))
    return losses.record(), params, trainer


class _DropQKNormSum(L.Callback):
    """The bug this guards against: the per-head QK-norm weights' partial gradients taken as complete."""

    def on_train_start(self, trainer, pl_module) -> None:
        import strategies.optim.grad_reduce as grad_reduce

        norms = {id(p) for n, p in pl_module.named_parameters() if any(s in f".{n}" for s in QK_NORMS)}
        proper = grad_reduce.laid_out_grad
        grad_reduce.laid_out_grad = lambda p, g: g if id(p) in norms else proper(p, g)


def _run(rank: int, world: int, root: str) -> dict:
    from mula.training.memory_meter import grad_bytes, param_bytes

    lightning_env(rank, world)
    out = {}
    for key, (ep, sp, shard) in RUNS.items():
        strategy = XPUMoEStrategy(
            tensor_parallel_size=2, expert_parallel_size=ep, sequence_parallel=sp, shard_optimizer=shard
        )
        record, params, trainer = _fit(strategy, rank // 2, world // 2, save_dir=f"{root}/{key}")
        meter = next(c for c in trainer.callbacks if isinstance(c, _Metered))
        out[key] = {**record, "params": params, "tp_bytes": meter.bytes}
        if shard:
            opt = strategy._sharded_optimizer()
            module = trainer.lightning_module
            out["memory"] = {"params": param_bytes(module), "grads": grad_bytes(module, opt), **opt.metrics()}
    out.update(resume_without_t(rank, world, root))  # before the planted bug below patches the reduction
    strategy = XPUMoEStrategy(tensor_parallel_size=2, expert_parallel_size=2, shard_optimizer=False)
    record, params, _ = _fit(strategy, rank // 2, world // 2, extra=[_DropQKNormSum()])
    out["dropped"] = {**record, "params": params}
    return out


def resume_without_t(rank: int, world: int, root: str, **fit) -> dict:
    """Each run of RUNS resumed from its T = 2 checkpoint of step 2 under `root` at T = 1 x E = 2 (DP = 4:
    each rank reads its own quarter of the batch), with the optimizer it was saved with; `fit`: `_fit`'s
    model and lr. Returns {"<key>_resumed": the record and every parameter}."""
    out = {}
    for key, (_, _, shard) in RUNS.items():
        strategy = XPUMoEStrategy(expert_parallel_size=2, shard_optimizer=shard)
        ckpt = f"{root}/{key}/epoch=0-step=2.ckpt"
        record, params, _ = _fit(strategy, rank, world, ckpt_path=ckpt, first_step=2, **fit)
        assert strategy.data_parallel_size == world
        out[f"{key}_resumed"] = {**record, "params": params}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, list[dict], object]:
    root = tmp_path_factory.mktemp("qwen3-tp")
    record, params, _ = _fit(None)
    return {**record, "params": params}, run_distributed(_run, WORLD, str(root)), root


@pytest.mark.parametrize("key", list(RUNS))
def test_qwen3_under_tensor_parallelism_matches_single_process(runs, key: str) -> None:
    """Expert counts, losses and gradient norms of every step, then every parameter, on every rank."""
    ref, out, _ = runs
    assert any(n.endswith("attn.q_norm.weight") for n in ref["params"])
    assert_every_rank_matches(ref, out, key)


def assert_every_rank_matches(ref: dict, out: list[dict], key: str, first_step: int = 0) -> None:
    """Run `key` of every rank against the one-process reference by the equality rule: expert counts,
    losses and gradient norms of every step, then every parameter and buffer. `first_step`: `key` resumed
    at the reference's step `first_step` from the checkpoint of `key` without its "_resumed" suffix."""
    assert len(ref["losses"]) == STEPS
    saver = key.removesuffix("_resumed")
    # a resumed run continues the reference only if the run that saved it did (equality.py: top-k flips)
    if first_step:
        assert_compared_through(out[0][saver], ref, first_step, what=f"{saver} saving")
    for rank, rank_out in enumerate(out):
        run = rank_out[key]
        assert len(run["counts"]) == len(run["losses"]) == STEPS - first_step
        assert run["params"].keys() == ref["params"].keys()
        assert_same_training(run, ref, first_step=first_step, what=f"{key} rank {rank}")
        assert_same_weights(run["params"], ref["params"], what=f"{key} rank {rank}")


@pytest.mark.parametrize("key", list(RUNS))
def test_qwen3_tensor_parallel_checkpoint_resumes_without_t(runs, key: str) -> None:
    """The step-2 checkpoint of T = 2 (x E = 2 with torch's AdamW; with SP and the sharded optimizer)
    resumes at T = 1 x E = 2 and continues the one-process run by the equality rule."""
    ref, out, _ = runs
    assert_every_rank_matches(ref, out, f"{key}_resumed", first_step=2)


def test_dropping_the_tp_sum_of_the_qk_norm_gradients_is_caught(runs) -> None:
    """Without the TP all-reduce each rank's QK-norm weights train on its own heads only."""
    ref, out, _ = runs
    moved = max(
        float((out[0]["dropped"]["params"][n] - v).abs().max())
        for n, v in ref["params"].items()
        if any(s in f".{n}" for s in QK_NORMS)
    )
    assert moved > 1e-3, moved


def _layout(key: str) -> Layout:
    ep, sp, shard = RUNS[key]
    return Layout(
        world_size=WORLD, tp_size=2, ep_size=ep, sequence_parallel=sp, micro_batch=MICRO, seq_len=SEQ,
        micro_batches=MICROS_PER_STEP // (WORLD // 2), shard_optimizer=shard, collectives="rooted",
    )  # fmt: skip


def test_plan_matches_the_qwen3_tensor_parallel_run(runs) -> None:
    """Per rank under the sharded optimizer: the per-head norm weights whole, the projections split."""
    _, out, _ = runs
    plan = plan_memory(resolve_config(PRESET, QWEN3), _layout("t2sp"))
    assert_plan_bytes(plan, out)


@pytest.mark.parametrize("key", list(RUNS))
def test_step_time_volumes_match_the_qwen3_tensor_parallel_bytes(runs, key: str) -> None:
    """`comm_volumes`' tensor-parallel bytes are DTensor's: no QK-norm statistics (each head is whole on
    its rank), the per-head norm weights' partial gradients summed over TP with the MoE layer's."""
    _, out, _ = runs
    (volumes,) = comm_volumes(resolve_config(PRESET, QWEN3), _layout(key))
    for rank_out in out:
        assert STEPS * volumes.tensor_parallel == pytest.approx(rank_out[key]["tp_bytes"], rel=1e-9), key


def test_tensor_parallel_qwen3_checkpoint_exports_the_single_process_tensors(runs) -> None:
    """`mula export-hf` of the T = 2 x E = 2 checkpoint: the one-process export's tensors, name for name."""
    from mula.hf import export_hf, iter_hf_tensors

    ref, out, root = runs
    state = {name.removeprefix("model."): value for name, value in ref["params"].items()}
    expected = dict(iter_hf_tensors(resolve_config(PRESET, QWEN3), state))
    export_hf(root / "t2e2" / "epoch=0-step=6.ckpt", root / "t2e2-hf")
    exported: dict[str, torch.Tensor] = {}
    for shard in sorted((root / "t2e2-hf").glob("*.safetensors")):
        exported.update(load_file(shard))
    assert exported.keys() == expected.keys()
    assert "model.layers.0.self_attn.q_norm.weight" in exported
    for i, r in enumerate(out):
        assert_same_training(r["t2e2"], ref, what=f"t2e2 rank {i}")
    assert_same_weights(exported, expected, what="t2e2 export")
