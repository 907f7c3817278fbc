"""MoE layers under tensor parallelism (tokens split over the TP group, experts whole), 1 process vs 4 gloo ranks.

Reference: one process, the same MulaLightningModule, gradient accumulation over the same global
batches. On W = 4 CPU ranks, fp32, 6 optimizer steps with global-norm clipping and the router-bias
update: T = 2 x E = 2 (DP = 2, EDP = 1) with torch's AdamW and with the sharded optimizer (the MoE
layer recomputed), and T = 2 with sequence parallelism (E = 1, DP = EDP = 2, blocks recomputed).
Compared by the suite's equality rule (tests/equality.py): the step's global expert counts, every
logged loss (total, aux and z) and gradient norm, then every parameter (gathered to its full tensor,
experts over the EP group) and router bias after the last step. Dropping the TP sum of the router's
and experts' partial gradients must break the equality. The T = 2 x E = 2 sharded run's per-rank
parameter, gradient and optimizer bytes equal `mula plan`'s, and every run's DTensor collective bytes
the step-time model's. A checkpoint of T = 2 x E = 2 resumes at T = 1 and back, continuing the
uninterrupted run (its losses and gradient norms, by the same rule).
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
from test_strategy import _StepLosses  # per step: the global-batch loss and the global gradient norm
from test_tensor_parallel import _Batches
from torch.distributed.device_mesh import init_device_mesh

from callbacks import MoEMetrics
from mula.model.config import resolve_config
from mula.model.moe import is_expert_param
from mula.model.transformer import Mula
from mula.plan import Layout, plan_memory
from mula.plan.step_time import comm_volumes
from mula.training.module import MulaLightningModule
from strategies import XPUMoEStrategy
from strategies.tensor_parallel import apply_tensor_parallel

MICRO, SEQ, MICROS_PER_STEP, STEPS, WORLD = 2, 16, 4, 6, 4
# a dense first block (column/row-parallel MLP) and an MoE block with a shared expert (whole, on this
# rank's tokens like the routed ones); RMSNorm and QK-norm, GQA
MOE = dict(
    vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
    num_dense_layers=1, num_experts=4, top_k=2, expert_intermediate_size=32, max_position_embeddings=64,
    router_bias_update_rate=1e-3, num_shared_experts=1, shared_expert_intermediate_size=16,
)  # fmt: skip
# the 4-rank runs: key -> (E, sequence parallel, sharded optimizer, activation checkpointing)
RUNS = {
    "t2e2": (2, False, False, "none"),
    "t2e2_sharded": (2, False, True, ["moe"]),  # the MoE layer (its split and gather) recomputed
    "t2sp": (1, True, False, "full"),
}


class _Logged(L.Callback):
    """Per optimizer step: the logged aux and z losses (the step's global expert counts: `RoutingRecord`)."""

    def __init__(self) -> None:
        self.aux: list[float] = []
        self.z: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.aux.append(float(trainer.callback_metrics["train/aux_loss"]))
            self.z.append(float(trainer.callback_metrics["train/z_loss"]))


class _Metered(L.Callback):
    """DTensor's (functional) collectives counted during training batches, the optimizer step included,
    by `mula bench`'s meter (`mula.bench.collectives.CollectiveMeter`)."""

    def __init__(self) -> None:
        from mula.bench.collectives import CollectiveMeter

        self.meter = CollectiveMeter()

    @property
    def bytes(self) -> float:
        """The bus bytes the functional collectives sent (tensor parallelism's: `comm_volumes`'
        `tensor_parallel`; Ulysses' all-to-alls are another kind)."""
        return self.meter.sent["functional"]

    def on_train_batch_start(self, *args) -> None:
        self.meter.__enter__()

    def on_train_batch_end(self, *args) -> None:
        self.meter.__exit__(None, None, None)


class _WholeSteps(_Batches):
    """One micro-batch per step and data-parallel rank: its contiguous 1/dp_size of the global batch."""

    def __iter__(self):
        for step in range(self.first_step, self.steps):
            g = torch.Generator().manual_seed(seeded(1000 + step))
            batch = torch.randint(0, MOE["vocab_size"], (MICROS_PER_STEP * MICRO, SEQ + 1), generator=g)
            yield batch.chunk(self.dp_size)[self.dp_rank]


def _fit(
    strategy,
    dp_rank: int = 0,
    dp_size: int = 1,
    checkpointing="none",
    scope: str = "micro_batch",
    steps=STEPS,
) -> tuple[_StepLosses, _Logged, dict, object]:
    """`steps` steps (6); under the global aux-loss scope without accumulation (one micro-batch per rank and step,
    so that the scope's frequencies are the global batch's in every micro-batch, one process's too)."""
    whole = scope == "global"
    batches = (_WholeSteps if whole else _Batches)(dp_rank, dp_size, steps=steps)
    routing = RoutingRecord(near_ties=strategy is None)  # the one-process reference's near ties
    losses, logged = _StepLosses(batches, routing), _Logged()
    world = WORLD if strategy is not None else 1
    callbacks = [losses, logged, routing] + ([MoEMetrics(), _Metered()] if strategy is not None else [])
    trainer = cpu_trainer(
        world, strategy, max_steps=steps, accumulate_grad_batches=1 if whole else MICROS_PER_STEP // dp_size,
        callbacks=callbacks, gradient_clip_val=0.5, log_every_n_steps=1,
    )  # fmt: skip
    torch.manual_seed(seeded(0))
    module = MulaLightningModule(
        "mula-tiny-moe", overrides={**MOE, "aux_loss_scope": scope}, lr=1e-2, min_lr=1e-3, warmup_steps=1,
        decay_steps=10, activation_checkpointing=checkpointing, eps=ADAMW_EPS,
    )  # fmt: skip
    trainer.fit(module, batches)
    params = whole_params(trainer.lightning_module, getattr(strategy, "topology", None))
    return losses, logged, params, trainer


def _result(losses: _StepLosses, logged: _Logged, params: dict) -> dict:
    """What `equality.assert_same_training` compares (`SERIES`, the routing record) and the parameters."""
    return {**losses.record(), "aux": logged.aux, "z": logged.z, "params": params}


SERIES = ("losses", "norms", "aux", "z")


def _drop_partial_sum() -> None:
    """The classic bug: the router's and experts' partial gradients taken as if they were complete."""
    import strategies.optim.grad_reduce as grad_reduce

    proper = grad_reduce.laid_out_grad
    grad_reduce.laid_out_grad = lambda p, g: g if hasattr(p, "tp_partial_mesh") else proper(p, g)


def _run(rank: int, world: int) -> dict:
    from mula.training.memory_meter import grad_bytes, param_bytes

    lightning_env(rank, world)
    out = {}
    for key, (ep, sp, shard, checkpointing) in RUNS.items():
        strategy = XPUMoEStrategy(
            tensor_parallel_size=2, expert_parallel_size=ep, sequence_parallel=sp, shard_optimizer=shard
        )
        losses, logged, params, trainer = _fit(strategy, rank // 2, world // 2, checkpointing)
        out[key] = _result(losses, logged, params)
        out[key]["tp_bytes"] = next(c for c in trainer.callbacks if isinstance(c, _Metered)).bytes
        if shard:
            opt = strategy._sharded_optimizer()
            module = trainer.lightning_module
            out["memory"] = {"params": param_bytes(module), "grads": grad_bytes(module, opt), **opt.metrics()}
    # the global aux-loss scope: each rank's own counts summed over all ranks (each token once)
    strategy = XPUMoEStrategy(tensor_parallel_size=2, expert_parallel_size=2)
    out["global"] = _result(*_fit(strategy, rank // 2, world // 2, scope="global")[:3])
    _drop_partial_sum()
    strategy = XPUMoEStrategy(tensor_parallel_size=2, expert_parallel_size=2, shard_optimizer=False)
    out["dropped"] = _result(*_fit(strategy, rank // 2, world // 2)[:3])
    # MoE layers split the sequence over the TP ranks: an uneven split is refused before any collective
    model = apply_tensor_parallel(
        Mula(resolve_config("mula-tiny-moe", MOE)), init_device_mesh("cpu", (world,))
    )
    with pytest.raises(ValueError, match="sequence length 6 is not divisible by 4") as err:
        model(torch.zeros(1, 6, dtype=torch.long))
    out["uneven"] = str(err.value)
    return out


@pytest.fixture(scope="module")
def runs() -> tuple[dict, list[dict]]:
    ref = _result(*_fit(None)[:3])
    ref["global"] = _result(*_fit(None, scope="global")[:3])
    return ref, run_distributed(_run, WORLD)


@pytest.mark.parametrize("key", [*RUNS, "global"])
def test_moe_under_tensor_parallelism_matches_single_process(runs, key: str) -> None:
    """Global expert counts, losses (total, aux, z) and gradient norms of every step, then every parameter
    and router bias, on every rank (the equality rule, tests/equality.py)."""
    ref, out = runs
    ref = ref["global"] if key == "global" else ref
    assert len(ref["losses"]) == STEPS
    for rank, rank_out in enumerate(out):
        run = rank_out[key]
        assert len(run["counts"]) == STEPS
        assert run["params"].keys() == ref["params"].keys()
        assert_same_training(run, ref, series=SERIES, what=f"{key} rank {rank}")
        assert_same_weights(run["params"], ref["params"], what=f"{key} rank {rank}")


def test_dropping_the_tp_sum_of_partial_moe_gradients_is_caught(runs) -> None:
    """Without the TP all-reduce the router and the experts train on half of each micro-batch."""
    ref, out = runs
    dropped = out[0]["dropped"]
    moved = max(
        float((dropped["params"][n] - v).abs().max())
        for n, v in ref["params"].items()
        if ".router." in n or is_expert_param(n)
    )
    assert moved > 1e-3, moved
    assert all(r["uneven"].endswith("choose a seq_len divisible by it.") for r in out)


def test_plan_matches_the_tensor_parallel_moe_run(runs) -> None:
    """Per rank, T = 2 x E = 2 under the sharded optimizer: experts whole per TP rank (sliced over EP),
    the router and experts replicated over TP, dense layers split; the plan's parameter, gradient and
    optimizer bytes are the run's (activations: tests/test_plan_measured_tp.py, at a longer sequence)."""
    _, out = runs
    plan = plan_memory(resolve_config("mula-tiny-moe", MOE), _layout("t2e2_sharded"))
    assert_plan_bytes(plan, out)


def _layout(key: str) -> Layout:
    ep, sp, shard, checkpointing = RUNS[key]
    return Layout(
        world_size=WORLD, tp_size=2, ep_size=ep, sequence_parallel=sp, micro_batch=MICRO, seq_len=SEQ,
        micro_batches=MICROS_PER_STEP // (WORLD // 2), shard_optimizer=shard, checkpointing=checkpointing,
        collectives="rooted",
    )  # fmt: skip


@pytest.mark.parametrize("key", list(RUNS))
def test_step_time_volumes_match_the_tensor_parallel_bytes(runs, key: str) -> None:
    """`comm_volumes`' tensor-parallel bytes are those DTensor hands to the functional collectives: the
    MoE output's and input gradient's all-gathers (none under SP), the router-loss sums, and the partial
    router and expert gradients (every micro-batch under the sharded optimizer, once a step without), and
    the collectives of the forwards activation checkpointing runs again."""
    _, out = runs
    (volumes,) = comm_volumes(resolve_config("mula-tiny-moe", MOE), _layout(key))
    for rank_out in out:
        assert STEPS * volumes.tensor_parallel == pytest.approx(rank_out[key]["tp_bytes"], rel=1e-9), key


def _resume_across_t(rank: int, world: int, root: str) -> dict:
    """T = 2 x E = 2 saves at step 2; T = 1 x E = 2 resumes from it (and saves at step 4); T = 2 x E = 2
    resumes from that. Sharded optimizer, sharded (DCP) checkpoints of global tensors."""
    lightning_env(rank, world)

    def fit(tp: int, first: int, last: int, save: str | None, ckpt: str | None) -> dict:
        strategy = XPUMoEStrategy(tensor_parallel_size=tp, expert_parallel_size=2)
        batches = _Batches(rank // tp, world // tp, first, last)
        routing = RoutingRecord()
        losses = _StepLosses(batches, routing)
        trainer = cpu_trainer(
            world, strategy, max_steps=last, accumulate_grad_batches=MICROS_PER_STEP // (world // tp),
            callbacks=[losses, routing], gradient_clip_val=0.5, save_dir=save,
        )  # fmt: skip
        torch.manual_seed(seeded(0))
        module = MulaLightningModule(
            "mula-tiny-moe", overrides=MOE, lr=1e-2, min_lr=1e-3, warmup_steps=1, decay_steps=10,
            eps=ADAMW_EPS,
        )  # fmt: skip
        trainer.fit(module, batches, ckpt_path=ckpt)
        return losses.record()

    saved = fit(2, 0, 2, f"{root}/t2", None)
    down = fit(1, 2, STEPS, f"{root}/t1", f"{root}/t2/epoch=0-step=2.ckpt")
    up = fit(2, 4, STEPS, None, f"{root}/t1/epoch=1-step=4.ckpt")  # epoch 1: the first run ended one
    return {"saved": saved, "down": down, "up": up}


def test_moe_checkpoints_resume_at_another_tensor_parallel_size(runs, tmp_path) -> None:
    """Router, experts (global DTensors over the EP group) and their optimizer state are whole tensors in
    the checkpoint: 2 -> 1 and 1 -> 2 continue the uninterrupted run's losses, and mula's weights reader
    (export-hf's) reads the T = 2 x E = 2 directory as one process's weights."""
    from mula.checkpoint import load_weights

    ref, _ = runs
    out = run_distributed(_resume_across_t, WORLD, str(tmp_path))[0]
    # a resumed run continues the reference only if the run that saved it did (equality.py: top-k flips)
    assert_compared_through(out["saved"], ref, 2, what="t2e2 to step 2")
    assert_same_training(out["down"], ref, first_step=2, what="t2e2 -> t1e2")
    assert_compared_through(out["down"], ref, 2, first_step=2, what="t1e2 saving at step 4")
    assert_same_training(out["up"], ref, first_step=4, what="t1e2 -> t2e2")
    weights = load_weights(tmp_path / "t2" / "epoch=0-step=2.ckpt").state_dict()
    assert weights.keys() == {n.removeprefix("model.") for n in ref["params"]}
    # its weights are one process's after 2 steps
    at_two = _fit(None, steps=2)[2]
    checkpoint = {n: weights[n.removeprefix("model.")] for n in at_two}
    assert_same_weights(checkpoint, at_two, what="t2e2 checkpoint at step 2")
