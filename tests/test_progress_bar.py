"""mula.training.progress_bar: the training bar counts optimizer steps against max_steps, also under gradient
accumulation, and `mula fit` shows it unless the recipe turns the bar off."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import lightning.pytorch as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel
from test_recipes import RECIPES, probe

from mula.training.progress_bar import StepProgressBar, step_range


@pytest.fixture(autouse=True)
def _cli_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["mula"])
    monkeypatch.setenv("WANDB_MODE", "offline")


class Recording(StepProgressBar):
    """The bar's count and total after each training micro-batch, next to the trainer's optimizer steps."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int, Any]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar = self.train_progress_bar
        self.seen.append((trainer.global_step, bar.n, bar.total))


def train(bar: Recording, model: L.LightningModule | None = None, **trainer_kwargs: Any) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[bar], **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(model or BoringModel())
    return trainer


def test_bar_counts_optimizer_steps_against_max_steps_under_accumulation():
    bar = Recording()
    trainer = train(bar, max_steps=3, accumulate_grad_batches=2)
    assert trainer.global_step == 3 and len(bar.seen) == 6  # 6 micro-batches, 3 optimizer steps
    assert [n for _, n, _ in bar.seen] == [step for step, _, _ in bar.seen] == [0, 1, 1, 2, 2, 3]
    assert {total for _, _, total in bar.seen} == {3}


def test_bar_without_max_steps_counts_the_epochs_steps():
    bar = Recording()
    trainer = train(bar, max_epochs=1, limit_train_batches=5, accumulate_grad_batches=2)
    # Lightning steps after micro-batches 2 and 4 and on the epoch's last one (5)
    assert trainer.global_step == 3
    assert [n for _, n, _ in bar.seen] == [0, 1, 1, 2, 3]
    assert {total for _, _, total in bar.seen} == {3}


class LoggingModel(BoringModel):
    """Logs its loss as MulaLightningModule logs `train/loss`: for the loggers, not as a progress-bar metric."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train/loss", out["loss"])
        return out


def test_bar_reads_the_metrics_on_logging_steps_only():
    """Between logging steps the bar moves its count and reads nothing from the device; on logging steps
    it shows `train/loss` with Lightning's progress-bar metrics."""
    asked = []

    class Showing(Recording):
        def get_metrics(self, trainer, pl_module):
            asked.append(trainer.global_step)
            return super().get_metrics(trainer, pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            self.seen[-1] = (*self.seen[-1], self.train_progress_bar.postfix)

    bar = Showing()
    train(bar, LoggingModel(), max_steps=6, log_every_n_steps=3)
    # steps 1, 2, 4 and 5 ask nothing (Lightning's bar also asks before the first step and at the epoch's end)
    assert set(asked) == {0, 3, 6} and [a for a in asked if a][:2] == [3, 6]
    assert [n for _, n, _, _ in bar.seen] == [1, 2, 3, 4, 5, 6]
    assert ["train/loss" in (postfix or "") for *_, postfix in bar.seen] == [False] * 2 + [True] * 4


def test_step_range():
    def trainer(**kw: Any) -> Any:
        return SimpleNamespace(**{"max_steps": -1, "global_step": 0, "accumulate_grad_batches": 1, **kw})

    assert step_range(trainer(max_steps=300, global_step=150, num_training_batches=10**9)) == (150, 300)
    assert step_range(trainer(num_training_batches=7, accumulate_grad_batches=2)) == (0, 4)
    assert step_range(trainer(num_training_batches=float("inf"), accumulate_grad_batches=2)) == (0, None)


def test_fit_shows_the_step_bar_unless_turned_off(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = probe(RECIPES / "mula-tiny-moe.yaml")
    assert type(cli.trainer.progress_bar_callback) is StepProgressBar
    cli = probe(RECIPES / "mula-tiny-moe.yaml", extra=("--trainer.enable_progress_bar=false",))
    assert cli.trainer.progress_bar_callback is None
    own = "--trainer.callbacks+={class_path: lightning.pytorch.callbacks.TQDMProgressBar}"
    cli = probe(RECIPES / "mula-tiny-moe.yaml", extra=(own,))
    assert type(cli.trainer.progress_bar_callback).__name__ == "TQDMProgressBar"


def test_resumed_run_counts_on_from_its_checkpoints_step(tmp_path):
    first = train(Recording(), max_steps=2, accumulate_grad_batches=2)
    first.save_checkpoint(tmp_path / "step2.ckpt")
    bar = Recording()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[bar], max_steps=4, accumulate_grad_batches=2,
    )  # fmt: skip
    trainer.fit(BoringModel(), ckpt_path=tmp_path / "step2.ckpt")
    assert trainer.global_step == 4
    assert [n for _, n, _ in bar.seen] == [step for step, _, _ in bar.seen] == [2, 3, 3, 4]
    assert {total for _, _, total in bar.seen} == {4} and bar.train_progress_bar.initial == 2
