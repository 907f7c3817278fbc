"""`mula plan` and the memory planner in one process: exact parameter/gradient/optimizer bytes and
activations within 10 % of a measured fit (`MemoryMetrics`, `MoEMetrics`), the recipe parsing of
`mula plan`, pipeline arithmetic, and the start-of-run check of `mula fit`."""

from __future__ import annotations

import csv
import itertools
import json
import re

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from callbacks import MemoryMetrics
from callbacks.moe_metrics import MoEMetrics
from mula import MulaConfig
from mula.cli import main
from mula.plan import Layout, plan_memory
from mula.plan.activations import in_flight_micro_batches, peak_activations, schedule_order
from mula.plan.settings import plan_inputs
from mula.training.module import MulaLightningModule

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
TINY_MOE = ROOT / "recipes" / "mula-tiny-moe.yaml"
CONFIG = MulaConfig.from_name("mula-tiny-moe", vocab_size=512, num_layers=2, max_position_embeddings=256)
# the first block dense (a SwiGLU of width 384), the second MoE
DENSE_FIRST = MulaConfig.from_name(
    "mula-tiny-moe", vocab_size=512, num_layers=2, max_position_embeddings=256, num_dense_layers=1,
    intermediate_size=384,
)  # fmt: skip
B, T = 4, 128


def stage_layers(num_layers: int, layout: Layout) -> list[list[int]]:
    """The blocks a rank of each pipeline stage holds (`Layout.stage_holdings`)."""
    config = MulaConfig.from_name("mula-tiny-moe", num_layers=num_layers)
    return [held.blocks for held in layout.stage_holdings(config)]


def _fit(tmp_path, checkpointing, precision: str, config: MulaConfig = CONFIG) -> dict[str, float]:
    """Two optimizer steps of 2 micro-batches each, logged every step; the last logged row."""
    ids = torch.randint(0, CONFIG.vocab_size, (16, T + 1), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(
        TensorDataset(ids), batch_size=B, collate_fn=lambda rows: torch.stack([r[0] for r in rows])
    )
    torch.manual_seed(0)
    module = MulaLightningModule(config, warmup_steps=1, activation_checkpointing=checkpointing)
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", devices=1, precision=precision, logger=L.loggers.CSVLogger(tmp_path),
        callbacks=[MemoryMetrics(), MoEMetrics()], enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, log_every_n_steps=1, accumulate_grad_batches=2, max_epochs=-1,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)
    with open(trainer.logger.log_dir + "/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("mem/param_bytes")]
    return {k: float(v) for k, v in rows[-1].items() if v}


@pytest.mark.parametrize(
    ("checkpointing", "precision", "config"),
    # bf16 weights (bf16-true) need the sharded optimizer's fp32 masters: tests/test_plan_measured.py
    [
        ("none", "32-true", CONFIG),
        (["moe"], "32-true", CONFIG),
        ("full", "bf16-mixed", CONFIG),
        (["attention"], "bf16-mixed", CONFIG),
        ("none", "32-true", DENSE_FIRST),
        (["moe"], "bf16-mixed", DENSE_FIRST),
    ],
)
def test_single_process_fit_matches_the_plan(tmp_path, checkpointing, precision, config) -> None:
    logged = _fit(tmp_path, checkpointing, precision, config)
    layout = Layout(
        micro_batch=B, seq_len=T, micro_batches=2, precision=precision, checkpointing=checkpointing
    )
    plan = plan_memory(config, layout)
    assert plan.param_tensor_bytes == plan.params == logged["mem/param_bytes"]
    assert plan.grads == logged["mem/grad_bytes"]
    # torch AdamW: MoEMetrics counts the parameters with their two moments
    assert plan.params + plan.optimizer == logged["optim/state_bytes"]
    assert plan.activations == pytest.approx(logged["mem/activation_bytes"], rel=0.10)


@pytest.mark.parametrize(
    ("name", "kw", "no_decay"),
    [
        ("mula-tiny-moe", {}, ["embed.weight"]),
        ("mula-tiny-moe", {"tie_embeddings": True}, ["embed.weight", "*norm*"]),
        ("mula-tiny-dense", {}, []),
        ("mula-tiny-moe", {"num_dense_layers": 2, "intermediate_size": 256}, ["embed.weight", "*norm*"]),
    ],
)
def test_planned_parameters_are_the_optimizers_in_its_order(name, kw, no_decay) -> None:
    """The planner's torch-free parameter list (names, shapes, groups, order) is what the module hands
    the optimizer, so the flat buffers it lays out are the optimizer's."""
    from mula.plan.parameters import model_parameters

    config = MulaConfig.from_name(name, **kw)
    with torch.device("meta"):
        module = MulaLightningModule(config, no_decay=no_decay)
        module.configure_model()
    names = {id(p): n for n, p in module.named_parameters()}
    real = [
        (names[id(p)], tuple(p.shape), gi) for gi, g in enumerate(module.param_groups()) for p in g["params"]
    ]
    planned = [(p.name, p.shape, p.group) for p in model_parameters(config, tuple(no_decay))]
    assert planned == real and len({g for _, _, g in real}) == (2 if no_decay else 1)


def test_plan_reads_recipes_like_fit() -> None:
    trainer = {"devices": 8, "num_nodes": 2, "precision": "bf16-true", "accelerator": "cpu", "strategy": {
        "class_path": "strategies.XPUMoEStrategy",
        "init_args": {"expert_parallel_size": 4, "optimizer_options": {"zero_stage": 2, "reduce_dtype": "bf16"}},
    }}  # fmt: skip
    model = {"config": "mula-tiny-moe", "activation_checkpointing": ["moe", "attention"]}
    inputs = plan_inputs(trainer, model, {"micro_batch_size": 2, "seq_len": 64, "global_batch_size": 64})
    lay = inputs.layout
    assert (lay.world_size, lay.ep_size, lay.edp_cp_size, lay.micro_batches) == (16, 4, 4, 2)
    assert (lay.zero_stage, lay.reduce_bytes, lay.param_bytes, lay.shard_optimizer) == (2, 2, 2, True)
    assert lay.collectives == "rooted" and lay.checkpointing == ["moe", "attention"]
    # pipeline settings (issue 12's XPUMoEStrategy arguments) are read when a strategy has them
    piped = {**trainer, "strategy": {"class_path": "strategies.XPUMoEStrategy", "init_args": {
        "expert_parallel_size": 2, "pipeline_parallel_size": 2, "pipeline_schedule": "gpipe",
        "pipeline_stage_layers": [1, 3],
    }}}  # fmt: skip
    lay = plan_inputs(piped, model, {"micro_batch_size": 2, "seq_len": 64, "global_batch_size": 64}).layout
    assert (lay.pp_size, lay.pp_schedule, lay.pp_stage_layers, lay.replica_size, lay.micro_batches) == (
        2, "gpipe", [1, 3], 8, 4,
    )  # fmt: skip
    ddp = plan_inputs({"devices": 2, "strategy": "ddp"}, {"config": "mula-tiny-dense"}, {})
    assert not ddp.layout.shard_optimizer and ddp.layout.world_size == 2


def test_pipeline_stages_split_state_and_hold_micro_batches_per_schedule() -> None:
    cfg = MulaConfig.from_name("mula-tiny-moe", num_layers=8)
    base = Layout(world_size=8, ep_size=2, micro_batch=2, seq_len=64, micro_batches=8, precision="bf16-true",
                  shard_optimizer=True, collectives="rooted")  # fmt: skip
    assert [len(r) for r in stage_layers(8, base.replace(pp_size=4))] == [2, 2, 2, 2]
    assert [len(r) for r in stage_layers(7, base.replace(pp_size=2))] == [4, 3]
    assert [len(r) for r in stage_layers(8, base.replace(pp_size=2, pp_stage_layers=[3, 5]))] == [3, 5]
    with pytest.raises(ValueError, match="sums to 6 but the model has 8 layers"):
        stage_layers(8, base.replace(pp_size=2, pp_stage_layers=[3, 3]))
    # interleaved: P x V stage counts as the strategy takes them, stage s holding stages s, s + P
    looped = base.replace(pp_size=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=2)
    assert stage_layers(8, looped.replace(pp_stage_layers=[3, 2, 2, 1])) == [[0, 1, 2, 5, 6], [3, 4, 7]]
    with pytest.raises(ValueError, match="has 2 entries but the pipeline has 4 stages"):
        stage_layers(8, looped.replace(pp_stage_layers=[4, 4]))
    one, four = plan_memory(cfg, base), plan_memory(cfg, base.replace(pp_size=4))
    # a stage holds a quarter of the blocks (plus the embedding or head) on a quarter of the ranks: the
    # sharded state per rank stays about the same, the replicated weights shrink
    assert four.params < one.params / 2
    assert four.optimizer == pytest.approx(one.optimizer, rel=0.5)
    assert in_flight_micro_batches(base.replace(pp_size=4), 0) == 4  # 1F1B: P on stage 0
    assert in_flight_micro_batches(base.replace(pp_size=4), 3) == 1
    assert in_flight_micro_batches(base.replace(pp_size=4, pp_schedule="gpipe"), 0) == 8
    inter = base.replace(pp_size=4, pp_schedule="interleaved-1f1b", pp_virtual_stages=2)
    assert in_flight_micro_batches(inter, 0) == 5.5  # P + (P - 1) / V: 11 virtual-stage micro-batches
    gpipe = plan_memory(cfg, base.replace(pp_size=4, pp_schedule="gpipe"))
    assert gpipe.activations > four.activations and gpipe.activation_micro_batches == 8
    # the strategy's sentence (one ParallelLayout refuses it for both)
    with pytest.raises(
        ValueError, match="not divisible by pipeline_parallel_size=3 x expert_parallel_size=2 = 6"
    ):
        base.replace(pp_size=3)


def test_interleaved_schedule_order_is_torchs() -> None:
    """The planner walks interleaved 1F1B in the order torch builds it (`ScheduleInterleaved1F1B`'s
    per-rank op list; 1F1B and GPipe: tests/test_plan_measured_pipeline.py against measured runs)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    for p, v, m in itertools.product((2, 3, 4), (1, 2, 3), (4, 6, 8, 12)):
        if m < p or m % max(1, m // p):
            continue  # torch's own constraints: at least P micro-batches, whole rounds
        torch_sizes = SimpleNamespace(
            n_local_stages=v, microbatches_per_round=m // max(1, m // p), pp_group_size=p, _n_microbatches=m
        )
        layout = Layout(world_size=p, pp_size=p, pp_schedule="interleaved-1f1b", pp_virtual_stages=v,
                        micro_batches=m)  # fmt: skip
        for rank in range(p):
            ops = ScheduleInterleaved1F1B._calculate_single_rank_operations(torch_sizes, rank)
            expected = [
                (a.stage_index // p, 1 if a.computation_type == _ComputationType.FORWARD else -1)
                for a in ops
                if a is not None
            ]
            assert schedule_order(layout, rank) == expected, (p, v, m, rank)
    # P = 2, V = 2, 4 micro-batches: stage 0 holds 3 micro-batches of its first virtual stage and 2 of
    # its second, later 4 and 1; stage 1 at most 2 and 1. Which is the peak depends on the virtual
    # stages' own bytes; 5 virtual-stage micro-batches make 2.5 whole ones
    layout = Layout(world_size=2, pp_size=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=2,
                    micro_batches=4)  # fmt: skip
    assert peak_activations(layout, 0, [10, 1]) == (40 + 1, 2.5)
    assert peak_activations(layout, 0, [1, 10]) == (3 + 20, 2.5)
    assert peak_activations(layout, 1, [1, 10]) == (2 + 10, 1.5)
    assert peak_activations(layout.replace(pp_schedule="gpipe", pp_virtual_stages=1), 1, [7]) == (28, 4)
    assert peak_activations(layout.replace(pp_schedule="1f1b", pp_virtual_stages=1), 1, [7]) == (7, 1)


def test_plan_command_json_and_paper_recipe_on_aurora(capsys) -> None:
    main(["plan", "-c", str(ROOT / "recipes/mula-20b-a2b.yaml"), "-c",
          str(ROOT / "recipes/strategies/aurora-xpu-moe.yaml"), "--machine=aurora", "--nodes=32", "--format=json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert set(out["per_rank_bytes"]) == {"params", "grads", "optimizer", "activations", "buffers", "total"}
    assert out["device_bytes"] == 64 * 10**9 and out["layout"]["world_size"] == 384
    assert out["layout"]["ep_size"] == 12 and out["fits"] == (out["per_rank_bytes"]["total"] <= 64e9)
    assert out["step_time_s"] > 0 and 0 < out["mfu"] < 1
    assert out["tokens_per_s"] == pytest.approx(3072 * 2048 / out["step_time_s"])
    (sent,) = out["comm_bytes_per_step"]  # one pipeline stage; the volumes are tests/test_plan_volumes.py's
    assert sent["all_to_all"] > 0 and sent["grad_reduce"] > 0 and sent["pipeline"] == 0
    (kinds,) = out["collective_bytes_per_step"]  # the same by kind: the rows' all-to-all, the rooted pairs
    assert kinds["sent"]["all_to_all"] > sent["all_to_all"] and kinds["sent"]["send_recv"] == 0


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["mula"])
    monkeypatch.delenv("MULA_TRACEBACK", raising=False)
    return tmp_path


def test_fit_stops_when_the_plan_exceeds_the_device_and_the_flag_overrides(
    capsys, sandbox, monkeypatch
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(TINY_MOE), "--device_memory_gb=0.01"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert re.match(
        r"mula: error: predicted 0\.\d GB per rank on a 0\.0 GB device .* try .*--memory_check=false", err[0]
    )
    assert not (sandbox / "data").exists() and not (sandbox / "runs").exists()  # before any work

    class Reached(Exception):
        pass

    def lock(*_args):
        raise Reached

    monkeypatch.setattr("mula.commands.lightning_cli.lock_run_dir_before_launch", lock)
    with pytest.raises(Reached):  # past the check: the next step of before_fit
        main(["fit", "-c", str(TINY_MOE), "--device_memory_gb=0.01", "--memory_check=false"])
    with pytest.raises(Reached):  # the demo fits the host's memory
        main(["fit", "-c", str(TINY_MOE)])


def test_plan_and_search_refuse_what_the_strategy_refuses(capsys, monkeypatch) -> None:
    """`mula plan` stops with the strategy's own sentence on a layout it cannot run, and `--search`
    proposes only layouts that pass the same rules (`mula.layout.rules`)."""
    from mula.commands.entry import main as mula_command
    from mula.layout.rules import check_micro_batches

    monkeypatch.setattr("sys.argv", ["mula"])
    recipe = [
        "-c",
        str(ROOT / "recipes/mula-220b-a10b.yaml"),
        "-c",
        str(ROOT / "recipes/strategies/aurora-pipeline.yaml"),
    ]
    aurora = ["--machine=aurora", "--nodes=32"]
    for bad, said in [
        (
            "--trainer.strategy.init_args.optimizer_options.zero_stage=2",
            "zero_stage=2 reduces after every backward",
        ),
        ("--data.micro_batch_size=16", "needs at least pipeline_parallel_size=8 micro-batches"),
        ("--data.global_batch_size=3000", "is not divisible by data-parallel world size 48"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            mula_command(["plan", *recipe, *aurora, bad])
        assert exit_.value.code == 2 and said in capsys.readouterr().err
    mula_command(["plan", *recipe, *aurora, "--search", "--format=json"])
    rows = json.loads(capsys.readouterr().out)["search"]
    assert rows and any(r["P"] > 1 for r in rows)
    for r in rows:
        assert r["P"] == 1 or r["zero_stage"] == 1
        check_micro_batches("1f1b", r["P"], 3072 // (r["micro_batch"] * 384 // r["P"]))
