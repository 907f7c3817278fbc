"""XPUMoEStrategy.optimizer_step: a non-finite gradient with a finite loss never reaches the weights.

A bf16 overflow in backward gives exactly this: one expert weight's gradient is `inf` on one rank
while every loss is finite. With the sharded optimizer the gradients live in its buffers (`p.grad` is
None), so the check must be the optimizer's: a non-finite flag carried by the global-norm all-reduce.
On 2 gloo ranks, for the sharded optimizer (E=2), the unsharded AdamW path and pipeline stages (P=2):
the step is skipped on every rank, no weight, router balancing bias or optimizer state changes, the skip
is logged, and the following steps train normally. Without AnomalyGuard the strategy skips the step by itself and says so.
"""

from __future__ import annotations

import math

import lightning.pytorch as L
import torch
from dist_helpers import cpu_trainer, lightning_env, run_distributed

from callbacks import AnomalyGuard
from mula.training.module import MulaLightningModule
from strategies import XPUMoEStrategy

MICRO, SEQ, MICROS_PER_STEP, STEPS, BAD_STEP = 2, 16, 2, 8, 5
OVERRIDES = dict(
    vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2,
    expert_intermediate_size=32, max_position_embeddings=64, router_bias_update_rate=0.01,
)  # fmt: skip
EXPERT = "model.layers.0.mlp.experts.gate_up"  # on rank 0 in every layout (stage 0 holds block 0)


class _Batches:
    """A data-parallel rank's share of each step's global batch: micro-batches, or whole with stages."""

    def __init__(self, dp_rank: int, dp_size: int, whole: bool) -> None:
        self.dp_rank, self.dp_size, self.whole = dp_rank, dp_size, whole

    def __iter__(self):
        rows = MICROS_PER_STEP * MICRO // self.dp_size
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 + step)
            batch = torch.randint(0, OVERRIDES["vocab_size"], (MICROS_PER_STEP * MICRO, SEQ + 1), generator=g)
            mine = batch[self.dp_rank * rows : (self.dp_rank + 1) * rows]
            yield from [mine] if self.whole else mine.split(MICRO)


class _InfGradient(L.Callback):
    """During optimizer step BAD_STEP, on global rank 0 only, one element of one expert weight's
    gradient becomes inf (the loss stays finite)."""

    def __init__(self) -> None:
        self.handle = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == 0 and trainer.global_step == BAD_STEP - 1 and self.handle is None:
            param = dict(pl_module.named_parameters())[EXPERT]
            self.handle = param.register_hook(_poison)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def _poison(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = math.inf
    return grad


class _Recorder(L.Callback):
    """After every optimizer step: this rank's parameters, the step's loss and the optimizer's steps."""

    def __init__(self) -> None:
        self.params: dict[int, dict[str, torch.Tensor]] = {}
        self.losses: dict[int, float] = {}
        self.optimizer_steps: dict[int, int] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        opt = trainer.optimizers[0]
        if hasattr(opt, "wait_for_params"):
            opt.wait_for_params()
        step = trainer.global_step
        self.params[step] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        # the loss-free balancing bias is state the step updates too: a skipped step must leave it
        self.params[step] |= {n: b.clone() for n, b in pl_module.named_buffers() if n.endswith("router.bias")}
        self.losses[step] = float(outputs["loss"])
        state = opt.steps_done if hasattr(opt, "steps_done") else _adam_steps(opt)
        self.optimizer_steps[step] = state


def _adam_steps(opt: torch.optim.Optimizer) -> int:
    steps = [int(s["step"]) for s in opt.state.values() if "step" in s]
    return max(steps) if steps else 0


def _fit(world: int, rank: int, strategy: XPUMoEStrategy, guard: bool) -> dict:
    pp, ep = strategy.layout.pp, strategy.layout.ep
    dp_size = world // pp
    dp_rank = (rank // (pp * ep)) * ep + rank % ep
    if pp > 1:
        strategy.pipeline_microbatches = MICROS_PER_STEP // dp_size  # no MulaDataModule here
    recorder = _Recorder()
    anomaly = AnomalyGuard(zscore_threshold=None, max_consecutive=3, min_history=1, window=3)
    callbacks = [_InfGradient(), recorder] + ([anomaly] if guard else [])
    trainer = cpu_trainer(
        world,
        strategy,
        max_steps=STEPS,
        accumulate_grad_batches=1 if pp > 1 else MICROS_PER_STEP // world,
        callbacks=callbacks,
        gradient_clip_val=1.0,
    )
    torch.manual_seed(0)
    module = MulaLightningModule(
        "mula-tiny-moe", overrides=OVERRIDES, lr=1e-2, warmup_steps=1, decay_steps=20
    )
    trainer.fit(module, _Batches(dp_rank, dp_size, whole=pp > 1))
    return {
        "params": recorder.params,
        "losses": recorder.losses,
        "optimizer_steps": recorder.optimizer_steps,
        "skipped": anomaly.skipped_steps if guard else None,
        "logged_skips": float(trainer.callback_metrics["ft/skipped_steps"]) if guard else None,
        "finite_flag": trainer.strategy.last_grads_finite,
    }


def _run(rank: int, world: int) -> dict:
    import warnings

    lightning_env(rank, world)
    out = {
        "sharded": _fit(world, rank, XPUMoEStrategy(expert_parallel_size=2), guard=True),
        "pipelined": _fit(world, rank, XPUMoEStrategy(pipeline_parallel_size=2), guard=True),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["plain_no_guard"] = _fit(
            world, rank, XPUMoEStrategy(expert_parallel_size=2, shard_optimizer=False), guard=False
        )
    out["warnings"] = [str(w.message) for w in caught if "Skipping optimizer step" in str(w.message)]
    return out


def test_a_non_finite_gradient_with_a_finite_loss_skips_the_step_on_every_rank() -> None:
    ranks = run_distributed(_run, 2)
    for layout in ("sharded", "pipelined", "plain_no_guard"):
        for rank, out in enumerate(ranks):
            run = out[layout]
            where = f"{layout}, rank {rank}"
            assert all(math.isfinite(v) for v in run["losses"].values()), where  # the loss stayed finite
            before, after = run["params"][BAD_STEP - 1], run["params"][BAD_STEP]
            for name, value in before.items():  # no weight changed, on any rank
                assert torch.equal(value, after[name]), f"{where}: {name} changed in the skipped step"
            # the optimizer took every step but that one
            assert run["optimizer_steps"][BAD_STEP] == run["optimizer_steps"][BAD_STEP - 1] == BAD_STEP - 1, (
                where
            )
            assert run["optimizer_steps"][STEPS] == STEPS - 1, where
            # training continues: every later step changes the weights, which stay finite
            for step in range(BAD_STEP + 1, STEPS + 1):
                prev, now = run["params"][step - 1], run["params"][step]
                assert any(not torch.equal(prev[n], now[n]) for n in now), (
                    f"{where}: step {step} did not train"
                )
                assert all(torch.isfinite(p).all() for p in now.values()), f"{where}: step {step}"
            assert run["finite_flag"] is True, where  # the last step's gradients were finite
        if layout != "plain_no_guard":
            assert [out[layout]["skipped"] for out in ranks] == [1, 1]  # every rank agreed
            assert [out[layout]["logged_skips"] for out in ranks] == [1.0, 1.0]
    assert any(f"Skipping optimizer step {BAD_STEP}" in w for w in ranks[0]["warnings"])
