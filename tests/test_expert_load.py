"""Expert load you can see: per-layer metrics, moe_load.csv, the heatmap (file and W&B image), `mula report`.

A short Lightning run of a tiny MoE with the demo's loggers (CSV and offline W&B) in which two experts
of every layer can never be chosen (a router bias of -10 on them): `dead_experts` must say 2, the
counts in moe_load.csv must be the routing's, and `mula report` must write PNGs of the expected size.
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from PIL import Image
from torch.utils.data import DataLoader

from callbacks import ExpertLoad, MoEMetrics
from mula.cli import main
from mula.commands.report import find_metrics, read_metrics
from mula.model.moe import iter_moe_layers
from mula.training.module import MulaLightningModule

TINY = dict(num_layers=2, hidden_size=32, num_heads=2, vocab_size=64, num_experts=8, top_k=2,
            expert_intermediate_size=32, max_position_embeddings=64, router_bias_update_rate=1e-9,
            capacity_factor=1.0)  # fmt: skip
STEPS, LOG_EVERY, TOKENS = 6, 2, 2 * 2 * 16  # 2 micro-batches of 2 x 16 tokens per step


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    module = MulaLightningModule("mula-tiny-moe", overrides=TINY, lr=1e-3, warmup_steps=0)
    module.configure_model()
    with torch.no_grad():
        for _, layer in iter_moe_layers(module.model):
            layer.router.bias[6:] = -10.0  # experts 6 and 7 never win a top-k choice
    data = torch.randint(0, 64, (STEPS * 4, 17), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        accumulate_grad_batches=2,
        log_every_n_steps=LOG_EVERY,
        default_root_dir=root,
        logger=[CSVLogger(root, name=""), WandbLogger(save_dir=root, project="mula", mode="offline")],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ExpertLoad(plot_every_n_steps=4), MoEMetrics()],
    )
    trainer.fit(module, DataLoader(list(data), batch_size=2))
    import wandb

    wandb.finish()
    return root


def test_per_layer_metrics_and_counts_file(run_dir: Path) -> None:
    metrics = find_metrics(run_dir)
    series = read_metrics(metrics)
    for i in range(TINY["num_layers"]):
        dead = series[f"moe/layer_{i}/dead_experts"]
        assert [step for step, _ in dead] == list(range(LOG_EVERY - 1, STEPS, LOG_EVERY))
        assert all(value == 2.0 for _, value in dead)
        assert all(value >= 1.0 for _, value in series[f"moe/layer_{i}/load_imbalance"])
    assert series["moe/load_imbalance_global"]
    with open(metrics.parent / "moe_load.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steps = sorted({int(r["step"]) for r in rows})
    assert steps == [step for step, _ in series["moe/layer_0/dead_experts"]]  # the same rows
    assert len(rows) == len(steps) * TINY["num_layers"] * TINY["num_experts"]
    for step in steps:
        for layer in range(TINY["num_layers"]):
            tokens = [int(r["tokens"]) for r in rows if int(r["step"]) == step and int(r["layer"]) == layer]
            assert sum(tokens) == TOKENS * TINY["top_k"] and tokens[6] == tokens[7] == 0


def test_dropped_fractions_are_logged_and_recorded(run_dir: Path) -> None:
    """The capacity (1.0: 8 slots per expert for 64 choices, 6 experts open) drops choices every step:
    each layer's fraction is logged on the logging steps and written to moe_dropped.csv alike."""
    metrics = find_metrics(run_dir)
    series = read_metrics(metrics)
    with open(metrics.parent / "moe_dropped.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    logged = list(range(LOG_EVERY - 1, STEPS, LOG_EVERY))
    for i in range(TINY["num_layers"]):
        dropped = series[f"moe/layer_{i}/dropped_fraction"]
        assert [step for step, _ in dropped] == logged
        # at least the choices beyond 6 experts' 8 slots: 1 - 48 / 64
        assert all(0.25 - 1e-6 <= value < 1.0 for _, value in dropped)
        recorded = [(int(r["step"]), float(r["dropped_fraction"])) for r in rows if int(r["layer"]) == i]
        assert [s for s, _ in recorded] == logged
        torch.testing.assert_close([v for _, v in recorded], [v for _, v in dropped])
    assert [step for step, _ in series["moe/dropped_fraction"]] == logged


def test_heatmap_saved_and_logged_to_wandb(run_dir: Path) -> None:
    png = find_metrics(run_dir).parent / "moe_load.png"
    with Image.open(png) as image:
        assert image.size == (1200, 450)
    images = list(run_dir.glob("wandb/offline-run-*/files/media/images/moe/expert_load_*.png"))
    assert len(images) >= 2  # at step 4 and at the end


def test_mula_report_writes_the_plots(run_dir: Path, tmp_path: Path, capsys) -> None:
    main(["report", str(run_dir), "--output", str(tmp_path)])
    written = {Path(line.split()[-1]).name for line in capsys.readouterr().out.splitlines()}
    assert {
        "losses.png",
        "lr.png",
        "load_imbalance.png",
        "expert_load.png",
        "dropped_fraction.png",
    } <= written
    sizes = {"losses.png": (700, 400), "lr.png": (700, 400), "expert_load.png": (1200, 450)}
    for name, size in sizes.items():
        with Image.open(tmp_path / name) as image:
            assert image.size == size
            darkest, lightest = image.convert("L").getextrema()
            assert lightest - darkest > 100  # drawn, not blank


def test_mula_report_refuses_a_directory_without_metrics(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "holds no metrics.csv" in capsys.readouterr().err


def test_dense_first_blocks_are_named_by_block_index(tmp_path: Path) -> None:
    """With the first block dense, the MoE blocks 1 and 2 are logged and written as layers 1 and 2 (the
    block index), their tokens those of the step's routing; block 0 has no row."""
    torch.manual_seed(0)
    overrides = {**TINY, "num_layers": 3, "num_dense_layers": 1, "intermediate_size": 32}
    module = MulaLightningModule("mula-tiny-moe", overrides=overrides, lr=1e-3, warmup_steps=0)
    data = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, accumulate_grad_batches=2, log_every_n_steps=1, default_root_dir=tmp_path,
        logger=CSVLogger(tmp_path, name=""), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[ExpertLoad(plot_every_n_steps=0)], max_epochs=-1,
    )  # fmt: skip
    trainer.fit(module, DataLoader(list(data), batch_size=2))
    metrics = find_metrics(tmp_path)
    names = {k for k in read_metrics(metrics) if k.startswith("moe/layer_")}
    assert names == {f"moe/layer_{i}/{m}" for i in (1, 2) for m in ("load_imbalance", "dead_experts")}
    with open(metrics.parent / "moe_load.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {int(r["layer"]) for r in rows} == {1, 2}
    for step in {int(r["step"]) for r in rows}:
        for layer in (1, 2):
            tokens = [int(r["tokens"]) for r in rows if int(r["step"]) == step and int(r["layer"]) == layer]
            assert sum(tokens) == TOKENS * TINY["top_k"]
