"""Long sequences under Ulysses context parallelism: training tokens/s and activation bytes per rank at
sequence lengths 1k to 8k for C = 1, 2, 4, with the planner's activation prediction beside each
measured figure.

W gloo CPU processes (default 4, one torch thread each) train the tiny MoE (`mula-tiny-moe`; `--model
mula-tiny-dense` for the dense one) from the same seed. For each C the model is laid out as
`XPUMoEStrategy(context_parallel_size=C)` lays it out (`strategies.context_parallel.apply_context_parallel`
over the topology's CP group: each of the C ranks holds S/C tokens of every sequence and attends over the
whole sequence for heads/C heads), W/C data-parallel groups each read their own sequence, and one
training step is forward, backward, the gradient all-reduce over every rank (`GradientSynchronizer`: CP
ranks reduce as data-parallel ones) and AdamW. Reported per (S, C):

- tokens/s: the step's global tokens (W/C sequences of S) over its time on the slowest rank, the median
  of `steps` steps after one warm-up step; the median over rounds with [min-max], and the ratio to C = 1
  at the same S (median [min-max] over rounds);
- activations: the peak bytes autograd holds saved for backward during one micro-batch's forward
  (`callbacks.memory_metrics.SavedTensorMeter`, what `MemoryMetrics` logs as `mem/activation_bytes` and
  tests/test_context_parallel.py checks the planner against), the largest rank, measured in the
  untimed warm-up step; next to `mula.plan.plan_memory(...).activations` for the same layout and their
  ratio (planned / measured; the planner's claim is within 10 %).

Every (S, C) runs once per round, rounds interleaved, so background load hits every case alike.
Benchmarks print tables and never assert.

    python benchmarks/long_sequence.py --doc docs/benchmarks.md   # minutes: 8k tokens on one core is slow
    python benchmarks/long_sequence.py --seq_lens '[1024, 2048]' --rounds 1 --steps 1   # a quick look
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import torch
from common import (  # benchmarks/ is on sys.path when run as a script
    MiB,
    by_case,
    gloo_ranks,
    host_line,
    largest_over_ranks,
    markdown_table,
    median_range,
    positive,
    publish,
    run_gloo,
    slowest_rank_seconds,
    spread,
    start_together,
)

from mula.layout.parallel_layout import ParallelLayout
from mula.layout.rules import check_sequence_split
from mula.model.config import MulaConfig, resolve_config
from mula.plan import Layout, plan_memory

SECTION = "## long sequences"
DOC = """{section}

Ulysses context parallelism (`XPUMoEStrategy(context_parallel_size=C)`, docs/context-parallel.md) at
growing sequence lengths, all in one job. Made with:

    .venv/bin/python benchmarks/long_sequence.py --world {world} --doc docs/benchmarks.md

{host}

{result}

How to read it.

- Each rank holds S/C tokens of a sequence, so every per-token activation shrinks by C; attention's
  saved q, k, v and output are S tokens x heads/C, the same bytes. The activation column is what lets
  a sequence C times longer fit the same device; `mula plan` predicts it (planned / measured near 1).
- All C values do the same arithmetic per token; C > 1 adds two all-to-alls per attention layer forward
  and two backward, and fewer, longer sequences per step. On shared CPU cores tokens/s at C > 1 shows
  that price (gloo all-to-alls through host memory), not a device's: there the point is memory.
"""


@dataclasses.dataclass
class Spec:
    """What every worker runs (picklable)."""

    preset: str
    overrides: dict[str, Any]
    cases: list[tuple[int, int]]  # (seq_len, C) in run order: every case once per round
    cp_sizes: list[int]
    micro_batch: int
    steps: int


def _case_name(seq: int, cp: int) -> str:
    return f"S={seq} C={cp}"


def _rank_rows(rank: int, world: int, spec: Spec) -> list[dict[str, Any]]:
    from mula.training.memory_meter import SavedTensorMeter
    from mula.training.module import MulaLightningModule
    from strategies.context_parallel import apply_context_parallel
    from strategies.optim.grad_sync import GradientSynchronizer
    from strategies.topology import topology_from_layout

    setups = {}
    for cp in spec.cp_sizes:  # one model, optimizer and gradient reducer per C, kept over the rounds
        topo = topology_from_layout(
            ParallelLayout(world_size=world, cp=cp)
        )  # collective: same order everywhere
        torch.manual_seed(0)
        module = MulaLightningModule(spec.preset, overrides=spec.overrides)
        module.configure_model()
        if cp > 1:
            apply_context_parallel(module.model, topo.group("cp"), topo.rank("cp"), topo.size("cp"))
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(module.param_groups(), lr=1e-4, weight_decay=0.1)
        sync = GradientSynchronizer(named, topo, bucket_size_mb=16.0, overlap=False)
        setups[cp] = (module, optimizer, sync, rank // cp)  # CP innermost: the data-parallel index
    measured: dict[tuple[int, int], int] = {}
    rows = []
    for i, (seq, cp) in enumerate(spec.cases):
        module, optimizer, sync, dp_rank = setups[cp]
        gen = torch.Generator().manual_seed(1000 * i + dp_rank)  # the C ranks of a group: one sequence
        vocab = module.config.vocab_size
        times = []
        for step in range(1 + spec.steps):  # step 0 warms up (and meters the activations once per case)
            batch = torch.randint(0, vocab, (spec.micro_batch, seq + 1), generator=gen)
            start = start_together()
            optimizer.zero_grad(set_to_none=True)
            if step == 0 and (seq, cp) not in measured:
                with SavedTensorMeter(exclude=module.parameters()) as meter:
                    loss = module._losses(batch)[0]
                measured[(seq, cp)] = meter.bytes
            else:
                loss = module._losses(batch)[0]
            loss.backward()
            sync.finish()
            optimizer.step()
            elapsed = slowest_rank_seconds(start)
            if step > 0:
                times.append(elapsed)
        step_s = statistics.median(times)
        rows.append({
            "case": _case_name(seq, cp), "seq": seq, "cp": cp, "step_ms": 1e3 * step_s,
            "tokens_per_s": (world // cp) * spec.micro_batch * seq / step_s,
            "activation_bytes": measured[(seq, cp)],
        })  # fmt: skip
    for _, _, sync, _ in setups.values():
        sync.remove_hooks()
    return rows


def planned_activations(config: MulaConfig, world: int, cp: int, seq: int, micro_batch: int) -> int:
    """The planner's saved-for-backward bytes per rank of one micro-batch at (W, C, S): fp32, no
    checkpointing, on CPU, as measured here."""
    layout = Layout(world_size=world, cp_size=cp, micro_batch=micro_batch, seq_len=seq, device_type="cpu")
    return plan_memory(config, layout).activations


def table(rows: list[dict[str, Any]], config: MulaConfig, world: int, micro_batch: int) -> str:
    """Markdown table: per (S, C) the medians over rounds, spreads, and planned against measured bytes."""
    per_round: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in rows:
        per_round.setdefault((r["seq"], r["cp"]), []).append(r)
    cells = []
    for rs in by_case(rows).values():
        seq, cp = rs[0]["seq"], rs[0]["cp"]
        ones = per_round.get((seq, 1))
        ratio = (
            "-" if ones is None else spread([r["tokens_per_s"] / o["tokens_per_s"] for r, o in zip(rs, ones)])
        )
        measured = rs[0]["activation_bytes"]
        planned = planned_activations(config, world, cp, seq, micro_batch)
        cells.append([
            seq, cp, median_range([r["tokens_per_s"] for r in rs]), ratio,
            f"{statistics.median(r['step_ms'] for r in rs):.0f}", f"{measured / MiB:.1f}",
            f"{planned / MiB:.1f}", f"{planned / measured:.3f}",
        ])  # fmt: skip
    head = ["S", "C", "tokens/s (median [min-max] of rounds)", "vs C=1 at this S", "step ms",
            "activations/rank measured MiB", "planned MiB", "planned / measured"]  # fmt: skip
    return markdown_table(head, cells)


def main(
    world: int = 4,
    cp_sizes: list[int] = [1, 2, 4],  # noqa: B006 (jsonargparse reads the default from the signature)
    seq_lens: list[int] = [1024, 2048, 4096, 8192],  # noqa: B006
    model: str = "mula-tiny-moe",
    micro_batch: int = 1,
    steps: int = 3,
    rounds: int = 3,
    doc: str | None = None,
) -> str:
    """Run every (sequence length, C) in one job of `world` CPU processes, `rounds` interleaved rounds."""
    if model not in ("mula-tiny-moe", "mula-tiny-dense"):
        raise ValueError(f"model must be mula-tiny-moe or mula-tiny-dense, got {model!r}.")
    positive(world=world, micro_batch=micro_batch, steps=steps, rounds=rounds)
    overrides = {"max_position_embeddings": max(seq_lens)}
    config = resolve_config(model, overrides)
    for cp in cp_sizes:  # refuse, before any process starts, a layout the strategy would refuse
        ParallelLayout(world_size=world, cp=cp).validate(config)
        for seq in seq_lens:
            check_sequence_split(seq, cp)
    cases = [(seq, cp) for _ in range(rounds) for seq in seq_lens for cp in cp_sizes]
    spec = Spec(model, overrides, cases, list(cp_sizes), micro_batch, steps)
    # rank 0's rows (the step times are already the slowest rank's) with the largest rank's activations
    rows = largest_over_ranks(run_gloo(_rank_rows, world, spec), ["activation_bytes"])
    header = (
        f"Model: {model} (hidden {config.hidden_size}, {config.num_layers} layers, {config.num_heads} heads"
        + (f", {config.num_experts} experts top-{config.top_k}" if config.is_moe else "")
        + f"): {config.num_params() / 1e6:.1f}M parameters. fp32, gloo, {gloo_ranks(world)}, "
        f"W/C sequences of micro-batch {micro_batch} per step, "
        f"median of {steps} steps (slowest rank) after 1 warm-up step, {rounds} interleaved rounds. "
        "Activations: peak saved-for-backward bytes of one forward, largest rank, against `mula plan`'s."
    )
    result = header + "\n\n" + table(rows, config, world, micro_batch)
    # the section names the host it was measured on
    return publish(
        result, doc, SECTION, DOC.format(section=SECTION, world=world, host=host_line(), result=result)
    )


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main)
