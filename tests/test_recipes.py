"""Every YAML in recipes/ parses and instantiates through the `mula` CLI (no model is built)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from mula.cli import MulaCLI, main

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
MODEL_RECIPES = sorted(RECIPES.glob("mula-*.yaml"))
PAPER = ["mula-1b", "mula-7b-a1b", "mula-20b-a2b", "mula-100b-a7b", "mula-220b-a10b"]


@pytest.fixture(autouse=True)
def _cli_argv(monkeypatch):
    """The CLI is driven through `args`; pytest's own argv must not look like CLI arguments."""
    monkeypatch.setattr("sys.argv", ["mula"])
    monkeypatch.setenv("WANDB_MODE", "offline")


class _Probe(MulaCLI):
    """Parses and instantiates trainer, module and data module, then stops before running anything."""

    def _run_subcommand(self, subcommand: str) -> None:
        pass


def probe(*configs: Path, extra: tuple[str, ...] = ()) -> _Probe:
    args = ["fit"]
    for c in configs:
        args += ["-c", str(c)]
    return _Probe(args=args + list(extra))


def test_all_recipe_files_are_covered():
    names = {p.stem for p in MODEL_RECIPES}
    assert names == {"mula-tiny-moe", "mula-tiny-dense", *PAPER}
    assert {p.name for p in (RECIPES / "strategies").glob("*.yaml")} >= {"ddp.yaml"}
    assert list((RECIPES / "datasets").glob("*.yaml"))


@pytest.mark.parametrize("recipe", MODEL_RECIPES, ids=lambda p: p.stem)
def test_model_recipe_instantiates_without_building_the_model(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative run/data paths stay in the sandbox
    cli = probe(recipe)
    assert cli.model.model is None  # built later, in configure_model (meta / sharded for big models)
    assert cli.model.config.name == recipe.stem
    assert cli.datamodule.seq_len <= cli.model.config.max_position_embeddings
    loggers = {type(lg).__name__ for lg in cli.trainer.loggers}
    assert loggers == {"CSVLogger", "WandbLogger"}
    assert cli.trainer.log_dir.startswith(str(Path("runs", recipe.stem)))
    assert any(type(cb).__name__ == "Throughput" for cb in cli.trainer.callbacks)
    callbacks = {type(cb).__name__ for cb in cli.trainer.callbacks}
    assert {"MulaSaveConfig", "FaultTolerantCheckpoint", "PreemptionHandler", "AnomalyGuard"} <= callbacks
    assert cli.trainer.default_root_dir.endswith(str(Path("runs", recipe.stem)))
    assert cli.trainer.gradient_clip_val == 1.0


@pytest.mark.parametrize("name", PAPER)
def test_paper_recipes_use_the_paper_hyperparameters(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = probe(RECIPES / f"{name}.yaml")
    m, d, t = cli.model, cli.datamodule, cli.trainer
    assert (d.seq_len, d.global_batch_size) == (2048, 3072)
    assert (m.lr, m.min_lr, m.warmup_steps, m.weight_decay, m.betas, m.eps) == (
        4e-4,
        4e-5,
        2500,
        0.1,
        (0.9, 0.95),
        1e-8,
    )
    assert m.config.router_aux_loss_coef == 0.01
    assert t.precision == "bf16-mixed"
    assert d.data_dir.endswith("data/olmoe-mix-0924")
    tokens = t.max_steps * 3072 * 2048
    expected = 4.06e12 if name in ("mula-1b", "mula-7b-a1b") else 100e9
    assert math.isclose(tokens, expected, rel_tol=1e-3)
    # the size in the name: total and active parameters in billions
    total, active = m.config.num_params() / 1e9, m.config.num_active_params() / 1e9
    if name == "mula-1b":
        assert 1.0 < total < 1.5 and active == total
    else:
        want_total, want_active = (float(x) for x in name.removeprefix("mula-").replace("b", "").split("-a"))
        assert abs(total - want_total) / want_total < 0.05, total
        assert want_active <= active < 1.35 * want_active, active  # "A1B" is OLMoE's 1.3B active


def test_strategy_yaml_composes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = probe(RECIPES / "mula-tiny-moe.yaml", RECIPES / "strategies" / "ddp.yaml")
    assert type(cli.trainer.strategy).__name__ == "DDPStrategy"


@pytest.mark.parametrize("strategy", sorted((RECIPES / "strategies").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_strategy_yaml_parses_with_a_model_recipe(strategy, capsys):
    """Parse only: some strategy files name accelerators (xpu) that this machine does not have."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(RECIPES / "mula-tiny-moe.yaml"), "-c", str(strategy), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["strategy"]["class_path"]


def test_dataset_yaml_validates_against_mula_prepare(capsys):
    for path in sorted((RECIPES / "datasets").glob("*.yaml")):
        with pytest.raises(SystemExit) as exit_info:
            main(["prepare", "-c", str(path), "--print_config"])
        assert exit_info.value.code == 0
        printed = yaml.safe_load(capsys.readouterr().out)
        names = [s["name"] for s in printed["sources"]]
        assert names == ["dclm", "starcoder", "pes2o", "arxiv", "open-web-math", "algebraic-stack", "wiki"]
        assert printed["output_dir"] == "data/olmoe-mix-0924"


def test_print_config_round_trips(capsys, tmp_path):
    """`--print_config` output is itself a valid recipe that resolves to the same settings."""
    with pytest.raises(SystemExit):
        main(
            [
                "fit",
                "-c",
                str(RECIPES / "mula-tiny-moe.yaml"),
                "--model.overrides.num_layers=2",
                "--print_config",
            ]
        )
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(capsys.readouterr().out)
    cli = probe(dumped)
    assert cli.model.config.num_layers == 2 and cli.model.config.num_experts == 16
