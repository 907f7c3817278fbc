"""The planner's step time (`mula.plan.step_time`) against measured step times on this CPU host.

Every round first runs `mula calibrate --devices 2` on this host at the benchmark model's shapes
(training rates per rank with both ranks busy, elementwise bandwidth, the training loop's fixed work,
the sharded optimizer's reducer, and every collective's latency and bandwidth over message sizes; or
`--calibration FILE` reads one machine file it wrote for all rounds). The planner prices each layout of
the round with it (`mula.plan.step_time.step_time`): compute at the measured rates, each collective by
its own alpha + beta * bytes curve times the calls the layout makes (`comm_volumes`' `*_calls`, checked
against real runs in tests/test_plan_volumes*.py), the reducer's own work, the optimizer update and the
loop's fixed seconds.

Then, in interleaved rounds (every layout once per round), a small MoE (uniform routing, the model's
balanced-routing assumption) trains full optimizer steps of one global batch -- forward, backward,
gradient reduction, the sharded AdamW (native collectives) -- in each layout, with Lightning's
Trainer and XPUMoEStrategy as `mula fit` trains (a step: from one optimizer step's end to the next's):

  1 rank          one process (the other waits);
  DP=2 ZeRO-1/2   two data-parallel ranks with the sharded optimizer;
  E=2             expert parallelism (all-to-all dispatch), also with every block recomputed;
  P=2             two pipeline stages, 1F1B and GPipe;
  T=2             tensor parallelism (tokens split over the TP pair before routing), also with
                  sequence parallelism;
  C=2             Ulysses context parallelism (each rank holds half of every sequence).

Each row: the planner's prediction (`step_time`) with each round's calibration as written, and with its
training rates (`mula.calibrate.measure.training_tflops`, the calibration's largest term) timed again
by the layout's own job just before the layout trains (this shared host's speed moves by up to 25 %
within a minute, so a calibration made a minute or two before prices the layout at another speed than
it runs); the measured seconds per step (slowest rank, median of the steps of each round); measured /
predicted for each prediction (each round's measurement over its own prediction); all as median
[min-max] over rounds; and the parts of the re-timed prediction (of the median round). Benchmarks
print tables and never assert.

    python benchmarks/step_time.py --doc docs/benchmarks.md
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
from common import (  # benchmarks/ is on sys.path when run as a script
    by_case,
    host_line,
    markdown_table,
    median_range,
    moe_shape,
    publish,
    run_gloo,
    spread,
)

from mula import MulaConfig
from mula.calibrate.command import calibrate
from mula.calibrate.measure import training_tflops
from mula.layout.rules import micro_batches_per_step
from mula.plan import Layout
from mula.plan.grad_reduction import overhead_per_byte
from mula.plan.layout import check_runnable
from mula.plan.machines import Machine, load_machine
from mula.plan.step_time import step_time
from mula.training.host_allocator import reuse_freed_host_memory
from mula.training.module import MulaLightningModule
from strategies import XPUMoEStrategy

SECTION = "## step time"
PARTS = (
    "compute_s", "all_to_all_s", "grad_sync_s", "param_gather_s", "pipeline_s", "tensor_parallel_s",
    "context_parallel_s", "optimizer_s", "loop_s",
)  # fmt: skip
DTYPES = {"32-true": torch.float32, "bf16-true": torch.bfloat16}
CPU = torch.device("cpu")
RATE_REPS = 5  # `mula calibrate`'s repetitions (training_tflops times 3x as many)


@dataclasses.dataclass
class Case:
    """One row of the table: a layout of `world` ranks (1: one process, the other rank waits)."""

    name: str
    world: int = 2
    ep: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    zero: int = 1
    checkpointing: Any = "none"
    tp: int = 1
    sp: bool = False
    cp: int = 1


CASES = [
    Case("1 rank", world=1),
    Case("DP=2 ZeRO-1"),
    Case("DP=2 ZeRO-2", zero=2),
    Case("E=2", ep=2),
    Case("E=2, full recompute", ep=2, checkpointing="full"),
    Case("P=2 1f1b", pp=2),
    Case("P=2 gpipe", pp=2, schedule="gpipe"),
    Case("T=2", tp=2),
    Case("T=2, sequence parallel", tp=2, sp=True),
    Case("C=2", cp=2),
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


class _StepTimer(L.Callback):
    """Seconds of every optimizer step on this rank: from one step's end to the next's (the first from
    its first micro-batch's start), so data loading, logging and the optimizer are all in it."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last: float | None = None
        self._step = 0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self._last is None:
            self._last = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self._step:  # an optimizer step ended with this batch
            now = time.perf_counter()
            assert self._last is not None
            self.times.append(now - self._last)
            self._last, self._step = now, trainer.global_step


class _Batches:
    """A data-parallel rank's share of every step's global batch: micro-batches, or whole steps (stages)."""

    def __init__(self, spec: Spec, dp_rank: int, dp_size: int, whole_steps: bool, vocab: int) -> None:
        self.spec, self.dp_rank, self.dp_size, self.whole, self.vocab = (
            spec,
            dp_rank,
            dp_size,
            whole_steps,
            vocab,
        )

    def __iter__(self):
        rows = self.spec.global_batch // self.dp_size
        for step in range(self.spec.warmup + self.spec.steps):
            g = torch.Generator().manual_seed(1000 * step + self.dp_rank)
            mine = torch.randint(0, self.vocab, (rows, self.spec.seq_len + 1), generator=g)
            yield from [mine] if self.whole else mine.split(self.spec.micro_batch)


def _run_case(case: Case, spec: Spec, rank: int) -> list[float] | None:
    """Seconds per optimizer step (the slowest rank's) after the warm-up steps, trained by Lightning's
    Trainer with XPUMoEStrategy as `mula fit` trains; None on a rank left out."""
    dist.barrier()
    layout = layout_of(case, spec)
    torch.manual_seed(0)
    module = MulaLightningModule(
        "mula-tiny-moe",
        overrides=spec.overrides,
        activation_checkpointing=case.checkpointing,
        decay_steps=100,
    )
    strategy: Any = "auto"
    if case.world > 1:
        os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(case.world), RANK=str(rank))
        strategy = XPUMoEStrategy(
            expert_parallel_size=case.ep, pipeline_parallel_size=case.pp, pipeline_schedule=case.schedule,
            tensor_parallel_size=case.tp, sequence_parallel=case.sp, context_parallel_size=case.cp,
            optimizer_options={"zero_stage": case.zero, "collectives": "native"},
        )  # fmt: skip
        if case.pp > 1:
            strategy.pipeline_microbatches = layout.micro_batches
    timer = _StepTimer()
    trainer = L.Trainer(
        accelerator="cpu", devices=case.world, strategy=strategy, max_steps=spec.warmup + spec.steps,
        precision=spec.precision, accumulate_grad_batches=1 if case.pp > 1 else layout.micro_batches,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer],
    )  # fmt: skip
    # global rank = (((d * P + s) * E + e) * C + c) * T + t: the data-parallel index is d * E + e (the C
    # context-parallel ranks read the same sequences, each keeping its 1/C)
    e = (rank // (case.tp * case.cp)) % case.ep
    d = rank // (case.tp * case.cp * case.ep * case.pp)
    trainer.fit(
        module, _Batches(spec, d * case.ep + e, layout.dp_size, case.pp > 1, module.config.vocab_size)
    )
    times = torch.tensor(timer.times, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
    return times.tolist()[spec.warmup :]


def _measure(rank: int, world: int, spec: Spec) -> list[dict[str, Any]] | None:
    """Rank 0: the median step time of each case of `world` ranks (a one-process job for the 1-rank case:
    a Trainer of one device in a job of two would meet the other rank's collectives), and the training
    rates `mula calibrate` measures, timed again by the same job just before the case."""
    reuse_freed_host_memory()  # as `mula fit` sets a CPU rank, before the rates are timed here
    config = MulaConfig.from_name("mula-tiny-moe", **spec.overrides)
    rows = []
    for case in spec.cases:
        rates = training_tflops(
            config, spec.micro_batch, spec.seq_len, DTYPES[spec.precision], CPU, RATE_REPS
        )
        times = _run_case(case, spec, rank)
        if rank == 0:
            rows.append({"case": case.name, "step_s": statistics.median(times), "training_tflops": rates})
    return rows if rank == 0 else None


def with_rates(machine: Machine, dtype: str, rates: dict[str, float]) -> Machine:
    """`machine` with its training rates in `dtype` replaced by `rates`."""
    cal = machine.calibration or {}
    training = {**cal.get("training_tflops", {}), dtype: rates}
    return dataclasses.replace(machine, calibration={**cal, "training_tflops": training})


def layout_of(case: Case, spec: Spec) -> Layout:
    """The planner's layout of a case (one process trains with torch's AdamW, as a one-device `mula fit`
    without XPUMoEStrategy does; two with the strategy's sharded AdamW)."""
    layout = Layout(
        world_size=case.world, ep_size=case.ep, pp_size=case.pp, pp_schedule=case.schedule,
        micro_batch=spec.micro_batch, seq_len=spec.seq_len, precision=spec.precision,
        checkpointing=case.checkpointing, shard_optimizer=case.world > 1, zero_stage=case.zero, collectives="native",
        tp_size=case.tp, sequence_parallel=case.sp, cp_size=case.cp,
    )  # fmt: skip
    return layout.replace(
        micro_batches=micro_batches_per_step(spec.global_batch, layout.dp_size, spec.micro_batch)
    )


def table(rows: list[dict[str, Any]], config: MulaConfig, spec: Spec, machines: list[Machine]) -> str:
    """Markdown table: predicted seconds per step with each round's calibration as written and with its
    training rates timed again just before the layout, the measured seconds, the ratio of each round's
    measurement to each prediction, and the parts of the second prediction (the median round's)."""
    cells = []
    cases = {c.name: c for c in spec.cases}
    dtype = str(DTYPES[spec.precision]).removeprefix("torch.")
    for name, rs in by_case(rows).items():
        layout = layout_of(cases[name], spec)
        machine = [machines[r["round"] % len(machines)] for r in rs]
        calibrated = [step_time(config, layout, m, spec.global_batch).step_time_s for m in machine]
        times = [
            step_time(config, layout, with_rates(m, dtype, r["training_tflops"]), spec.global_batch)
            for m, r in zip(machine, rs)
        ]
        retimed = [t.step_time_s for t in times]
        middle = times[retimed.index(statistics.median_low(retimed))]
        measured = [r["step_s"] for r in rs]
        parts = " / ".join(f"{1e3 * getattr(middle, k):.0f}" for k in PARTS)
        cells.append([
            name, median_range(calibrated, ".3f"), median_range(retimed, ".3f"), median_range(measured, ".3f"),
            spread([m / p for m, p in zip(measured, calibrated)]),
            spread([m / p for m, p in zip(measured, retimed)]), parts,
        ])  # fmt: skip
    head = [
        "layout", "predicted s/step, the round's calibration",
        "predicted s/step, rates re-timed before the layout", "measured s/step",
        "measured / predicted, calibration", "measured / predicted, re-timed",
        "predicted (re-timed) compute / all-to-all / grad / gather / pipeline / TP / CP / update / loop ms",
    ]  # fmt: skip
    return markdown_table(head, cells)


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
    cases: list[str] | None = None,
) -> str:
    """In each of `rounds` interleaved rounds, calibrate the host (`mula calibrate`; or read `calibration`, a
    machine file it wrote, once for all rounds), then run every layout in one 2-process job per world size
    (`cases`: only the rows of these names)."""
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {', '.join(DTYPES)}, got {precision!r}.")
    overrides = dict(
        hidden_size=hidden_size, num_layers=num_layers, num_heads=max(1, hidden_size // 64), num_experts=num_experts,
        top_k=top_k, expert_intermediate_size=expert_intermediate_size, vocab_size=vocab_size,
        max_position_embeddings=max(seq_len, 64), routing_mode="uniform",
    )  # fmt: skip
    config = MulaConfig.from_name("mula-tiny-moe", **overrides)
    chosen = [c for c in CASES if cases is None or c.name in cases]
    if not chosen:
        raise ValueError(f"no case named {cases}; the cases are: {', '.join(c.name for c in CASES)}.")
    spec = Spec(overrides, precision, chosen, global_batch, micro_batch, seq_len, steps, warmup)
    for case in chosen:  # refuse, before any process starts, a case the strategy would refuse
        check_runnable(config, layout_of(case, spec), global_batch)
    os.environ["OMP_NUM_THREADS"] = "1"  # the workers inherit it: one thread per rank
    machines: list[Machine] = [load_machine(calibration)] if calibration else []
    rows = []
    for r in range(rounds):  # interleaved rounds: drift hits every layout; each world size its own job
        if not calibration:  # `mula calibrate` on this host, at this model's shapes, every round: a host
            # whose speed drifts between rounds moves the prediction and the measurement alike
            machine_file = Path(tempfile.mkdtemp()) / "this-host.yaml"
            calibrate(output=str(machine_file), devices=2, model="mula-tiny-moe", overrides=overrides,
                      seq_len=seq_len, micro_batch=micro_batch, progress=False)  # fmt: skip
            machines.append(load_machine(str(machine_file)))
        for world in sorted({c.world for c in chosen}):
            same = [c for c in chosen if c.world == world]
            rows += [
                {**row, "round": r}
                for row in run_gloo(_measure, world, dataclasses.replace(spec, cases=same))[0]
            ]
    machine = machines[0]
    cal = machine.calibration or {}
    dtype = str(DTYPES[precision]).removeprefix("torch.")
    rates = cal.get("training_tflops", {}).get(dtype, {})
    loop = cal.get("loop_s", {})
    calls = cal.get("functional_call_s", {}).get(2, 0.0)
    reducer = [
        1e9 * overhead_per_byte(machine, sized[2], stage, 2, dtype) if 2 in sized else 0.0
        for stage, sized in sorted(cal.get("grad_reduction_s", {}).get(dtype, {}).items())
    ]
    header = (
        f"Model: {moe_shape(config, ', uniform routing')}, {precision}; global batch {global_batch} x {seq_len} "
        f"tokens in micro-batches of {micro_batch}; "
        f"2 gloo processes on {os.cpu_count()} CPU cores, 1 torch thread each; median of {steps} optimizer steps "
        f"after {warmup} warm-up steps, {rounds} interleaved rounds.\n\n"
        f"Machine: `mula calibrate --devices 2` on this host before every round; the first round's (measured "
        f"{cal.get('measured_at')}): a block's "
        f"forward + backward at {1e3 * rates.get('step', 0):.1f} GFLOP/s per rank ({precision}), the LM head's "
        f"at {1e3 * rates.get('head_step', 0):.1f}; elementwise {cal.get('elementwise_gbps', 0):.1f} GB/s; the "
        f"loop's fixed {1e3 * loop.get('step', 0):.1f} ms per step and {1e3 * loop.get('batch', 0):.1f} ms per "
        f"micro-batch; a functional collective {1e3 * calls:.2f} ms between computes; the sharded optimizer's "
        f"reducer {' / '.join(f'{r:.3f}' for r in reducer)} ns per bucket byte and micro-batch beyond its "
        f"collectives (ZeRO-1 / ZeRO-2); every collective priced "
        f"by its own latency + bandwidth curve (fits within +-{100 * cal.get('error_band', 0):.0f} %)."
    )
    text = header + "\n\n" + table(rows, config, spec, machines)
    return publish(text, doc, SECTION, _doc_section(text))


def _doc_section(result: str) -> str:
    return f"""{SECTION}

The planner's step time (`mula plan`'s `step_time_s`) against measured steps on this CPU host, priced
with a machine file `mula calibrate --devices 2` measured on it at the benchmark model's shapes before
each round, as written, and with its training rates timed again (by the calibration's own function)
in each layout's job just before the layout trains. This shared host's speed moves by up to 25 %
within a minute (the same script, run back to back: 173 ms, then 217 ms 40 s later), so a
calibration made a minute or two before a layout can price it at another speed than it runs; the
re-timed column takes the host's drift out and leaves the model's own error. Made with:

    .venv/bin/python benchmarks/step_time.py --doc docs/benchmarks.md

{host_line()}

{result}

How to read it.

- Every row is a prediction: compute at the calibrated training rates (a block's, from the small
  model against one with two more blocks, so a block pays what it pays inside a deep model; and the
  rest's -- embedding, LM head and loss -- on the last stage; whole forward + backward passes of a
  micro-batch with both ranks busy; the forward rate for recomputation), each collective as calls x
  latency + bus bytes x inverse bandwidth from its own measured curve (the calls and bytes of each
  layout checked against real runs in tests/test_plan_volumes.py and tests/test_plan_volumes_tp.py),
  the calls that block between computes inside a node (tensor- and context-parallel collectives, the
  expert all-to-alls, pipeline sends) at the measured price of a functional collective between
  computes, a TP, CP or EP rank's compute times its split's calibrated factor
  (mula/plan/split_compute.py), the pipeline bubble, the gradient reduction's overlap with the last
  micro-batch's backward, the sharded optimizer's reducer's own work per bucket byte and micro-batch
  beyond its collectives (calibrated with the strategy's optimizer reducing, updating and gathering,
  mula/plan/grad_reduction.py), the optimizer update's bytes at the elementwise bandwidth and the
  training loop's fixed seconds per step and micro-batch (mula/plan/step_overheads.py).
- A ratio above 1 is time the model leaves out; below 1, time it counts that the step does not spend.
- Every process here, the calibration's, the training's and the re-timing's, runs with glibc's malloc
  thresholds fixed (`mula.training.host_allocator`, which `mula fit` and `mula calibrate` set on CPU ranks).
  With glibc's defaults a process page-faulted 3,500 to 9,000 times per step, or 50 times, depending
  on what it had freed before, so the calibration's rates depended on what it measured first.
"""


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main)
