"""XPUMoEStrategy.optimizer_step: a non-finite gradient with a finite loss never reaches the weights.

A bf16 overflow in backward gives exactly this: one expert weight's gradient is `inf` on one rank
while every loss is finite. With the sharded optimizer the gradients live in its buffers (`p.grad` is
None), so the check must be the optimizer's: a non-finite flag carried by the global-norm all-reduce.
On 2 gloo ranks, for the sharded optimizer (E=2), the unsharded AdamW path and pipeline stages (P=2):
the step is skipped on every rank, no weight, router balancing bias or optimizer state changes, the skip
is logged, and the following steps train normally. Without AnomalyGuard the strategy skips the step by itself and says so:
the unsharded AdamW at once (it reads the verdict on the host), the sharded AdamW on the next logging step (it masks its
update by the device flag, mula.host_sync).
"""

from __future__ import annotations

import math

import lightning.pytorch as L
import pytest
import torch
from dist_helpers import cpu_trainer, lightning_env, run_distributed

from callbacks import AnomalyGuard
from mula.training.module import MulaLightningModule
from strategies import XPUMoEStrategy

MICRO, SEQ, MICROS_PER_STEP, STEPS, BAD_STEP = 2, 16, 2, 8, 5
LOG_EVERY = 3  # the sharded run without AnomalyGuard logs on steps 3 and 6: the skip of step 5 is told on 6
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
        # the sharded optimizer's step count (its state, which a skip leaves), else torch's per parameter
        state = int(opt.step_count) if hasattr(opt, "step_count") else _adam_steps(opt)
        self.optimizer_steps[step] = state


def _adam_steps(opt: torch.optim.Optimizer) -> int:
    steps = [int(s["step"]) for s in opt.state.values() if "step" in s]
    return max(steps) if steps else 0


def _fit(world: int, rank: int, strategy: XPUMoEStrategy, guard: bool, log_every_n_steps: int = 50) -> dict:
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
        log_every_n_steps=log_every_n_steps,
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
        "finite_flag": bool(trainer.strategy.last_grads_finite),
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
        # the sharded AdamW skips on the device flag (no host read); the skip is told on logging steps
        out["sharded_no_guard"] = _fit(
            world, rank, XPUMoEStrategy(expert_parallel_size=2), guard=False, log_every_n_steps=LOG_EVERY
        )
    out["warnings"] = [str(w.message) for w in caught if "Skipping optimizer step" in str(w.message)]
    return out


def test_a_non_finite_gradient_with_a_finite_loss_skips_the_step_on_every_rank() -> None:
    ranks = run_distributed(_run, 2)
    for layout in ("sharded", "pipelined", "plain_no_guard", "sharded_no_guard"):
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
        if not layout.endswith("no_guard"):
            assert [out[layout]["skipped"] for out in ranks] == [1, 1]  # every rank agreed
            assert [out[layout]["logged_skips"] for out in ranks] == [1.0, 1.0]
    assert any(f"Skipping optimizer step {BAD_STEP}" in w for w in ranks[0]["warnings"])  # unsharded: at once
    reported = BAD_STEP + LOG_EVERY - BAD_STEP % LOG_EVERY  # the first logging step from BAD_STEP on
    told = f"Skipping optimizer steps on all ranks: a gradient is not finite in 1 of the steps up to step {reported}"
    assert sum(told in w for w in ranks[0]["warnings"]) == 1, ranks[0]["warnings"]


@pytest.mark.parametrize("fused", [True, False], ids=["fused kernel", "foreach math"])
def test_the_sharded_adamw_update_is_a_no_op_where_found_inf_says_so(monkeypatch, fused: bool) -> None:
    """`adamw_update(found_inf=...)` (the strategy's non-finite skip, decided on the device): 1 leaves the
    shard and its moments bit for bit, even with an inf gradient; 0 is the update without it, exactly."""
    from strategies.optim import adamw

    monkeypatch.setattr(adamw, "_FUSED_DEVICES", None if fused else set())
    g = torch.Generator().manual_seed(0)
    state = [torch.randn(5, generator=g), torch.randn(5, generator=g), torch.rand(5, generator=g)]
    grads = [torch.randn(5, generator=g)]
    options = dict(lr=0.1, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8)

    def update(found_inf, grad, step):
        p, m, v = (t.clone() for t in state)
        adamw.adamw_update([p], grad, [m], [v], torch.tensor(step), **options, found_inf=found_inf)
        return [p, m, v]

    bad = [grads[0].clone().index_fill_(0, torch.tensor([2]), math.inf)]
    for step in (1.0, 3.0):  # a skip leaves the count as it was (0 before the first step: no division by 0)
        assert all(torch.equal(a, b) for a, b in zip(update(torch.tensor(1.0), bad, step - 1), state))
        plain = update(None, grads, step)
        assert all(torch.equal(a, b) for a, b in zip(update(torch.tensor(0.0), grads, step), plain))
        assert not torch.equal(plain[0], state[0])
