"""`mula plan --dry_run`: one rank of a 96-rank layout built by the real strategy on the meta device over
torch's fake process group; its parameter, gradient and optimizer bytes equal the planner's exactly.

The planner's numbers are themselves checked against allocations of real runs
(tests/test_plan_measured*.py); here the same optimizer, built for ranks of a layout far larger than
this machine could run, must report the planner's bytes for that rank's stage.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from test_recipes import RECIPES, ROOT

from mula.plan.command import PLAN_OPTIONS
from mula.plan.dry_run import MEASURED, dry_run, dry_run_matches
from mula.plan.memory import plan_stage, stage_params
from mula.plan.parameters import model_parameters
from mula.plan.recipe_reader import read_plan_command
from mula.plan.settings import plan_inputs

OPTIONS = {name: (tp, default) for name, (tp, default, _) in PLAN_OPTIONS.items()}
# 96 ranks: 8 nodes of 12 devices; the tiny MoE (16 experts, 4 blocks) with E = 4
LAYOUT = [
    "--trainer.accelerator=cpu", "--trainer.devices=12", "--trainer.num_nodes=8",
    "--trainer.strategy.init_args.expert_parallel_size=4", "--data.micro_batch_size=1",
    "--data.global_batch_size=384",
]  # fmt: skip
PIPELINE = [
    "-c",
    str(RECIPES / "mula-tiny-moe.yaml"),
    "-c",
    str(RECIPES / "strategies" / "pipeline.yaml"),
    *LAYOUT,
]
PLAIN = [
    "-c",
    str(RECIPES / "mula-tiny-moe.yaml"),
    "-c",
    str(RECIPES / "strategies" / "xpu-moe.yaml"),
    *LAYOUT,
]


def _inputs(argv: list[str]):
    kwargs = read_plan_command(argv, OPTIONS)
    assert kwargs is not None, argv
    return plan_inputs(kwargs["trainer"], kwargs["model"], kwargs["data"]), kwargs


@pytest.mark.parametrize(
    ("argv", "rank", "stage", "ep_rank"),
    [
        (PIPELINE, 0, 0, 0),  # first stage, first EP rank
        (PIPELINE, 7, 1, 3),  # rank 7 = stage 1, EP rank 3 (EP innermost, then the stage)
        (PIPELINE, 91, 0, 3),  # last data-parallel index, first stage
        (PIPELINE, 95, 1, 3),  # the last rank: last stage
        (
            PIPELINE + ["--trainer.strategy.init_args.optimizer_options={zero_stage: 1, reduce_dtype: bf16}"],
            50,
            0,
            2,
        ),
        (PLAIN, 95, 0, 3),  # no pipeline: every rank holds every block
        (PLAIN + ["--trainer.strategy.init_args.optimizer_options={zero_stage: 2}"], 13, 0, 1),
        # offload: the state on the host (meta in a dry run), the device keeps the tail buckets' state
        (PLAIN + ["--trainer.strategy.init_args.optimizer_options={offload: true}"], 6, 0, 2),
        (
            PIPELINE
            + ["--trainer.strategy.init_args.optimizer_options={offload: true, offload_tail_buckets: 1}"],
            95,
            1,
            3,
        ),
    ],
)
def test_dry_run_bytes_equal_the_plan(argv, rank, stage, ep_rank):
    inputs, kwargs = _inputs(argv)
    assert inputs.layout.world_size == 96
    result = dry_run(inputs, kwargs["trainer"], kwargs["model"], rank)
    assert (result["rank"], result["stage"], result["ep_rank"]) == (rank, stage, ep_rank)
    assert result["edp_rank"] == rank // (inputs.layout.pp_size * 4)
    assert result["allocated_bytes"] == 0
    plan = plan_stage(inputs.config, inputs.layout, stage)
    for name, field in MEASURED.items():
        assert result["bytes"][name]["plan"] == getattr(plan, field)
        assert result["bytes"][name]["dry_run"] == getattr(plan, field), name
    assert dry_run_matches(result)
    offload = "offload" in " ".join(argv)
    assert (result["bytes"]["host optimizer"]["dry_run"] > 0) == offload
    # the checkpoint: every expert stack a global DTensor, master/exp_avg/exp_avg_sq per parameter, and
    # the stage's parameters at their global (unsliced) size
    lay = inputs.layout
    held = lay.stage_holdings(inputs.config)[stage]
    specs = stage_params(
        model_parameters(inputs.config, tuple(lay.no_decay)), held.blocks, held.first, held.last
    )
    ck = result["checkpoint"]
    assert ck["model_dtensors"] == sum(p.is_expert for p in specs) > 0
    assert ck["optimizer_tensors"] == 3 * len(specs)
    assert ck["global_elements"] == sum(math.prod(p.shape) for p in specs)


TENSOR = [
    "-c", str(RECIPES / "mula-tiny-dense.yaml"), "-c", str(RECIPES / "strategies" / "tensor-parallel.yaml"),
    "--trainer.accelerator=cpu", "--trainer.devices=12", "--trainer.num_nodes=8", "--data.micro_batch_size=1",
    "--data.global_batch_size=96",
]  # fmt: skip
NO_SP = "--trainer.strategy.init_args.sequence_parallel=false"


@pytest.mark.parametrize(
    ("extra", "rank"),
    [
        ([], 0),  # T = 2 with sequence parallelism (the recipe), the sharded optimizer over W / T = 48 ranks
        (["--trainer.strategy.init_args.tensor_parallel_size=4"], 95),
        ([NO_SP, "--data.global_batch_size=192"], 37),
        # the tiny MoE model: experts whole on each TP rank, sliced over E = 4 (T x E = 8 ranks)
        (["--model.config=mula-tiny-moe", "--trainer.strategy.init_args.expert_parallel_size=4"], 13),
        # T = 2 x P = 2 with SP: rank 3 holds the last stage's TP shards (rank = (d * P + s) * T + t)
        (["--trainer.strategy.init_args.pipeline_parallel_size=2"], 3),
        # DeepSeek-V3's MLA: the up projections split by heads, the down projections and latent norms whole;
        # the tiny preset (a q latent) with SP, then Moonlight-16B-A3B (no q latent: q_proj split) without SP
        # at E = 4
        (["--model.config=deepseek-v3-tiny"], 1),
        (
            [
                "--model.config=deepseek-v3-16b",
                NO_SP,
                "--trainer.strategy.init_args.expert_parallel_size=4",
                "--data.global_batch_size=192",
            ],
            37,
        ),
        # Qwen3's per-head QK-norm: its head_dim weights whole on every TP rank; the tiny preset with SP,
        # then the 15B-A2B preset without SP at E = 4
        (["--model.config=qwen3-moe-tiny"], 5),
        (
            [
                "--model.config=qwen3-moe-15b-a2b",
                NO_SP,
                "--trainer.strategy.init_args.expert_parallel_size=4",
                "--data.global_batch_size=192",
            ],
            38,
        ),
    ],
)
def test_tensor_parallel_dry_run_bytes_equal_the_plan(extra, rank):
    """Tensor-parallel layouts: each rank's local shards in the sharded optimizer's flat buffers, as planned."""
    inputs, kwargs = _inputs([*TENSOR, *extra])
    assert inputs.layout.world_size == 96 and inputs.layout.tp_size > 1
    result = dry_run(inputs, kwargs["trainer"], kwargs["model"], rank)
    assert result["allocated_bytes"] == 0
    assert result["stage"] == (rank // inputs.layout.tp_size) % inputs.layout.pp_size
    plan = plan_stage(inputs.config, inputs.layout, result["stage"])
    for name, field in MEASURED.items():
        assert result["bytes"][name]["dry_run"] == getattr(plan, field), name
    assert dry_run_matches(result)


def _mula(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mula", "plan", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_cli_dry_run_prints_the_table():
    run = _mula(*PIPELINE, "--dry_run", "--dry_run_rank=94")
    assert run.returncode == 0, run.stderr[-3000:]
    head = "dry run: rank 94 of 96 (pipeline stage 1, EP rank 2, EDP rank 11)"
    assert head in run.stdout
    table = run.stdout[run.stdout.index(head) :].splitlines()
    for name in MEASURED:
        line = next(line for line in table if line.strip().startswith(name))
        assert line.rstrip().endswith("yes"), line


def test_cli_dry_run_of_a_four_dimensional_aurora_layout():
    """`mula plan --dry_run` of Mula-7B-A1B at 32k tokens on 16 Aurora nodes at C = 2 x T = 2 x P = 8 x E = 2
    (the Aurora pipeline strategy with CP, TP and SP on top): every measured byte of the rank it builds
    equals the plan's."""
    s = "--trainer.strategy.init_args."
    run = _mula(
        "-c", str(RECIPES / "long-context" / "mula-7b-a1b-32k.yaml"),
        "-c", str(RECIPES / "strategies" / "aurora-pipeline.yaml"),
        f"{s}context_parallel_size=2", f"{s}tensor_parallel_size=2", f"{s}sequence_parallel=true",
        f"{s}expert_parallel_size=2", "--machine=aurora", "--nodes=16", "--dry_run",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "192 ranks (aurora tile): E=2, P=8 (1f1b), T=2 with SP, C=2" in run.stdout
    table = run.stdout[run.stdout.index("dry run: rank") :].splitlines()
    for name in MEASURED:
        line = next(line for line in table if line.strip().startswith(name))
        assert line.rstrip().endswith("yes"), line


def test_cli_dry_run_bad_rank_is_one_sentence():
    run = _mula(*PIPELINE, "--dry_run", "--dry_run_rank=96")
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith("mula: error: --dry_run_rank=96 is not a rank of the planned 96 ranks")
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_sharded_optimizer_refuses_meta_parameters_outside_a_dry_run():
    """Meta parameters are a forgotten materialisation unless the process group is the fake one."""
    import torch

    from strategies.optim.sharded_optimizer import EPShardedAdamW

    p = torch.nn.Parameter(torch.empty(8, device="meta"))
    with pytest.raises(ValueError, match="must be materialised on one device"):
        EPShardedAdamW([p], [("w", p)])


CONTEXT = [
    "-c", str(RECIPES / "mula-tiny-moe.yaml"), "-c", str(RECIPES / "strategies" / "context-parallel.yaml"),
    "--trainer.accelerator=cpu", "--trainer.devices=12", "--trainer.num_nodes=8", "--data.micro_batch_size=1",
    "--data.global_batch_size=96",
]  # fmt: skip
STAGES = "--trainer.strategy.init_args.pipeline_parallel_size=2"
TP_SP = [
    "--trainer.strategy.init_args.tensor_parallel_size=2",
    "--trainer.strategy.init_args.sequence_parallel=true",
]


@pytest.mark.parametrize(
    ("extra", "rank", "stage"),
    [
        ([STAGES], 5, 0),  # C = 2 x P = 2: rank = (d * P + s) * C + c, so rank 5 (d = 1, c = 1) holds stage 0
        ([STAGES, "--trainer.strategy.init_args.expert_parallel_size=2"], 95, 1),  # C = 2 x E = 2 x P = 2
        # C = 2 x T = 2 with SP: rank 7's TP shards, its state sharded over the W / T = 48 replicas
        (
            [
                "--trainer.strategy.init_args.tensor_parallel_size=2",
                "--trainer.strategy.init_args.sequence_parallel=true",
            ],
            7,
            0,
        ),
        # C = 2 x T = 2 x P = 2 with SP: rank = ((d * P + s) * C + c) * T + t, so rank 7 (c = t = 1) holds stage 1
        ([STAGES, *TP_SP], 7, 1),
        # and E = 2: rank = (((d * P + s) * E + e) * C + c) * T + t; rank 90 is d = 5, s = 1, e = 0, c = 1, t = 0
        ([STAGES, *TP_SP, "--trainer.strategy.init_args.expert_parallel_size=2"], 90, 1),
    ],
)
def test_context_parallel_dry_run_bytes_equal_the_plan(extra, rank, stage):
    """C x P, C x T and C x T x P (x E) layouts: each rank's (stage's) parameters, gradients and optimizer
    shard (over the W / (P x T) replicas, CP peers included), as planned."""
    inputs, kwargs = _inputs([*CONTEXT, *extra])
    lay = inputs.layout
    assert (lay.world_size, lay.cp_size) == (96, 2) and lay.pp_size * lay.tp_size > 1
    result = dry_run(inputs, kwargs["trainer"], kwargs["model"], rank)
    assert result["allocated_bytes"] == 0
    assert result["stage"] == stage
    plan = plan_stage(inputs.config, lay, stage)
    for name, field in MEASURED.items():
        assert result["bytes"][name]["dry_run"] == getattr(plan, field), name
    assert dry_run_matches(result)


@pytest.mark.parametrize("sizes", [dict(ep_size=2), dict(tp_size=2, ep_size=2), dict(cp_size=2, ep_size=2)])
def test_default_dry_run_rank_is_the_first_rank_of_the_stage(sizes):
    """The rank `--dry_run` builds by default holds the planned stage, and is that stage's first rank, for
    layouts with T and C inside the stage (`stage * E` was a rank of stage 0 there)."""
    from mula.plan.command import default_dry_run_rank
    from mula.plan.layout import Layout

    layout = Layout(world_size=32, pp_size=2, **sizes)
    for stage in range(2):
        rank = default_dry_run_rank(layout, stage)
        holds = [r for r in range(32) if layout.parallel.coordinates(r).pp == stage]
        assert rank == min(holds)


def test_cli_dry_run_without_an_end_of_schedule_is_one_sentence():
    run = _mula(*PIPELINE, "--trainer.max_steps=-1", "--dry_run")
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith(
        "mula: error: --dry_run builds the recipe's optimizer and learning-rate schedule"
    )
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


PLANNED = sorted(p for p in RECIPES.rglob("*.yaml") if "\n#   mula plan" in p.read_text())


@pytest.mark.parametrize("path", PLANNED, ids=[str(p.relative_to(RECIPES)) for p in PLANNED])
def test_every_planned_recipe_dry_runs_at_its_header_layout(path):
    """Each recipe whose header says how it was planned (`#   mula plan -c ... --machine=M --nodes=N`)
    builds, on the meta device, the rank `mula plan --dry_run` picks (the first rank of the largest stage),
    with every measured byte equal to the plan's."""
    from mula.plan.command import default_dry_run_rank, plan_result
    from mula.plan.machines import load_machine
    from mula.plan.recipe_reader import header_command

    kwargs = read_plan_command(header_command(path.read_text(), "mula plan"), OPTIONS)
    assert kwargs is not None, path
    assert kwargs["machine"] and kwargs["nodes"], "the header names the machine and the nodes"
    inputs = plan_inputs(
        kwargs["trainer"], kwargs["model"], kwargs["data"], machine=load_machine(kwargs["machine"]),
        nodes=kwargs["nodes"],
    )  # fmt: skip
    stage = plan_result(inputs)["stage"]
    result = dry_run(inputs, kwargs["trainer"], kwargs["model"], default_dry_run_rank(inputs.layout, stage))
    assert result["stage"] == stage
    plan = plan_stage(inputs.config, inputs.layout, stage)
    for name, field in MEASURED.items():
        assert result["bytes"][name]["dry_run"] == getattr(plan, field), name
    assert dry_run_matches(result)
