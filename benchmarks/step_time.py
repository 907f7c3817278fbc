"""The planner's step time (`mula.plan.step_time`) against measured step times on this CPU host.

First `mula calibrate --devices 2` measures this host at the benchmark model's shapes (matmul rates
per rank with both ranks busy, and every collective's latency and bandwidth over message sizes; or
`--calibration FILE` reads a machine file it wrote). The planner prices each layout with it: compute
at the measured rate of the model's matmuls, each collective by its own alpha + beta * bytes curve
times the calls the layout makes (`comm_volumes`' `*_calls`, checked against real runs in
tests/test_plan_volumes.py).

Then, in interleaved rounds (every layout once per round), a small MoE (uniform routing, the model's
balanced-routing assumption) trains full optimizer steps of one global batch -- forward, backward,
gradient reduction, the sharded AdamW (native collectives) -- in each layout:

  1 rank          one process (the other waits);
  DP=2 ZeRO-1/2   two data-parallel ranks with the sharded optimizer;
  E=2             expert parallelism (all-to-all dispatch), also with every block recomputed;
  P=2             two pipeline stages, 1F1B and GPipe.

Each row: the planner's prediction (`step_time` with the measured machine), the measured seconds
per step (slowest rank, median of the steps of each round; median [min-max] over rounds) and
measured / predicted (median [min-max] over rounds), and the predicted parts. Benchmarks print
tables and never assert.

    python benchmarks/step_time.py --doc docs/benchmarks.md
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from doc_sections import host_line, write_section  # benchmarks/ is on sys.path when run as a script
from rounds import by_case, run_gloo, spread

from mula import MulaConfig
from mula.calibrate.command import calibrate
from mula.layout_rules import micro_batches_per_step
from mula.module import MulaLightningModule
from mula.plan import Layout
from mula.plan.layout import check_runnable
from mula.plan.machines import Machine, load_machine
from mula.plan.step_time import step_time
from strategies.experts.expert_parallel import apply_expert_parallel
from strategies.optim.sharded_optimizer import EPShardedAdamW
from strategies.pipeline.schedule import PipelineRunner
from strategies.pipeline.split import split_model
from strategies.topology import ExpertParallelTopology, topology_from_layout

SECTION = "## step time"
PARTS = ("compute_s", "all_to_all_s", "grad_sync_s", "param_gather_s", "pipeline_s")
DTYPES = {"32-true": torch.float32, "bf16-true": torch.bfloat16}


@dataclasses.dataclass
class Case:
    """One row of the table: a layout of `world` ranks (1: the calibration run, on rank 0 alone)."""

    name: str
    world: int = 2
    ep: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    zero: int = 1
    checkpointing: Any = "none"


CASES = [
    Case("1 rank", world=1),
    Case("DP=2 ZeRO-1"),
    Case("DP=2 ZeRO-2", zero=2),
    Case("E=2", ep=2),
    Case("E=2, full recompute", ep=2, checkpointing="full"),
    Case("P=2 1f1b", pp=2),
    Case("P=2 gpipe", pp=2, schedule="gpipe"),
]


@dataclasses.dataclass
class Spec:
    """What every worker runs (picklable)."""

    overrides: dict[str, Any]
    precision: str
    cases: list[Case]
    global_batch: int
    micro_batch: int
    seq_len: int
    steps: int
    warmup: int


def _single_topology() -> ExpertParallelTopology:
    """One process's layout, for the calibration run on rank 0 while rank 1 waits."""
    return ExpertParallelTopology(world_size=1, rank=0, ep_size=1, edp_size=1, ep_rank=0, edp_rank=0)


def _build(case: Case, spec: Spec) -> tuple[MulaLightningModule, PipelineRunner | None, EPShardedAdamW]:
    """The module, its pipeline runner and its sharded optimizer, in XPUMoEStrategy.setup's order."""
    if case.world == 1:
        topo = _single_topology()
    else:
        topo = topology_from_layout(layout_of(case, spec).parallel)  # the layout the plan predicts
    torch.manual_seed(0)
    module = MulaLightningModule(
        "mula-tiny-moe",
        overrides=spec.overrides,
        activation_checkpointing=case.checkpointing,
        decay_steps=100,
    )
    module.configure_model()
    runner = None
    if case.pp > 1:
        split_model(module.model, topo.holdings(module.config))
        runner = PipelineRunner(module, topo, torch.device("cpu"))
    apply_expert_parallel(module, topo)
    module.to(DTYPES[spec.precision])
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    adamw = module.configure_optimizers()["optimizer"]
    opt = EPShardedAdamW.from_adamw(adamw, named, topo, zero_stage=case.zero, collectives="native")
    return module, runner, opt


def _step(module: MulaLightningModule, runner: PipelineRunner | None, opt: EPShardedAdamW, batch: torch.Tensor,
          micro: int) -> None:  # fmt: skip
    """One optimizer step over this rank's share of the global batch, as the strategy runs it."""
    opt.zero_grad()
    if runner is not None:
        with opt.no_sync():
            runner.step(batch, batch.shape[0] // micro)
    else:
        micro_batches = batch.split(micro)
        for i, mb in enumerate(micro_batches):
            sync = contextlib.nullcontext() if i == len(micro_batches) - 1 else opt.no_sync()
            with sync:
                (module._losses(mb)[0] / len(micro_batches)).backward()
    opt.reduce_gradients()
    opt.step()


def _run_case(case: Case, spec: Spec, rank: int) -> list[float] | None:
    """Seconds per step (the slowest rank's) after the warm-up steps; None on a rank left out."""
    dist.barrier()
    if rank >= case.world:
        dist.barrier()  # wait for the calibration run
        return None
    module, runner, opt = _build(case, spec)
    dp = case.world // case.pp
    dp_rank = (rank // (case.pp * case.ep)) * case.ep + rank % case.ep
    rows = spec.global_batch // dp
    g = torch.Generator().manual_seed(1000 + dp_rank)
    vocab = module.config.vocab_size
    times = []
    for i in range(spec.warmup + spec.steps):
        batch = torch.randint(0, vocab, (rows, spec.seq_len + 1), generator=g)
        if case.world > 1:
            dist.barrier()
        start = time.perf_counter()
        _step(module, runner, opt, batch, spec.micro_batch)
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        if case.world > 1:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank ends
        if i >= spec.warmup:
            times.append(float(elapsed))
    opt.close()
    if case.world == 1:
        dist.barrier()
    return times


def _measure(rank: int, world: int, spec: Spec) -> list[dict[str, Any]] | None:
    """Rank 0: each case's median step time."""
    rows = []
    for case in spec.cases:
        times = _run_case(case, spec, rank)
        if rank == 0:
            rows.append({"case": case.name, "step_s": statistics.median(times)})
    return rows if rank == 0 else None


def layout_of(case: Case, spec: Spec) -> Layout:
    """The planner's layout of a case."""
    dp = case.world // case.pp
    return Layout(
        world_size=case.world, ep_size=case.ep, pp_size=case.pp, pp_schedule=case.schedule,
        micro_batch=spec.micro_batch, seq_len=spec.seq_len,
        micro_batches=micro_batches_per_step(spec.global_batch, dp, spec.micro_batch), precision=spec.precision,
        checkpointing=case.checkpointing, shard_optimizer=True, zero_stage=case.zero, collectives="native",
    )  # fmt: skip


def table(rows: list[dict[str, Any]], config: MulaConfig, spec: Spec, machine: Machine) -> str:
    """Markdown table: predicted and measured seconds per step, their ratio per round, predicted parts."""
    lines = [
        "| layout | predicted s/step | measured s/step (median [min-max] of rounds) | measured / predicted | "
        "predicted compute / all-to-all / grad / gather / pipeline ms |",
        "|---|---|---|---|---|",
    ]
    cases = {c.name: c for c in spec.cases}
    for name, rs in by_case(rows).items():
        t = step_time(config, layout_of(cases[name], spec), machine, spec.global_batch)
        measured = [r["step_s"] for r in rs]
        parts = " / ".join(f"{1e3 * getattr(t, k):.0f}" for k in PARTS)
        lines.append(
            f"| {name} | {t.step_time_s:.3f} | {statistics.median(measured):.3f} [{min(measured):.3f}-"
            f"{max(measured):.3f}] | {spread([m / t.step_time_s for m in measured])} | {parts} |"
        )
    return "\n".join(lines)


def main(
    steps: int = 4,
    warmup: int = 2,
    rounds: int = 3,
    global_batch: int = 8,
    micro_batch: int = 2,
    seq_len: int = 128,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_experts: int = 8,
    top_k: int = 2,
    expert_intermediate_size: int = 256,
    vocab_size: int = 2048,
    precision: str = "32-true",
    doc: str | None = None,
    calibration: str | None = None,
) -> str:
    """Calibrate the host (`mula calibrate`, or read `calibration`, a machine file it wrote), then run every
    layout in `rounds` interleaved rounds in one 2-process job."""
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {', '.join(DTYPES)}, got {precision!r}.")
    overrides = dict(
        hidden_size=hidden_size, num_layers=num_layers, num_heads=max(1, hidden_size // 64), num_experts=num_experts,
        top_k=top_k, expert_intermediate_size=expert_intermediate_size, vocab_size=vocab_size,
        max_position_embeddings=max(seq_len, 64), routing_mode="uniform",
    )  # fmt: skip
    config = MulaConfig.from_name("mula-tiny-moe", **overrides)
    runs = [case for _ in range(rounds) for case in CASES]  # interleaved rounds: drift hits every layout
    spec = Spec(overrides, precision, runs, global_batch, micro_batch, seq_len, steps, warmup)
    for case in CASES:  # refuse, before any process starts, a case the strategy would refuse
        check_runnable(config, layout_of(case, spec), global_batch)
    os.environ["OMP_NUM_THREADS"] = "1"  # the workers inherit it: one thread per rank
    machine_file = Path(calibration) if calibration else Path(tempfile.mkdtemp()) / "this-host.yaml"
    if not calibration:  # `mula calibrate` on this host, at this model's shapes
        calibrate(output=str(machine_file), devices=2, model="mula-tiny-moe", overrides=overrides,
                  seq_len=seq_len, micro_batch=micro_batch, progress=False)  # fmt: skip
    machine = load_machine(str(machine_file))
    rows = run_gloo(_measure, 2, spec)[0]
    cal = machine.calibration or {}
    header = (
        f"Model: mula-tiny-moe shape with hidden {hidden_size}, {num_layers} layers, {num_experts} experts top-{top_k} "
        f"(FFN {expert_intermediate_size}, uniform routing), vocab {vocab_size}: {config.num_params() / 1e6:.1f}M "
        f"parameters, {precision}; global batch {global_batch} x {seq_len} tokens in micro-batches of {micro_batch}; "
        f"2 gloo processes on {os.cpu_count()} CPU cores, 1 torch thread each; median of {steps} optimizer steps "
        f"after {warmup} warm-up steps, {rounds} interleaved rounds.\n\n"
        f"Machine: `mula calibrate --devices 2` on this host (measured {cal.get('measured_at')}): the model's "
        f"matmuls at {1e3 * cal.get('model_tflops', {}).get('float32', 0):.1f} (fp32) / "
        f"{1e3 * cal.get('model_tflops', {}).get('bfloat16', 0):.1f} (bf16) GFLOP/s per rank; every collective "
        f"priced by its own latency + bandwidth curve (fits within +-{100 * cal.get('error_band', 0):.0f} %)."
    )
    text = header + "\n\n" + table(rows, config, spec, machine)
    print(text)
    if doc is not None:
        write_section(Path(doc), SECTION, _doc_section(text))
    return text


def _doc_section(result: str) -> str:
    return f"""{SECTION}

The planner's step time (`mula plan`'s `step_time_s`) against measured steps on this CPU host, with a
machine description measured on it and `compute_mfu` calibrated on one rank. Made with:

    .venv/bin/python benchmarks/step_time.py --doc docs/benchmarks.md

{host_line()}

{result}

How to read it.

- The 1-rank row calibrates `compute_mfu`, so its ratio is 1 up to the spread between rounds; every
  other row is a prediction: compute scaled by the layout's share of the tokens (and the recomputed
  forward), plus the communication volumes (checked byte for byte in tests/test_plan_volumes.py) over
  the measured bandwidths, plus the pipeline bubble.
- A ratio above 1 is time the model leaves out: two ranks sharing the host's memory bandwidth and
  caches (one rank computes alone during calibration), collective latency and synchronisation on
  small messages, the optimizer update and framework work that does not shrink with the ranks.
- So this table does not validate the step-time model: the 2-rank ratios show by how much it
  under-predicts on this host, most where it counts least (the expert all-to-all's small messages,
  the recomputed forward). Its Aurora and H100 numbers (docs/scaling.md) rest on the same terms and on
  assumed efficiencies; a measured one-node GPU run is what would validate or correct them.
"""


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main)
