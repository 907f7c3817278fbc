"""The planner's reference cases (mula/plan/references.py): Optimus' published layouts fit, and `mula plan`
on the shipped recipe files reproduces them exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mula.config import MulaConfig
from mula.entry import main as mula_command
from mula.plan.machines import load_machine
from mula.plan.memory import plan_memory
from mula.plan.references import OPTIMUS_RUNS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(OPTIMUS_RUNS))
def test_optimus_layouts_fit_a_tile_at_256_nodes(name):
    run = OPTIMUS_RUNS[name]
    assert run.global_batch() == 3072  # DP x EP x BATCH_SIZE at 256 nodes
    assert run.global_batch(32) == 384  # the weak-scaling curve grows it with the ranks
    layout = run.layout()
    assert (layout.world_size, layout.micro_batch, layout.micro_batches) == (3072, 1, run.pp_size)
    tile = load_machine(run.machine).device_bytes
    for checkpointing in ("none", ["moe"], "full"):
        assert plan_memory(MulaConfig.from_name(name), run.layout(checkpointing=checkpointing)).total <= tile


@pytest.mark.parametrize("name", sorted(OPTIMUS_RUNS))
def test_mula_plan_on_the_recipe_files_is_the_reference_layout(name, capsys, monkeypatch):
    run = OPTIMUS_RUNS[name]
    monkeypatch.chdir(ROOT)
    args = ["plan", "-c", f"recipes/{name}.yaml", "-c", "recipes/strategies/aurora-pipeline.yaml"]
    args += [f"--trainer.strategy.init_args.pipeline_parallel_size={run.pp_size}"]
    args += ["--model.activation_checkpointing=none", "--data.micro_batch_size=1"]
    mula_command([*args, "--machine=aurora", f"--nodes={run.nodes}", "--format=json"])
    plan = json.loads(capsys.readouterr().out)
    layout = plan["layout"]
    assert (layout["world_size"], layout["ep_size"], layout["pp_size"]) == (3072, run.ep_size, run.pp_size)
    assert (layout["micro_batch"], layout["micro_batches"]) == (1, run.batch_per_rank)
    reference = plan_memory(MulaConfig.from_name(name), run.layout())
    assert plan["per_rank_bytes"] == reference.per_rank_bytes()
    assert plan["fits"]
