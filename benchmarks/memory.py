"""Per-rank memory, measured next to the planner's prediction (`mula.plan`), and the planner's breakdown
for the paper presets.

Part 1 (measured): the tiny MoE (recipes' `mula-tiny-moe`, micro-batch 8 x 256 tokens per rank) on
4 gloo CPU ranks (1 thread each, expert-parallel size --ep), in one launch, for fp32 weights with
ZeRO-1 and bf16-true weights with ZeRO-2 (bf16 gradient reduction), each under every activation-
checkpointing level. Each rank builds the model as `XPUMoEStrategy` does, runs one training micro-batch
and reads its bytes with the functions `MemoryMetrics` and `MoEMetrics` log (`mem/param_bytes`,
`mem/grad_bytes`, `mem/activation_bytes`, `optim/state_bytes`); the table shows the largest rank.

Part 1b (measured, pipeline stages): the same model on 4 gloo CPU ranks in one launch, one real
optimizer step of 8 micro-batches (4 x 256 tokens) per layout with Lightning's Trainer and
`XPUMoEStrategy` (1F1B, GPipe and interleaved 1F1B at (P, E) = (2, 2), (4, 1), (2, 1) with DP = 2),
read from what `MemoryMetrics` and `MoEMetrics` log; each stage's largest rank against
`plan_stage` for that stage. Activations are the peak saved-tensor bytes over the step's schedule.

Part 2 (planned): the five paper presets at their recipe layouts on Aurora (`mula plan` on the recipe
files, 32 nodes = 384 tiles), and at the layouts Optimus ran on 256 nodes (`mula.plan.references`: 100B
E=12, P=4, 4 micro-batches of 1 sequence; 220B E=12, P=8, 8 of 1) at every checkpointing level.
Part 3 (planned): 220B at Optimus' layout from 32 to 1,024 nodes, the global batch growing with the ranks.

    python benchmarks/memory.py            # every part (parts 1 and 1b: about two minutes on 2 cores)
    python benchmarks/memory.py --skip_measured

Benchmarks print tables and never assert.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import markdown_table, median_range, run_gloo  # benchmarks/ is on sys.path when run as a script
from torch.utils.data import DataLoader

from mula import MulaConfig
from mula.plan import Layout, plan_memory
from mula.plan.command import scaling
from mula.plan.machines import load_machine
from mula.plan.memory import plan_stage
from mula.plan.recipe_reader import header_command
from mula.plan.references import OPTIMUS_RUNS
from mula.plan.settings import PlanInputs
from mula.plan.step_time import step_time

ROOT = Path(__file__).resolve().parents[1]
LEVELS: list[Any] = ["none", ["norms"], ["attention"], ["moe"], ["moe", "attention"], "full"]
SETUPS = {"fp32 / ZeRO-1": ("32-true", 1, "fp32"), "bf16-true / ZeRO-2": ("bf16-true", 2, "bf16")}
WORLD, MICRO, SEQ = 4, 8, 256
GB = 1e9


def _measure(rank: int, world: int, ep: int) -> dict[str, dict[str, int]]:
    from mula.training.memory_meter import SavedTensorMeter, grad_bytes, param_bytes
    from mula.training.module import MulaLightningModule
    from strategies.experts.expert_parallel import apply_expert_parallel
    from strategies.optim.sharded_optimizer import EPShardedAdamW
    from strategies.topology import build_topology

    rows = {}
    topo = build_topology(ep)
    for setup, (precision, zero, reduce) in SETUPS.items():
        for level in LEVELS:
            torch.manual_seed(0)
            module = MulaLightningModule("mula-tiny-moe", decay_steps=10, activation_checkpointing=level)
            module.configure_model()
            apply_expert_parallel(module, topo)
            if precision == "bf16-true":
                module.to(torch.bfloat16)
            named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            dtype = torch.bfloat16 if reduce == "bf16" else torch.float32
            opt = EPShardedAdamW.from_adamw(
                module.configure_optimizers()["optimizer"], named, topo, zero_stage=zero, reduce_dtype=dtype
            )
            gen = torch.Generator().manual_seed(rank)
            batch = torch.randint(0, module.config.vocab_size, (MICRO, SEQ + 1), generator=gen)
            with SavedTensorMeter(exclude=module.parameters()) as meter:
                loss = module._losses(batch)[0]
            loss.backward()
            opt.reduce_gradients()
            rows[f"{setup}|{json.dumps(level)}"] = {
                "params": param_bytes(module), "grads": grad_bytes(module, opt),
                "optimizer": opt.state_bytes(), "activations": meter.bytes,
            }  # fmt: skip
            opt.close()
    return rows


def measured_table(ep: int) -> str:
    """Part 1: measured (largest rank) vs planned bytes per component."""
    ranks = run_gloo(_measure, WORLD, ep)
    config = MulaConfig.from_name("mula-tiny-moe")
    rows = []
    for key in ranks[0]:
        setup, level = key.split("|")
        precision, zero, reduce = SETUPS[setup]
        layout = Layout(
            world_size=WORLD, ep_size=ep, micro_batch=MICRO, seq_len=SEQ, precision=precision,
            checkpointing=json.loads(level), shard_optimizer=True, zero_stage=zero, reduce_dtype=reduce,
            collectives="rooted",
        )  # fmt: skip
        plan = plan_memory(config, layout)
        predicted = {"params": plan.param_tensor_bytes, "grads": plan.grads, "optimizer": plan.optimizer,
                     "activations": plan.activations}  # fmt: skip
        cells = [
            f"{int(max(r[key][c] for r in ranks)):,} / {int(predicted[c]):,}"
            for c in ("params", "grads", "optimizer", "activations")
        ]
        rows.append([setup, level, *cells])
    caption = (
        f"tiny MoE, {WORLD} CPU ranks, E={ep}, micro-batch {MICRO} x {SEQ}: per-rank bytes, exact, measured "
        "(largest rank) / planned"
    )
    head = ["setup", "checkpointing", "params", "grads", "optimizer state", "activations"]
    return caption + "\n\n" + markdown_table(head, rows)


def _plan_recipe(name: str, nodes: int) -> tuple[dict[str, Any], list[float]]:
    """The `mula plan` command of a paper recipe's header (`--format=json --nodes N` added), run
    PLAN_RUNS times as the `mula` command in a fresh process: the plan, and each run's wall seconds."""
    args = header_command((ROOT / f"recipes/{name}.yaml").read_text(), "mula plan")
    command = [sys.executable, "-m", "mula", "plan", *args, "--format=json", f"--nodes={nodes}"]
    seconds = []
    for _ in range(PLAN_RUNS):
        start = time.perf_counter()
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
        seconds.append(time.perf_counter() - start)
    return json.loads(run.stdout), seconds


# (P, E, schedule, virtual stages, precision, checkpointing) on 4 ranks; DP = 4 / P
PIPELINES = [
    (2, 2, "1f1b", 1, "32-true", "none"),
    (2, 2, "gpipe", 1, "32-true", "none"),
    (2, 2, "interleaved-1f1b", 2, "32-true", "none"),
    (4, 1, "1f1b", 1, "32-true", ["attention"]),
    (2, 1, "1f1b", 1, "bf16-true", ["moe"]),
]
PIPE_MICRO, PIPE_STEPS_MB = 4, 8  # micro-batch sequences, micro-batches per step and data-parallel rank
PIPE_KEYS = ("mem/param_bytes", "mem/grad_bytes", "optim/state_bytes", "mem/activation_bytes")


def _measure_pipelines(rank: int, world: int) -> list[dict[str, float]]:
    # Lightning joins the process group already there as this rank (it must not launch its own)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", RANK=str(rank), WORLD_SIZE=str(world))
    import lightning.pytorch as L

    from callbacks import MemoryMetrics, MoEMetrics
    from mula.training.module import MulaLightningModule
    from strategies import XPUMoEStrategy

    rows = []
    for pp, ep, schedule, virtual, precision, level in PIPELINES:
        strategy = XPUMoEStrategy(expert_parallel_size=ep, pipeline_parallel_size=pp, pipeline_schedule=schedule,
                                  pipeline_virtual_stages=virtual)  # fmt: skip
        strategy.pipeline_microbatches = PIPE_STEPS_MB
        torch.manual_seed(0)
        module = MulaLightningModule("mula-tiny-moe", decay_steps=10, activation_checkpointing=level)
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=strategy, max_steps=1, precision=precision,
            log_every_n_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, use_distributed_sampler=False, callbacks=[MemoryMetrics(), MoEMetrics()],
        )  # fmt: skip
        gen = torch.Generator().manual_seed(rank)
        batch = torch.randint(
            0, module.config.vocab_size, (PIPE_STEPS_MB * PIPE_MICRO, SEQ + 1), generator=gen
        )
        trainer.fit(module, DataLoader([batch], batch_size=None))  # the step's whole batch
        logged = {k: float(trainer.callback_metrics[k]) for k in PIPE_KEYS}
        rows.append({**logged, "stage": strategy.topology.rank("pp")})
    return rows


def pipeline_table() -> str:
    """Part 1b: per pipeline stage, measured (the stage's largest rank) vs planned bytes."""
    ranks = run_gloo(_measure_pipelines, WORLD)
    config = MulaConfig.from_name("mula-tiny-moe")
    rows = []
    for i, (pp, ep, schedule, virtual, precision, level) in enumerate(PIPELINES):
        layout = Layout(
            world_size=WORLD, ep_size=ep, pp_size=pp, pp_schedule=schedule, pp_virtual_stages=virtual,
            micro_batch=PIPE_MICRO, seq_len=SEQ, micro_batches=PIPE_STEPS_MB, precision=precision,
            checkpointing=level, shard_optimizer=True, collectives="rooted",
        )  # fmt: skip
        desc = f"P={pp}, E={ep}, DP={WORLD // pp}, {schedule}" + (f" V={virtual}" if virtual > 1 else "")
        desc += f", {precision}, ckpt {json.dumps(level)}"
        for stage in range(pp):
            plan = plan_stage(config, layout, stage)
            mine = [r[i] for r in ranks if r[i]["stage"] == stage]
            got = {k: int(max(r[k] for r in mine)) for k in PIPE_KEYS}
            planned = (plan.param_tensor_bytes, plan.grads, plan.optimizer, plan.activations)
            cells = [f"{got[k]:,} / {v:,}" for k, v in zip(PIPE_KEYS, planned)]
            ratio = plan.activations / got["mem/activation_bytes"]
            rows.append([desc, stage, *cells, f"{ratio:.3f}", plan.activation_micro_batches])
    caption = (
        f"tiny MoE, {WORLD} CPU ranks, pipeline stages, {PIPE_STEPS_MB} micro-batches of {PIPE_MICRO} x {SEQ} "
        "per step: per-rank bytes of each stage, measured (largest rank of the stage) / planned"
    )
    head = ["layout", "stage", "params", "grads", "optimizer state", "activations (peak)",
            "activations planned / measured", "micro-batches in flight (planned)"]  # fmt: skip
    return caption + "\n\n" + markdown_table(head, rows)


def _row(
    name: str, layout: str, per: dict[str, int], fits: bool, step: float | None, mfu: float | None
) -> list[str]:
    """A planned layout's cells under `HEADER` (no step time: one empty cell)."""
    sizes = [
        f"{per[c] / GB:.1f}" for c in ("params", "grads", "optimizer", "activations", "buffers", "total")
    ]
    timing = [""] if step is None else [f"{step:.2f}", f"{100 * mfu:.1f}"]
    return [name, layout, *sizes, "yes" if fits else "no", *timing]


HEADER = ["model", "layout", "params", "grads", "optimizer", "activations", "buffers", "total GB",
          "fits 64 GB", "step s", "MFU %"]  # fmt: skip
PAPER = ["mula-1b", "mula-7b-a1b", "mula-20b-a2b", "mula-100b-a7b", "mula-220b-a10b"]
PLAN_RUNS = 3


def recipe_table(nodes: int) -> str:
    """Part 2a: each paper recipe at the layout its header gives, as the `mula` command plans it, with
    the command's wall time (median [min-max] of PLAN_RUNS fresh processes)."""
    rows = []
    for name in PAPER:
        r, seconds = _plan_recipe(name, nodes)
        lay = r["layout"]
        desc = (
            f"E={lay['ep_size']}, P={lay['pp_size']}, {lay['precision']}, mb {lay['micro_batch']}, "
            f"ckpt {lay['checkpointing']}"
        )
        row = _row(name, desc, r["per_rank_bytes"], r["fits"], r["step_time_s"], r["mfu"])
        rows.append([*row, median_range(seconds, ".2f")])
    caption = (
        f"paper recipes on {nodes} Aurora nodes ({12 * nodes} tiles): the `mula plan` command of each "
        f"recipe's header with `--nodes {nodes}`; plan s = that command's wall time"
    )
    return caption + "\n\n" + markdown_table([*HEADER, "plan s"], rows)


# Optimus' layouts (the paper): E inside a node, P stages of one node each, selective recomputation
def optimus_table() -> str:
    """Part 2b: the paper's layouts at 256 nodes as Optimus ran them (`mula.plan.references`), at each
    activation-checkpointing level."""
    machine = load_machine("aurora")
    rows = []
    for name, run in OPTIMUS_RUNS.items():
        config = MulaConfig.from_name(name)
        for checkpointing in ("none", ["moe"], "full"):
            layout = run.layout(checkpointing=checkpointing)
            plan, time = plan_memory(config, layout), step_time(config, layout, machine, run.global_batch())
            desc = (
                f"E={layout.ep_size}, P={layout.pp_size}, {layout.micro_batches} x mb 1, ckpt {checkpointing}"
            )
            fits = plan.total <= machine.device_bytes
            rows.append(_row(name, desc, plan.per_rank_bytes(), fits, time.step_time_s, time.mfu))
    caption = (
        "Optimus' layouts on 256 Aurora nodes (3072 tiles), micro-batch 1, global batch 3072 "
        "(`mula.plan.references`)"
    )
    return caption + "\n\n" + markdown_table(HEADER, rows)


def scaling_table(node_counts: list[int]) -> str:
    """Part 3: Mula-220B-A10B at Optimus' layout (8 sequences per rank, no recompute), weak scaling from
    the first of `node_counts`: the global batch grows with the data-parallel ranks, as in the paper."""
    machine = load_machine("aurora")
    config, run = MulaConfig.from_name("mula-220b-a10b"), OPTIMUS_RUNS["mula-220b-a10b"]
    base = node_counts[0]
    inputs = PlanInputs(config, run.layout(base), run.global_batch(base), machine.device_bytes, "", machine)
    rows = [
        [row["nodes"], row["ranks"], run.global_batch(row["nodes"]), f"{100 * row['weak_efficiency']:.1f} %",
         f"{row['weak_tokens_per_s']:,.0f}"]
        for row in scaling(inputs, base, node_counts)
    ]  # fmt: skip
    caption = (
        f"Mula-220B-A10B, Optimus' layout (E=12, P=8, 8 micro-batches of 1 per rank), from {base} nodes "
        f"({12 * base} tiles, global batch {run.global_batch(base)}) growing with the tiles"
    )
    head = ["nodes", "tiles", "global batch", "weak efficiency", "weak tokens/s"]
    return caption + "\n\n" + markdown_table(head, rows)


def main() -> None:
    """Print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel size of the measured runs")
    parser.add_argument("--nodes", type=int, default=32, help="Aurora nodes for the paper presets")
    parser.add_argument("--skip_measured", action="store_true", help="only the planned tables")
    args = parser.parse_args()
    if not args.skip_measured:
        print(measured_table(args.ep), end="\n\n")
        print(pipeline_table(), end="\n\n")
    print(recipe_table(args.nodes), end="\n\n")
    print(optimus_table(), end="\n\n")
    print(scaling_table([32, 64, 128, 256, 512, 1024]))


if __name__ == "__main__":
    main()
