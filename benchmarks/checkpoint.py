"""What a checkpoint costs a training run: no save, a synchronous save and an asynchronous save every N steps.

W gloo CPU processes (default 4, one torch thread each) train a Mula MoE at E=2 with the EP-aware
sharded AdamW (XPUMoEStrategy's layout and optimizer) on fixed token batches, and every `every`
steps save the checkpoint the strategy saves (model state with expert tensors as global DTensors,
the optimizer's sharded state dict) through the production path minus Lightning:

  none    no save;
  sync    `strategies.sharded_state.save_sharded` (DCP), every rank's `syncfs`, then
          `callbacks._checkpoint_commit.commit` (rename, hashing spread over the ranks, manifest):
          training waits for all of it;
  async   `start_save_sharded` (staging into host memory, `dcp.async_save` over a gloo group of its
          own) and `callbacks._background_save.BackgroundSave` (write, flush, commit in a background
          thread); the next save waits for the previous one, as `FaultTolerantCheckpoint` does.

Reported per model and case: the mean step time over the run (saves included; the slowest rank's
step), the slowest step, the ratio to "none" within each interleaved round (median [min-max]), and
for the last checkpoint the tensor bytes each rank wrote against the bytes it holds: the written
bytes add up to the checkpoint's tensors counted once (no two ranks write the same replica).
Benchmarks print tables and never assert.

    python benchmarks/checkpoint.py --doc docs/benchmarks.md
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import (  # benchmarks/ is on sys.path when run as a script
    MiB,
    by_case,
    host_line,
    markdown_table,
    publish,
    run_gloo,
    slowest_rank_seconds,
    spread,
    start_together,
)

from callbacks._background_save import BackgroundSave, writer_group
from callbacks._checkpoint_commit import SaveRecord, commit
from mula import Mula, MulaConfig
from mula.checkpoint import checkpoint_name, sync_filesystem, temp_path
from mula.checkpoint.sharded import tensor_bytes_by_writer
from mula.checkpoint.staging import staged_bytes
from strategies.experts.expert_parallel import apply_expert_parallel
from strategies.optim.sharded_optimizer import EPShardedAdamW
from strategies.sharded_state import expert_mesh, model_state, save_sharded, start_save_sharded
from strategies.topology import build_topology

SECTION = "## checkpoint"
CASES = ("none", "sync", "async")
MODELS = {
    # the demo's model, and a ~100M-parameter MoE of the same family
    "tiny": {},
    "100M": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_experts": 16, "top_k": 2,
             "expert_intermediate_size": 512, "vocab_size": 16384},
}  # fmt: skip


@dataclasses.dataclass
class Spec:
    """One job: the models, the interleaved runs, and the step settings."""

    configs: dict[str, dict[str, Any]]
    runs: list[tuple[str, str]]  # (model, case), rounds interleaved
    steps: int
    every: int
    micro_batch: int
    seq_len: int
    root: str


class _Trainer:
    """One model on this rank: EP E=2, the sharded AdamW, its batches."""

    def __init__(self, config: MulaConfig, spec: Spec, rank: int) -> None:
        torch.manual_seed(0)
        self.config = config
        self.model = Mula(config)
        self.topology = build_topology(ep_size=2)
        apply_expert_parallel(self.model, self.topology)
        named = list(self.model.named_parameters())
        adamw = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1)
        self.optimizer = EPShardedAdamW.from_adamw(adamw, named, self.topology)
        g = torch.Generator().manual_seed(1000 + rank)
        self.batches = [
            torch.randint(0, config.vocab_size, (spec.micro_batch, spec.seq_len + 1), generator=g)
            for _ in range(4)
        ]

    def step(self, i: int) -> None:
        batch = self.batches[i % len(self.batches)]
        self.optimizer.zero_grad(set_to_none=True)
        out = self.model(batch[:, :-1])
        loss = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten()) + 0.01 * out.aux_loss
        loss.backward()
        self.optimizer.step()

    def state(self) -> tuple[dict[str, Any], list[Any]]:
        """What the strategy saves: the model state and the optimizer's sharded state dict."""
        return {"state_dict": model_state(self.model, expert_mesh(self.topology))}, [
            self.optimizer.sharded_state_dict()
        ]


def _record(step: int, rank: int, world: int) -> SaveRecord:
    return SaveRecord(step, 0, "periodic", world, "sha256", 2, (), rank == 0, time.monotonic())


def _run(trainer: _Trainer, case: str, spec: Spec, rank: int, world: int, group: Any, dirpath: Path) -> dict:
    times: list[float] = []
    inflight: BackgroundSave | None = None
    for i in range(1, spec.steps + 1):
        start = start_together()
        trainer.step(i)
        if case != "none" and i % spec.every == 0:
            final = dirpath / checkpoint_name(i)
            tmp = temp_path(final)
            state, optimizer_states = trainer.state()
            if case == "sync":
                save_sharded(tmp, {**state, "global_step": i}, optimizer_states, rank == 0)
                sync_filesystem(tmp)
                problem, _ = commit(_record(i, rank, world), tmp, final, None, True)
                assert problem is None, problem
            else:
                if inflight is not None:
                    assert inflight.result()[0] is None
                write = start_save_sharded(
                    tmp, {**state, "global_step": i}, optimizer_states, rank == 0, group
                )
                inflight = BackgroundSave(_record(i, rank, world), tmp, final, write, group, 0.0)
        times.append(slowest_rank_seconds(start))
    if inflight is not None:
        assert inflight.result()[0] is None
    return {"mean_ms": statistics.fmean(times) * 1e3, "max_ms": max(times) * 1e3}


def _rank_rows(rank: int, world: int, spec: Spec) -> list[dict[str, Any]]:
    group = writer_group()
    trainers = {name: _Trainer(MulaConfig(**config), spec, rank) for name, config in spec.configs.items()}
    rows = []
    for n, (model, case) in enumerate(spec.runs):
        dirpath = Path(spec.root) / f"{n}-{model}-{case}"
        row = {"model": model, "case": f"{model} {case}", "kind": case}
        row.update(_run(trainers[model], case, spec, rank, world, group, dirpath))
        if case != "none":
            state, optimizer_states = trainers[model].state()
            row["held"] = staged_bytes(state) + staged_bytes(optimizer_states)
            if rank == 0:
                newest = max(dirpath.glob("step=*.ckpt"), key=lambda p: p.name)
                row["written"], row["unique"] = tensor_bytes_by_writer(newest)
        rows.append(row)
        dist.barrier()
    return rows


def table(rows: list[dict[str, Any]], held: dict[str, list[int]]) -> str:
    """Markdown: per model and case the step time, the ratio to no save, the bytes each rank wrote."""
    grouped = by_case(rows)
    cells = []
    for case, runs in grouped.items():
        model, kind = runs[0]["model"], runs[0]["kind"]
        base = grouped[f"{model} none"]
        ratios = [r["mean_ms"] / b["mean_ms"] for r, b in zip(runs, base)]
        written = ""
        once = ""
        if kind != "none":
            per_rank = runs[-1]["written"]
            written = ", ".join(
                f"{per_rank.get(r, 0) / MiB:.2f} ({h / MiB:.2f})" for r, h in enumerate(held[case])
            )
            once = f"{sum(per_rank.values()) / runs[-1]['unique']:.3f}"
        cells.append([
            model, kind, f"{statistics.median(r['mean_ms'] for r in runs):.1f}",
            f"{statistics.median(r['max_ms'] for r in runs):.1f}", spread(ratios) if kind != "none" else "1",
            written, once,
        ])  # fmt: skip
    head = ["model", "save every N steps", "mean step ms", "slowest step ms",
            "vs no save (median [min-max] of rounds)", "tensor MiB written per rank (held)",
            "written / tensors once"]  # fmt: skip
    return markdown_table(head, cells)


def main(
    world: int = 4,
    steps: int = 20,
    every: int = 5,
    micro_batch: int = 2,
    seq_len: int = 128,
    rounds: int = 3,
    models: list[str] = ["tiny", "100M"],  # noqa: B006 (jsonargparse reads the default from the signature)
    doc: str | None = None,
) -> str:
    """Run every (model, case) in `rounds` interleaved rounds in one job of `world` CPU processes."""
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"Unknown models {unknown}; known: {', '.join(MODELS)}.")
    if world % 2 or steps < every or every < 1:
        raise ValueError("world must be even (E=2) and 1 <= every <= steps.")
    configs = {
        name: dataclasses.asdict(
            MulaConfig.from_name("mula-tiny-moe", **MODELS[name], max_position_embeddings=max(seq_len, 64))
        )
        for name in models
    }
    runs = [(m, c) for _ in range(rounds) for m in models for c in CASES]
    with tempfile.TemporaryDirectory() as root:
        spec = Spec(configs, runs, steps, every, micro_batch, seq_len, root)
        gathered = run_gloo(_rank_rows, world, spec)
    rows = gathered[0]
    held = {
        case: [by_case(g)[case][-1]["held"] for g in gathered]
        for case in by_case(rows)
        if not case.endswith("none")
    }
    sizes = ", ".join(f"{m} {MulaConfig(**configs[m]).num_params() / 1e6:.1f}M parameters" for m in models)
    header = (
        f"Models: {sizes}. fp32, E=2 with the sharded AdamW, gloo, W={world} processes (1 torch thread each), "
        f"micro-batch {micro_batch} x {seq_len} tokens per rank, {steps} steps with a save every {every}; "
        f"median of {rounds} interleaved rounds.\n{host_line()}"
    )
    result = header + "\n\n" + table(rows, held)
    return publish(result, doc, SECTION, _doc_section(result, world))


def _doc_section(result: str, world: int) -> str:
    return f"""{SECTION}

What a checkpoint costs a training step: no save, a synchronous save and an asynchronous save
(`FaultTolerantCheckpoint(async_save=true)`) every N steps, through the save path of
`XPUMoEStrategy` and `FaultTolerantCheckpoint` without Lightning. Made with:

    .venv/bin/python benchmarks/checkpoint.py --world {world} --doc docs/benchmarks.md

{result}

How to read it.

- The mean step time includes the saves; "vs no save" is its ratio to the run without saves, taken
  within each round. An asynchronous save stops training only to stage the state into host memory;
  the write, the flush, the hashing and the manifest happen in a background thread while training
  goes on (on a CPU host they compete with training for the same cores).
- "written (held)": the tensor bytes each rank wrote, and the bytes of the tensors it holds (its
  replicas included). "written / tensors once" is 1.000 when the ranks wrote every saved tensor
  exactly once: DCP's planner gives each replicated chunk (dense tensors on all ranks, expert rows
  on the two expert-data-parallel ranks) to one rank, spreading them over the ranks.
"""


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main)
