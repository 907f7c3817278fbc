"""XPUMoEStrategy end to end with Lightning's Trainer on gloo CPU processes.

Reference: one process, same MulaLightningModule, gradient accumulation over the same micro-batches.
Checked: per-step losses for E=4 (sharded optimizer) and E=2 (plain AdamW + EP-aware all-reduce) on
W=4; bf16-true (bf16 weights, fp32 masters) on W=2, E=2 within bf16 rounding of the fp32 run, its
checkpoint resumed on one process and exported as bf16; sharded checkpoints saved at (W=4, E=4) resume at (W=2, E=2) and at W=1 with the uninterrupted
run's next-step loss, and a checkpoint saved at (W=2, E=2) resumes at (W=4, E=4); invalid layouts
fail with one sentence naming the numbers.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from dist_helpers import cpu_trainer, lightning_env, run_distributed
from equality import ADAMW_EPS, RoutingRecord, assert_compared_through, assert_same_training, seeded

from callbacks import MoEMetrics
from mula.checkpoint import consolidate_checkpoint
from mula.training.module import MulaLightningModule
from strategies import XPUMoEStrategy

MICRO, SEQ, MICROS_PER_STEP, STEPS = 2, 16, 4, 4
OVERRIDES = dict(
    vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, num_experts=8, top_k=2,
    expert_intermediate_size=32, max_position_embeddings=64,
)  # fmt: skip


def _module(preset: str = "mula-tiny-moe", overrides: dict | None = None) -> MulaLightningModule:
    torch.manual_seed(seeded(0))
    return MulaLightningModule(
        preset, overrides=OVERRIDES if overrides is None else overrides, lr=1e-2, min_lr=1e-3, warmup_steps=1,
        decay_steps=10, eps=ADAMW_EPS,
    )  # fmt: skip


def _micro_batches(rank: int, world: int, first_step: int, steps: int) -> list[torch.Tensor]:
    """Rank `rank`'s micro-batches for global steps [first_step, first_step + steps): the global
    batch of each step is split into MICROS_PER_STEP micro-batches, rank r taking a contiguous run."""
    per_rank = MICROS_PER_STEP // world
    out = []
    for step in range(first_step, first_step + steps):
        g = torch.Generator().manual_seed(seeded(1000 + step))
        batch = torch.randint(0, OVERRIDES["vocab_size"], (MICROS_PER_STEP * MICRO, SEQ + 1), generator=g)
        micros = batch.split(MICRO)
        out.extend(micros[rank * per_rank : (rank + 1) * per_rank])
    return out


class _StepBatches:
    """This rank's micro-batches, step after step. Resumable by optimizer steps consumed, so a run
    resumed at another world size continues with the next global batch (as Mula's data module does).
    `consumed` is counted by `_StepLosses` (Lightning prefetches, so yielded != consumed)."""

    def __init__(self, rank: int, world: int, total_steps: int) -> None:
        self.rank, self.world, self.total_steps = rank, world, total_steps
        self.per_step = MICROS_PER_STEP // world
        self.start_step = 0
        self.consumed = 0

    def __iter__(self):
        yield from _micro_batches(self.rank, self.world, self.start_step, self.total_steps - self.start_step)

    def state_dict(self) -> dict:
        return {"steps": self.start_step + self.consumed // self.per_step}

    def load_state_dict(self, state: dict) -> None:
        self.start_step = state["steps"]


class _StepLosses(L.Callback):
    """Per optimizer step: the global-batch loss (mean over micro-batches and ranks) and the global
    gradient norm before clipping (Adam hides a wrong gradient scale from the losses; the norm not)."""

    def __init__(self, loader: _StepBatches, routing: RoutingRecord) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.loader = loader
        self.routing = routing
        self._acc = 0.0

    def record(self) -> dict:
        """What `equality.assert_same_training` compares: losses, norms and the routing record."""
        return {"losses": self.losses, "norms": self.norms, **self.routing.as_dict()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not isinstance(trainer.strategy, XPUMoEStrategy):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if isinstance(trainer.strategy, XPUMoEStrategy) and len(self.norms) < len(self.losses) + 1:
            if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
                self.norms.append(float(trainer.strategy.last_grad_norm))

        self.loader.consumed += 1
        self._acc += float(outputs["loss"])  # Lightning divides by accumulate_grad_batches
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            total = trainer.strategy.reduce(torch.tensor(self._acc), reduce_op="mean")
            self.losses.append(float(total))
            self._acc = 0.0


def _fit(
    world: int, strategy, *, max_steps: int = STEPS, ckpt_path=None, save_dir=None, precision="32-true",
    preset: str = "mula-tiny-moe", overrides: dict | None = None,
):  # fmt: skip
    rank = int(os.environ.get("LOCAL_RANK", 0))
    loader = _StepBatches(rank, world, max_steps)
    routing = RoutingRecord(near_ties=strategy is None)  # the one-process reference's near ties
    losses = _StepLosses(loader, routing)
    callbacks: list[L.Callback] = [losses, routing]
    if isinstance(strategy, XPUMoEStrategy):
        callbacks.append(MoEMetrics())  # as recipes/strategies/xpu-moe.yaml adds it
    trainer = cpu_trainer(
        world,
        strategy,
        max_steps=max_steps,
        accumulate_grad_batches=MICROS_PER_STEP // world,
        callbacks=callbacks,
        save_dir=save_dir,
        precision=precision,
        gradient_clip_val=0.5,
    )
    trainer.fit(_module(preset, overrides), loader, ckpt_path=ckpt_path)
    return losses, trainer


def _run_w4(rank: int, world: int, root: str) -> dict:
    lightning_env(rank, world)
    sharded, trainer = _fit(world, XPUMoEStrategy(expert_parallel_size=4), save_dir=f"{root}/w4e4")
    assert type(trainer.optimizers[0]).__name__ == "EPShardedAdamW"
    assert float(trainer.callback_metrics["moe/a2a_bytes"]) > 0
    plain, trainer = _fit(world, XPUMoEStrategy(expert_parallel_size=2, shard_optimizer=False))
    assert isinstance(trainer.optimizers[0], torch.optim.AdamW)
    # meta_init: built on the meta device, each rank materialises only its experts; replicas agree.
    _, trainer = _fit(world, XPUMoEStrategy(expert_parallel_size=4, meta_init=True), max_steps=1)
    model = trainer.lightning_module.model
    assert model.layers[0].mlp.experts.gate_up.shape[0] == OVERRIDES["num_experts"] // 4
    dense = model.layers[0].attn.q_proj.weight.detach().clone()
    gathered = [torch.empty_like(dense) for _ in range(world)]
    torch.distributed.all_gather(gathered, dense)
    assert all(torch.equal(g, dense) for g in gathered)
    return {"sharded": sharded.record(), "plain": plain.record()}


def _resume(
    rank: int, world: int, ep_size: int, ckpt: str, max_steps: int, save_dir: str | None, precision="32-true"
) -> dict:
    lightning_env(rank, world)
    strategy = XPUMoEStrategy(expert_parallel_size=ep_size)
    losses, _ = _fit(
        world, strategy, max_steps=max_steps, ckpt_path=ckpt, save_dir=save_dir, precision=precision
    )
    return losses.record()


def test_strategy_matches_single_process_and_reshards_checkpoints() -> None:
    reference = _fit(1, None, max_steps=STEPS + 2)[0].record()
    with tempfile.TemporaryDirectory() as root:
        w4 = run_distributed(_run_w4, 4, root)[0]
        for key in ("sharded", "plain"):
            assert_same_training(w4[key], reference, what=f"w4 {key}")
        saved = f"{root}/w4e4/epoch=0-step=2.ckpt"
        # a resumed run continues the reference only if the run that saved it did (equality.py: top-k flips)
        assert_compared_through(w4["sharded"], reference, 2, what="w4e4")
        # (W=4, E=4) -> (W=2, E=2), which saves again at step 4 ...
        w2 = run_distributed(_resume, 2, 2, saved, STEPS, f"{root}/w2e2")[0]
        # (W=4, E=4) -> one process
        w1 = run_distributed(_resume, 1, 1, saved, STEPS, None)[0]
        # ... and the reverse: (W=2, E=2) -> (W=4, E=4)
        back = run_distributed(_resume, 4, 4, f"{root}/w2e2/epoch=0-step=4.ckpt", STEPS + 2, None)[0]
        assert_same_training(w1, reference, first_step=2, what="w4e4 -> w1")
        assert_same_training(w2, reference, first_step=2, what="w4e4 -> w2e2")
        assert_compared_through(w2, reference, 2, first_step=2, what="w2e2 saving at step 4")
        assert_same_training(back, reference, first_step=4, what="w2e2 -> w4e4")
        # The sharded directory consolidates into one file that mula's weights reader accepts.
        from mula.checkpoint import load_weights

        sharded = f"{root}/w4e4/epoch=0-step=2.ckpt"
        single = consolidate_checkpoint(sharded, Path(root) / "full.ckpt")
        model = load_weights(single)
        assert model.layers[0].mlp.experts.gate_up.shape[0] == OVERRIDES["num_experts"]
        # ... and mula reads (and exports) the sharded directory itself, with the same weights.
        from mula.hf import export_hf

        direct = load_weights(sharded).state_dict()
        assert direct.keys() == model.state_dict().keys()
        for key, value in model.state_dict().items():
            assert torch.equal(direct[key], value), key
        export_hf(sharded, Path(root) / "hf")
        assert (Path(root) / "hf" / "config.json").is_file()


def _run_bf16_true(rank: int, world: int, root: str) -> dict:
    lightning_env(rank, world)
    losses, trainer = _fit(
        world, XPUMoEStrategy(expert_parallel_size=2), precision="bf16-true", save_dir=f"{root}/bf16"
    )
    opt = trainer.strategy._sharded_optimizer()
    params = list(trainer.lightning_module.parameters())
    # meta_init (as the Aurora recipe): built on meta in bf16, materialised and initialised in bf16
    _, meta = _fit(
        world, XPUMoEStrategy(expert_parallel_size=2, meta_init=True), max_steps=1, precision="bf16-true"
    )
    return {
        "meta_dtypes": {p.dtype for p in meta.lightning_module.parameters()},
        "meta_master_dtype": meta.strategy._sharded_optimizer().master.dtype,
        "losses": losses.losses,
        "param_dtypes": {p.dtype for p in params},
        "master_dtype": opt.master.dtype,
        "param_bytes": float(trainer.callback_metrics["optim/param_bytes"]),
        "state_bytes": float(trainer.callback_metrics["optim/state_bytes"]),
        "local_numel": sum(p.numel() for p in params),
        "owned": opt.owned_numel(),
    }


def test_bf16_true_keeps_fp32_masters_resumes_and_exports() -> None:
    """precision='bf16-true' + the sharded optimizer: bf16 weights, fp32 masters; the run follows the
    fp32 one within bf16 rounding, its checkpoint resumes at another layout and exports as bf16."""
    import json

    from mula.checkpoint import load_weights
    from mula.hf import export_hf

    reference = _fit(1, None)[0].losses  # bf16 rounding is far above any top-k flip's or eps's effect
    with tempfile.TemporaryDirectory() as root:
        runs = run_distributed(_run_bf16_true, 2, root)
        for r in runs:
            assert r["param_dtypes"] == {torch.bfloat16} and r["master_dtype"] == torch.float32
            assert r["meta_dtypes"] == {torch.bfloat16} and r["meta_master_dtype"] == torch.float32
            # logged by MoEMetrics: bf16 weights (2 bytes, plus alignment padding), fp32 state (12)
            assert 2 * r["local_numel"] <= r["param_bytes"] <= 2.1 * r["local_numel"]
            assert 12 * r["owned"] <= r["state_bytes"] <= 12.1 * r["owned"]
        torch.testing.assert_close(
            torch.tensor(runs[0]["losses"]), torch.tensor(reference), rtol=2e-2, atol=0
        )
        saved = f"{root}/bf16/epoch=0-step=2.ckpt"
        resumed = run_distributed(_resume, 1, 1, saved, STEPS, None, "bf16-true")[0]
        torch.testing.assert_close(
            torch.tensor(resumed["losses"]), torch.tensor(runs[0]["losses"][2:]), rtol=1e-2, atol=0
        )
        assert {v.dtype for v in load_weights(saved).state_dict().values() if v.is_floating_point()} == {
            torch.bfloat16
        }
        export_hf(saved, Path(root) / "hf")
        assert json.loads((Path(root) / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def _plain_bf16_true_error(rank: int, world: int, strategy: str) -> str:
    from lightning.pytorch.strategies import DDPStrategy

    lightning_env(rank, world)
    chosen = XPUMoEStrategy(shard_optimizer=False) if strategy == "xpu_moe" else DDPStrategy()
    try:
        _fit(world, chosen, max_steps=1, precision="bf16-true")
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("strategy", ["xpu_moe", "ddp"])
def test_bf16_true_without_fp32_master_weights_is_refused(strategy: str) -> None:
    """bf16 weights that no optimizer keeps fp32 masters for would lose most AdamW updates to rounding."""
    message = run_distributed(_plain_bf16_true_error, 1, strategy)[0]
    assert message.startswith("trainer.precision=bf16-true holds half-precision weights"), message
    assert "keeps no fp32 masters" in message and "bf16-mixed" in message


def _invalid(rank: int, world: int, ep_size: int) -> str:
    lightning_env(rank, world)
    try:
        _fit(world, XPUMoEStrategy(expert_parallel_size=ep_size), max_steps=1)
    except ValueError as error:
        return str(error)
    return ""


@pytest.mark.parametrize(
    ("ep_size", "needle"),
    [(3, "world size 4 is not divisible by expert_parallel_size=3"), (8, "larger than the world size 4")],
)
def test_invalid_layouts_fail_at_start(ep_size: int, needle: str) -> None:
    messages = run_distributed(_invalid, 4, ep_size)
    assert all(needle in m for m in messages), messages


def _invalid_experts(rank: int, world: int) -> str:
    lightning_env(rank, world)
    try:
        torch.manual_seed(0)
        module = MulaLightningModule("mula-tiny-moe", overrides={**OVERRIDES, "num_experts": 6})
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=XPUMoEStrategy(expert_parallel_size=4),
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
        )
        trainer.fit(module, _StepBatches(rank, world, 1))
    except ValueError as error:
        return str(error)
    return ""


def test_experts_not_divisible_by_ep_size() -> None:
    messages = run_distributed(_invalid_experts, 4)
    assert all("6 experts, which is not divisible by expert_parallel_size=4" in m for m in messages), messages
