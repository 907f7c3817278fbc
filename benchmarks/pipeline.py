"""Training throughput and measured bubble of the pipeline schedules against the same model unsplit.

W gloo CPU processes (default 4, one torch thread each) train the same Mula MoE from the same seed on
the same global batches, full optimizer steps (forward, backward, gradient all-reduce, AdamW):

  no pipeline      W data-parallel ranks, each accumulating its share of the global batch in
                   micro-batches (what XPUMoEStrategy runs with pipeline_parallel_size=1, E=1);
  P=k <schedule>   the blocks split into k stages (strategies/pipeline/split.py), W/k data-parallel
                   ranks, one torch.distributed.pipelining schedule per step over the same
                   micro-batches (strategies/pipeline/schedule.py): gpipe, 1f1b, interleaved-1f1b
                   (2 virtual stages per rank).

Reported per layout: global tokens/s (slowest rank's step time, median over steps), step time, the
measured bubble -- 1 - (time a rank spends computing its stages' forward and backward chunks) /
(step time), averaged over ranks, so idle time and point-to-point waits both count -- next to the
textbook bubble of the schedule ((P-1)/(m+P-1), with m micro-batches; (P-1)/(V m+P-1) interleaved),
and the parameters each rank holds. Benchmarks print tables and never assert.

    python benchmarks/pipeline.py --doc docs/benchmarks.md
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch
from common import (  # benchmarks/ is on sys.path when run as a script
    MiB,
    by_case,
    gloo_ranks,
    largest_over_ranks,
    markdown_table,
    moe_config,
    moe_shape,
    publish,
    run_gloo,
    slowest_rank_seconds,
    spread,
    start_together,
)
from torch.distributed.pipelining import PipelineStage

from mula import MulaConfig
from mula.layout.parallel_layout import ParallelLayout
from mula.training.module import MulaLightningModule
from strategies.optim.grad_sync import GradientSynchronizer
from strategies.pipeline.schedule import PipelineRunner
from strategies.pipeline.split import split_model
from strategies.topology import topology_from_layout

SECTION = "## pipeline"


@dataclasses.dataclass
class Case:
    """One row of the table."""

    name: str
    pp_size: int
    schedule: str = "1f1b"
    virtual: int = 1


@dataclasses.dataclass
class Spec:
    """What every worker runs (picklable)."""

    config: dict[str, Any]
    cases: list[Case]
    global_batch: int
    micro_batch: int
    seq_len: int
    steps: int
    warmup: int


class _ComputeClock:
    """Seconds spent inside torch's stage forward/backward chunks (patched into PipelineStage)."""

    seconds = 0.0

    @classmethod
    def install(cls) -> None:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            original = getattr(PipelineStage, name)

            def timed(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return _original(self, *args, **kwargs)
                finally:
                    cls.seconds += time.perf_counter() - start

            setattr(PipelineStage, name, timed)


def _layout(case: Case, world: int) -> ParallelLayout:
    """The layout of `case` on `world` ranks."""
    return ParallelLayout(
        world_size=world, pp=case.pp_size, schedule=case.schedule, virtual_stages=case.virtual
    )


def _run_case(case: Case, spec: Spec, rank: int, world: int) -> dict[str, Any]:
    config = MulaConfig(**spec.config)
    topo = topology_from_layout(_layout(case, world))
    torch.manual_seed(0)
    module = MulaLightningModule(config)
    module.configure_model()
    runner = None
    if case.pp_size > 1:
        split_model(module.model, topo.holdings(config))
        runner = PipelineRunner(module, topo, torch.device("cpu"))
    named = list(module.named_parameters())
    optimizer = torch.optim.AdamW(module.param_groups(), lr=1e-4, weight_decay=0.1)
    sync = GradientSynchronizer(named, topo, bucket_size_mb=16.0, overlap=False)
    rows = spec.global_batch // topo.size("replica")  # this data-parallel rank's share of a step
    micro_batches = rows // spec.micro_batch
    g = torch.Generator().manual_seed(1000 + topo.rank("replica"))
    batches = [
        torch.randint(0, config.vocab_size, (rows, spec.seq_len + 1), generator=g)
        for _ in range(spec.warmup + spec.steps)
    ]
    times, busy = [], []
    for i, batch in enumerate(batches):
        _ComputeClock.seconds = 0.0
        start = start_together()
        optimizer.zero_grad(set_to_none=True)
        if runner is not None:
            runner.step(batch, micro_batches)
        else:
            for micro in batch.split(spec.micro_batch):
                out = module.model(micro[:, :-1])
                loss = module.combine_losses(out.logits, micro[:, 1:], out.aux_loss, out.z_loss)[0]
                (loss / micro_batches).backward()
        sync.finish()
        optimizer.step()
        elapsed = slowest_rank_seconds(start)
        if i >= spec.warmup:
            times.append(elapsed)
            busy.append(_ComputeClock.seconds / elapsed)
    sync.remove_hooks()
    step_s = statistics.median(times)
    if runner is None:
        bubble, textbook = None, None
    else:
        bubble = 1.0 - statistics.median(busy)
        work = micro_batches * (case.virtual if case.schedule == "interleaved-1f1b" else 1)
        textbook = (case.pp_size - 1) / (work + case.pp_size - 1)
    return {
        "case": case.name,
        "pp_size": case.pp_size,
        "micro_batches": micro_batches,
        "step_ms": step_s * 1e3,
        "tokens_per_s": spec.global_batch * spec.seq_len / step_s,
        "bubble": bubble,
        "textbook": textbook,
        "param_mib": sum(p.numel() * p.element_size() for _, p in named) / MiB,
    }


def _rank_rows(rank: int, world: int, spec: Spec) -> list[dict[str, Any]]:
    _ComputeClock.install()
    return [_run_case(case, spec, rank, world) for case in spec.cases]


def _merge_ranks(gathered: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rank 0's rows with the bubble averaged over ranks and the largest rank's parameters."""
    return [
        {
            **row,
            "bubble": None
            if row["bubble"] is None
            else sum(g[i]["bubble"] for g in gathered) / len(gathered),
        }
        for i, row in enumerate(largest_over_ranks(gathered, ["param_mib"]))
    ]


def table(rows: list[dict[str, Any]], rounds: int) -> str:
    """Markdown table over `rounds` interleaved rounds (every layout once per round, in order):
    medians, and each layout's tokens/s ratio to the unsplit model of the same round (median [min-max])."""
    per_round = len(rows) // rounds
    bases = [
        next(b for b in rows[k : k + per_round] if b["pp_size"] == 1) for k in range(0, len(rows), per_round)
    ]
    rated = [
        {**r, "ratio": r["tokens_per_s"] / bases[i // per_round]["tokens_per_s"]} for i, r in enumerate(rows)
    ]
    med = statistics.median
    cells = []
    for case, rs in by_case(rated).items():
        bubbles = [r["bubble"] for r in rs if r["bubble"] is not None]
        bubble = "-" if not bubbles else f"{100 * med(bubbles):.0f}%"
        textbook = "-" if rs[0]["textbook"] is None else f"{100 * rs[0]['textbook']:.0f}%"
        cells.append([
            case, rs[0]["micro_batches"], f"{med(r['tokens_per_s'] for r in rs):.0f}",
            spread([r["ratio"] for r in rs]), f"{med(r['step_ms'] for r in rs):.0f}", bubble, textbook,
            f"{rs[0]['param_mib']:.1f}",
        ])  # fmt: skip
    head = ["layout", "micro-batches/step", "tokens/s", "vs no pipeline (median [min-max] of rounds)",
            "step ms", "bubble (measured)", "bubble (textbook)", "params MiB/rank"]  # fmt: skip
    return markdown_table(head, cells)


def main(
    world: int = 4,
    pp_sizes: list[int] = [2, 4],  # noqa: B006 (jsonargparse reads the default from the signature)
    schedules: list[str] = ["gpipe", "1f1b", "interleaved-1f1b"],  # noqa: B006
    steps: int = 5,
    warmup: int = 2,
    global_batch: int = 32,
    micro_batch: int = 2,
    seq_len: int = 256,
    hidden_size: int = 256,
    num_layers: int = 8,
    num_experts: int = 16,
    top_k: int = 4,
    expert_intermediate_size: int = 256,
    vocab_size: int = 4096,
    rounds: int = 3,
    doc: str | None = None,
) -> str:
    """Run the unsplit model and every (P, schedule) in one job of `world` CPU processes."""
    if min(pp_sizes) < 2:
        raise ValueError(f"pp_sizes must be at least 2 (the unsplit model is always run), got {pp_sizes}.")
    config = moe_config(
        seq_len, hidden_size=hidden_size, num_layers=num_layers, num_experts=num_experts, top_k=top_k,
        expert_intermediate_size=expert_intermediate_size, vocab_size=vocab_size,
    )  # fmt: skip
    cases = [Case("no pipeline", 1)]
    for p in pp_sizes:
        for schedule in schedules:
            virtual = 2 if schedule == "interleaved-1f1b" else 1
            suffix = f", V={virtual}" if virtual > 1 else ""
            cases.append(Case(f"P={p} {schedule}{suffix}", p, schedule, virtual))
    for case in cases:  # refuse, before any process starts, a case the strategy would refuse
        _layout(case, world).validate(config, global_batch=global_batch, micro_batch=micro_batch)
    runs = [case for _ in range(rounds) for case in cases]  # interleaved rounds: drift hits every layout
    spec = Spec(dataclasses.asdict(config), runs, global_batch, micro_batch, seq_len, steps, warmup)
    rows = _merge_ranks(run_gloo(_rank_rows, world, spec))
    header = (
        f"Model: {moe_shape(config)}. fp32, gloo, {gloo_ranks(world)}, global batch {global_batch} x "
        f"{seq_len} tokens in micro-batches of {micro_batch}, median of {steps} optimizer steps (slowest rank) "
        f"after {warmup} warm-up steps, {rounds} interleaved rounds."
    )
    result = header + "\n\n" + table(rows, rounds)
    return publish(result, doc, SECTION, _doc_section(result, world))


def _doc_section(result: str, world: int) -> str:
    return f"""{SECTION}

Pipeline stages (`XPUMoEStrategy(pipeline_parallel_size=P, pipeline_schedule=...)`) against the same
model without stages, all in one job. Made with:

    .venv/bin/python benchmarks/pipeline.py --world {world} --doc docs/benchmarks.md

{result}

How to read it.

- Every layout does the same arithmetic on the same global batch; P stages give each rank 1/P of the
  blocks and W/P data-parallel ranks, so each rank runs P times more micro-batches through fewer layers.
- The bubble is the share of a step a rank is not computing: ramp-up and drain of the schedule plus
  point-to-point waits. 1F1B has GPipe's bubble but keeps only P micro-batches' activations alive
  (GPipe keeps all of them); interleaving V virtual stages divides the ramp by V for V times the
  messages. More micro-batches per step shrink every schedule's bubble.
- On shared CPU cores a pipeline cannot beat the unsplit model: its gain is memory (params MiB/rank
  falls by P), which is what lets Mula-220B-A10B fit a 64 GB tile; the bubble column is the price.
"""


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main)
