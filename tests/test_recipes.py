"""Every YAML in recipes/ parses and instantiates through the `mula` CLI (no model is built)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from mula.cli import main
from mula.commands.lightning_cli import MulaCLI
from mula.plan.recipe_reader import header_command

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
MODEL_RECIPES = sorted(RECIPES.glob("mula-*.yaml"))
PAPER = ["mula-1b", "mula-7b-a1b", "mula-20b-a2b", "mula-100b-a7b", "mula-220b-a10b"]
STRATEGIES = sorted((RECIPES / "strategies").glob("*.yaml"))
# the dense GPT shapes of Frontier's 3D-parallel study (arXiv 2312.12705), on frontier.yaml's GCDs
FRONTIER = sorted((RECIPES / "frontier").glob("*.yaml"))


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
    assert {p.name for p in (RECIPES / "base").glob("*.yaml")} == {"run.yaml", "paper.yaml", "tiny.yaml"}
    assert {p.stem for p in FRONTIER} == {"mula-gpt-22b", "mula-gpt-175b", "mula-gpt-1t"}


def _including_files() -> list[Path]:
    return [p for p in sorted(RECIPES.rglob("*.yaml")) if "config" in yaml.safe_load(p.read_text())]


@pytest.mark.parametrize("path", _including_files(), ids=lambda p: str(p.relative_to(RECIPES)))
def test_files_that_include_another_use_dotted_keys(path):
    """jsonargparse applies `config: <file>` first, then the including file's own keys; a nested
    `trainer:` block there would replace the included file's whole trainer section (loggers,
    callbacks) instead of overriding single keys, so such files write `trainer.max_steps: ...`."""
    doc = yaml.safe_load(path.read_text())
    nested = [k for k, v in doc.items() if isinstance(v, dict) and "." not in k]
    assert not nested, f"{path.name}: write {nested} as dotted keys"


@pytest.mark.parametrize("name", PAPER)
def test_paper_recipe_holds_only_its_differences(name):
    """A paper recipe names its base and what makes it different: model, run directory, token budget."""
    doc = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    assert doc["config"] == "base/paper.yaml"
    allowed = {"config", "trainer.default_root_dir", "trainer.max_steps", "model.config", "model.decay_steps",
               "data.micro_batch_size"}  # fmt: skip
    assert set(doc) <= allowed, set(doc) - allowed


@pytest.mark.parametrize("recipe", MODEL_RECIPES + FRONTIER, ids=lambda p: p.stem)
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
    assert t.precision == "bf16-true"  # bf16 weights, fp32 masters in the sharded optimizer
    assert t.strategy.keeps_fp32_master_weights
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


@pytest.mark.parametrize("recipe", MODEL_RECIPES, ids=lambda p: p.stem)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda p: p.stem)
def test_every_strategy_yaml_parses_with_every_model_recipe(strategy, recipe, capsys):
    """Parse only: some strategy files name accelerators (xpu) that this machine does not have."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(recipe), "-c", str(strategy), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["strategy"]["class_path"]
    callbacks = [c["class_path"] for c in printed["trainer"]["callbacks"]]
    assert "callbacks.FaultTolerantCheckpoint" in callbacks  # the model recipe's callbacks are kept
    if "xpu-moe" in strategy.stem:
        assert callbacks[-1] == "callbacks.MoEMetrics"  # appended by the strategy file


def test_run_directory_flag_moves_every_logger(tmp_path, monkeypatch):
    """Loggers have no save_dir of their own: they write under trainer.default_root_dir, however set."""
    monkeypatch.chdir(tmp_path)
    cli = probe(RECIPES / "mula-tiny-moe.yaml", extra=("--trainer.default_root_dir=runs/other",))
    assert {lg.save_dir for lg in cli.trainer.loggers} == {str(Path("runs", "other"))}
    assert cli.trainer.log_dir == str(Path("runs", "other", "version_0"))
    names = {lg.class_path.rsplit(".", 1)[-1]: lg.init_args.name for lg in cli.config.fit.trainer.logger}
    assert names["WandbLogger"] == "other"  # the W&B run is named after its run directory


def test_dataset_yaml_validates_against_mula_prepare(capsys):
    for path in sorted((RECIPES / "datasets").glob("*.yaml")):
        with pytest.raises(SystemExit) as exit_info:
            main(["prepare", "-c", str(path), "--print_config"])
        assert exit_info.value.code == 0
        printed = yaml.safe_load(capsys.readouterr().out)
        names = [s["name"] for s in printed["sources"]]
        assert names == ["dclm", "starcoder", "pes2o", "arxiv", "open-web-math", "algebraic-stack", "wiki"]
        assert printed["output_dir"] == "data/olmoe-mix-0924"
        assert printed["tokenizer_path"] == "olmo"  # OLMo's tokenizer, shipped with ai2-olmo-eval


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


@pytest.mark.parametrize("name", PAPER)
def test_paper_recipe_header_layout_fits_as_planned(name, capsys, monkeypatch):
    """Each paper recipe's header names a layout, the `mula plan` command that prices it and the
    `mula fit` command that trains it: the plan fits the 64 GB tile with the header's numbers, and the
    fit command uses the same files and overrides."""
    import json
    import re

    from mula.commands.entry import (
        main as mula_command,  # what `mula` runs: the plan is read without Lightning
    )

    monkeypatch.chdir(ROOT)
    text = (RECIPES / f"{name}.yaml").read_text()
    plan_args = header_command(text, "mula plan")
    mula_command(["plan", *plan_args, "--format=json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["device_bytes"] == 64 * 10**9
    said = re.search(
        r"Planned on 32 Aurora nodes \(384 tiles\): ([\d.]+) GB per rank .*, ([\d.]+) s per step", text
    )
    assert said, "the header states the planned memory and step time"
    assert float(said.group(1)) == round(plan["per_rank_bytes"]["total"] / 1e9, 1)
    assert float(said.group(2)) == round(plan["step_time_s"], 2)
    fit_args = header_command(text, "mpiexec -n $((NNODES * 12)) --ppn 12 mula fit")
    launcher = {"--trainer.num_nodes=$NNODES", "--trainer.accelerator=xpu", "--trainer.devices=12"}
    assert [a for a in fit_args if a not in launcher] == [
        a for a in plan_args if a not in ("--machine=aurora", "--nodes=32")
    ]


@pytest.mark.parametrize("recipe", FRONTIER, ids=lambda p: p.stem)
def test_frontier_recipe_header_layout_fits_as_planned(recipe, capsys, monkeypatch):
    """Each Frontier recipe's header names its T x P x D layout and the `mula plan` command that prices
    it on frontier.yaml: the plan fits the 64 GB GCD with at least 10 GB free (the rule the layouts were
    chosen by, docs/scaling.md), with the header's numbers, and the strategy the recipe builds is the
    header's layout with T inside a node."""
    import json
    import re

    from mula.commands.entry import main as mula_command

    monkeypatch.chdir(ROOT)
    text = recipe.read_text()
    mula_command(["plan", *header_command(text, "mula plan"), "--format=json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["device_bytes"] == 64 * 10**9
    assert plan["device_bytes"] - plan["per_rank_bytes"]["total"] >= 10 * 10**9
    said = re.search(r"Planned on (\d+) Frontier nodes: ([\d.]+) GB per rank, ([\d.]+) s per step", text)
    assert said, "the header states the planned memory and step time"
    assert float(said.group(2)) == round(plan["per_rank_bytes"]["total"] / 1e9, 1)
    assert float(said.group(3)) == round(plan["step_time_s"], 2)
    layout = re.search(r"\((\d+) nodes, ([\d,]+) GCDs\): T=(\d+) .* D=(\d+) data-parallel", text, re.S)
    nodes, gcds, t, d = (
        int(layout.group(1)),
        int(layout.group(2).replace(",", "")),
        *map(int, layout.group(3, 4)),
    )
    stages = re.search(r"P=(\d+) pipeline stages", text)
    p = int(stages.group(1)) if stages else 1
    assert nodes == int(said.group(1)) and gcds == 8 * nodes == plan["layout"]["world_size"] == t * p * d
    init = yaml.safe_load(text)["trainer.strategy"]["init_args"]
    assert (init["tensor_parallel_size"], init.get("pipeline_parallel_size", 1)) == (t, p) and t <= 8


LONG_CONTEXT = {  # recipe -> (tokens per sequence, nodes it is planned on)
    "mula-7b-a1b-32k": (32768, 32),
    "mula-7b-a1b-128k": (131072, 16),
}


@pytest.mark.parametrize("name", list(LONG_CONTEXT))
def test_long_context_recipe_parses_with_positions_for_its_sequences(name, tmp_path, monkeypatch):
    """The long-context recipes instantiate; RoPE reaches their sequences (max positions, a raised base) and
    a step holds the paper's 3072 x 2048 tokens."""
    monkeypatch.chdir(tmp_path)
    cli = probe(RECIPES / "long-context" / f"{name}.yaml")
    config, data = cli.model.config, cli.datamodule
    seq, _ = LONG_CONTEXT[name]
    assert config.name == "mula-7b-a1b" and data.seq_len == seq == config.max_position_embeddings
    assert config.rope_theta == 500000.0 and config.router_aux_loss_coef == 0.01  # paper.yaml's kept
    assert data.seq_len * data.global_batch_size == 3072 * 2048 and data.micro_batch_size == 1
    assert cli.trainer.default_root_dir.endswith(str(Path("runs", name)))
    assert cli.trainer.max_steps * data.seq_len * data.global_batch_size == pytest.approx(100e9, rel=1e-3)


@pytest.mark.parametrize("name", list(LONG_CONTEXT))
def test_long_context_recipe_header_is_the_searched_layout_and_fits(name, capsys, monkeypatch):
    """The header's `mula plan` command fits the 64 GB tile and the node's host memory with the header's
    numbers, its layout is the first row `--search` lists for it, and the `mula fit` command uses the same
    files and overrides."""
    import json
    import re

    from mula.commands.entry import main as mula_command

    monkeypatch.chdir(ROOT)
    text = (RECIPES / "long-context" / f"{name}.yaml").read_text()
    plan_args = header_command(text, "mula plan")
    mula_command(["plan", *plan_args, "--search", "--format=json"])
    plan = json.loads(capsys.readouterr().out)
    _, nodes = LONG_CONTEXT[name]
    assert plan["fits"] and plan["host_fits"] and plan["device_bytes"] == 64 * 10**9
    assert plan["layout"]["world_size"] == nodes * 12 and plan["layout"]["cp_size"] > 1
    said = re.search(
        rf"Planned on {nodes} Aurora nodes \({nodes * 12} tiles\): ([\d.]+) GB per rank .*?host ([\d.]+) GB per "
        r"node .*?, ([\d.]+) s per step",
        text,
        re.S,
    )
    assert said, "the header states the planned device and host memory and step time"
    assert float(said.group(1)) == round(plan["per_rank_bytes"]["total"] / 1e9, 1)
    assert float(said.group(2)) == round(plan["host_bytes_per_node"] / 1e9, 1)
    assert float(said.group(3)) == round(plan["step_time_s"], 2)
    best, lay = plan["search"][0], plan["layout"]
    assert (best["E"], best["P"], best["T"], best["C"], best["micro_batch"], best["checkpointing"],
            best["zero_stage"], best["bf16_weights"], best["offload"]) == (
        lay["ep_size"], lay["pp_size"], lay["tp_size"], lay["cp_size"], lay["micro_batch"], lay["checkpointing"],
        lay["zero_stage"], lay["precision"] == "bf16-true", lay["offload"])  # fmt: skip
    fit_args = header_command(text, "mpiexec -n $((NNODES * 12)) --ppn 12 mula fit")
    assert [a for a in fit_args if a != "--trainer.num_nodes=$NNODES"] == [
        a for a in plan_args if a not in ("--machine=aurora", f"--nodes={nodes}")
    ]
