"""The DeepSeek-V3 recipes: they instantiate through the `mula` CLI (no model built), and `mula plan` gives
the memory and step time their headers state, fitting the device."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_recipes import probe

from mula.commands.entry import main as mula_command
from mula.plan.recipe_reader import header_command

ROOT = Path(__file__).resolve().parents[1]
# recipe -> (what its header's plan line starts with, device GB)
RECIPES = {
    "deepseek-v3-16b": ("Planned on 1 H100 node (8 GPUs)", 80),
    "deepseek-v3-1.1t": ("Planned on 192 Aurora nodes (2304 tiles)", 64),
}


CPU = ("--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1")


@pytest.fixture(autouse=True)
def _cli_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["mula"])
    monkeypatch.setenv("WANDB_MODE", "offline")


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_instantiates_with_the_preset(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # on this CPU host: the recipe's devices and nodes (XPU tiles for the 1.1T) replaced
    cli = probe(ROOT / "recipes" / f"{name}.yaml", extra=CPU)
    config = cli.model.config
    assert config.name == name and config.is_mla and config.num_shared_experts
    assert config.router_scoring == "sigmoid" and config.router_aux_loss_coef == 1.25e-5  # not paper.yaml's


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_header_states_the_plan(name, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    text = (ROOT / "recipes" / f"{name}.yaml").read_text()
    mula_command(["plan", *header_command(text, "mula plan"), "--format=json"])
    plan = json.loads(capsys.readouterr().out)
    where, device_gb = RECIPES[name]
    assert plan["fits"] and plan["device_bytes"] == device_gb * 10**9
    said = re.search(re.escape(where) + r": ([\d.]+) GB per rank .*?, ([\d.]+) s per step", text, re.S)
    assert said, "the header states the planned memory and step time"
    assert float(said.group(1)) == round(plan["per_rank_bytes"]["total"] / 1e9, 1)
    assert float(said.group(2)) == round(plan["step_time_s"], 2)
