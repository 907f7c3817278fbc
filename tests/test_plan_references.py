"""The planner's reference cases (mula/plan/references.py): Optimus' published layouts fit, and `mula plan`
on the shipped recipe files reproduces them exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mula.commands.entry import main as mula_command
from mula.model.config import MulaConfig
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


def test_weak_scaling_loses_to_contention_beyond_one_network_group():
    import dataclasses

    from mula.plan.command import scaling
    from mula.plan.settings import PlanInputs

    aurora = load_machine("aurora")
    assert aurora.cross_group_slowdown(64) == 1.0  # one Dragonfly group
    ratio = aurora.inter_node_gbps / (aurora.global_gbps_per_node / aurora.tiles_per_node)
    assert aurora.cross_group_slowdown(128) == pytest.approx(
        1 + 0.5 * (ratio - 1)
    )  # half the traffic crosses
    run, config = OPTIMUS_RUNS["mula-220b-a10b"], MulaConfig.from_name("mula-220b-a10b")

    def curve(machine):
        inputs = PlanInputs(config, run.layout(32), run.global_batch(32), machine.device_bytes, "", machine)
        return {r["nodes"]: r["weak_efficiency"] for r in scaling(inputs, 32, [32, 512, 1024])}

    with_groups, without = curve(aurora), curve(dataclasses.replace(aurora, nodes_per_group=None))
    assert with_groups[512] == pytest.approx(without[512])  # a stage's 64 nodes stay in one group
    assert with_groups[1024] < without[1024] - 0.05  # 128 nodes per stage: two groups
    assert 0.8 < with_groups[1024] < 0.95  # the paper: about 90 % at 12,288 tiles
