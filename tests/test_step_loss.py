"""`train/loss` (and its components) is the loss of the optimizer step: the mean over the global batch.

The same global batches are trained on one process (4 micro-batches accumulated per step) and on two
gloo processes (2 each) with DDP and with XPUMoEStrategy (expert_parallel_size=2): every logged step
must log the same `train/loss`, `train/ce_loss`, `train/aux_loss` and `train/z_loss`, by the suite's
equality rule (tests/equality.py: fp32, every step it compares). Before, each run logged rank 0's last
micro-batch, which differs with the world size.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
from dist_helpers import lightning_env, run_distributed
from equality import ADAMW_EPS, RoutingRecord, assert_same_training, seeded
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader

from mula.training.module import STEP_LOSSES, MulaLightningModule
from strategies import XPUMoEStrategy

MICRO, SEQ, MICROS_PER_STEP, STEPS = 2, 16, 4, 3
OVERRIDES = dict(
    vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2,
    expert_intermediate_size=32, max_position_embeddings=64,
)  # fmt: skip
# the logged STEP_LOSSES as per-step series of an `equality.assert_same_training` record
SERIES = ("losses", "ce_losses", "aux_losses", "z_losses")


class _Recorder(Logger):
    """Keeps what Lightning hands to the loggers: (step, metrics) per call, on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    def losses(self) -> dict[int, list[float]]:
        """step -> [train/loss, train/ce_loss, train/aux_loss, train/z_loss] of each logged step (the tiny
        MoE has no multi-token prediction, so no `train/mtp_loss`: asserted absent)."""
        logged = {step: m for step, m in self.rows if "train/loss" in m}
        assert all(STEP_LOSSES[-1] not in m for m in logged.values())
        return {step: [m[k] for k in STEP_LOSSES[:-1]] for step, m in logged.items()}


def _micro_batches(rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s micro-batches [n, MICRO, SEQ + 1]: a contiguous share of every global batch."""
    per_rank = MICROS_PER_STEP // world
    g = torch.Generator().manual_seed(seeded(1234))
    data = torch.randint(0, OVERRIDES["vocab_size"], (STEPS, MICROS_PER_STEP, MICRO, SEQ + 1), generator=g)
    return data[:, rank * per_rank : (rank + 1) * per_rank].flatten(0, 1)


def _fit(rank: int, world: int, strategy: Any, log_every_n_steps: int = 1) -> L.Trainer:
    recorder = _Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=MICROS_PER_STEP // world,
        log_every_n_steps=log_every_n_steps,
        use_distributed_sampler=False,
        logger=recorder,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RoutingRecord(near_ties=world == 1)],  # the one-process reference's near ties
    )
    module = MulaLightningModule(
        "mula-tiny-moe", overrides=OVERRIDES, lr=1e-2, min_lr=1e-3, warmup_steps=1, decay_steps=10,
        eps=ADAMW_EPS,
    )  # fmt: skip
    torch.manual_seed(seeded(0))  # the model is built in configure_model, inside fit
    trainer.fit(module, DataLoader(_micro_batches(rank, world), batch_size=None))
    return trainer


def _record(trainer: L.Trainer) -> dict[str, Any]:
    """The logged steps, and what `equality.assert_same_training` compares: each of STEP_LOSSES per
    step (`SERIES`) and the routing record."""
    logged = trainer.logger.losses()
    routing = next(c for c in trainer.callbacks if isinstance(c, RoutingRecord))
    rows = [logged[step] for step in sorted(logged)]
    return {
        "steps": sorted(logged),
        **{key: [row[i] for row in rows] for i, key in enumerate(SERIES)},
        **routing.as_dict(),
    }


def _two_ranks(rank: int, world: int) -> dict[str, dict[str, Any]]:
    lightning_env(rank, world)
    ddp = _fit(rank, world, "ddp")
    ep = _fit(rank, world, XPUMoEStrategy(expert_parallel_size=2))
    return {"ddp": _record(ddp), "ep": _record(ep)}


def test_train_loss_is_the_global_batch_mean_whatever_the_world_size() -> None:
    single = _fit(0, 1, "auto")
    reference = _record(single)
    assert reference["steps"] == list(range(STEPS))
    assert single.lightning_module.config.is_moe  # so the aux and z losses are checked too
    results = run_distributed(_two_ranks, 2)
    for rank, result in enumerate(results):
        for name, run in result.items():
            assert run["steps"] == list(range(STEPS)), (rank, name)
            assert_same_training(run, reference, series=SERIES, what=f"{name}, rank {rank}")


def test_train_loss_is_reduced_once_per_logged_step_only() -> None:
    """One all-reduce per logged step (every log_every_n_steps), none on the other steps."""
    calls: list[torch.Tensor] = []

    class _CountingStrategy(L.strategies.SingleDeviceStrategy):
        def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(tensor)
            return super().reduce(tensor, *args, **kwargs)

    trainer = _fit(0, 1, _CountingStrategy(device=torch.device("cpu")), log_every_n_steps=2)
    assert sorted(trainer.logger.losses()) == [1]  # Lightning logs step indices 1, 3, ... of 0..STEPS-1
    ours = [c for c in calls if c.is_floating_point()]  # Lightning reduces integer counters of its own
    assert len(ours) == 1 and ours[0].shape == (
        len(STEP_LOSSES[:-1]) + 1,
    )  # the 4 sums (no MTP) and the count
