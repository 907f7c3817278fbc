"""Optimizer offload: step time with the host update overlapped with backward (SuperOffload's speculation)
against the host update after backward, in the same run.

On W gloo CPU ranks, two copies of one dense Mula model (the same weights), each with its own
`EPShardedAdamW(offload=True)`: "overlapped" starts each bucket's host AdamW as soon as its gradient
reduction is launched in backward (`offload_speculation=True`, strategies/optim/offload.py), "after
backward" runs every bucket's update in `step()` (`offload_speculation=False`). A step is forward +
backward + global norm + clip + update + parameter all-gather, timed on the slowest rank. The two arms
alternate step by step inside each of `rounds` rounds, so background load hits both alike; the
table gives each arm's median per round and the ratio's median [min-max] over rounds. With clipping
on (`--clip`), steps whose norm exceeds it roll the speculation back and recompute: the rollbacks are
counted. On CPU ranks "host" and "device" are the same memory and cores, so the overlap there only
hides the update behind backward's idle time (gloo waits); on a GH200 the update runs on the Grace
cores while the GPU runs backward. Benchmarks print tables and never assert.

    python benchmarks/offload.py --world 2 --steps 6 --rounds 3
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Any

import torch
from common import (  # benchmarks/ is on sys.path when run as a script
    markdown_table,
    positive,
    run_gloo,
    slowest_rank_seconds,
    spread,
    start_together,
)

from mula import Mula, MulaConfig
from strategies.optim.sharded_optimizer import EPShardedAdamW
from strategies.topology import build_topology

ARMS = {"overlapped": True, "after backward": False}


@dataclasses.dataclass
class BenchSpec:
    """What to measure (picklable: sent to the worker processes)."""

    config: dict[str, Any]
    steps: int
    rounds: int
    micro_batch: int
    seq_len: int
    bucket_numel: int
    clip: float | None


def _rank(rank: int, world: int, spec: BenchSpec) -> list[dict[str, Any]]:
    config = MulaConfig(**spec.config)
    topology = build_topology(1)
    arms = {}
    for name, speculate in ARMS.items():
        torch.manual_seed(0)
        model = Mula(config)
        opt = EPShardedAdamW(
            model.parameters(), model.named_parameters(), topology, lr=1e-3, offload=True,
            offload_speculation=speculate, bucket_numel=spec.bucket_numel,
        )  # fmt: skip
        arms[name] = (model, opt)
    gen = torch.Generator().manual_seed(rank)
    rows = []
    for rnd in range(spec.rounds):
        times: dict[str, list[float]] = {name: [] for name in ARMS}
        for _ in range(spec.steps + 1):  # the first step of each round warms up
            tokens = torch.randint(0, config.vocab_size, (spec.micro_batch, spec.seq_len + 1), generator=gen)
            for name, (model, opt) in arms.items():
                t0 = start_together()
                out = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten())
                loss.backward()
                norm, finite = opt.grad_norm()
                if bool(finite):
                    if spec.clip is not None:
                        opt.clip_grad_norm_(spec.clip, norm=norm)
                    opt.step()
                opt.zero_grad()
                times[name].append(slowest_rank_seconds(t0))
        for name, (_, opt) in arms.items():
            rows.append(
                {
                    "case": name,
                    "round": rnd,
                    "step_ms": 1e3 * statistics.median(times[name][1:]),
                    "rollbacks": opt.metrics().get("optim/offload_rollbacks", 0.0),
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Per arm: the median step time per round, and overlapped / after-backward over rounds."""
    by = {name: [r for r in rows if r["case"] == name] for name in ARMS}
    cells = [
        [name, ", ".join(f"{r['step_ms']:.1f}" for r in mine), int(mine[-1]["rollbacks"])]
        for name, mine in by.items()
    ]
    ratios = [a["step_ms"] / b["step_ms"] for a, b in zip(by["after backward"], by["overlapped"])]
    return (
        markdown_table(["update", "step ms per round", "rollbacks"], cells)
        + f"\n\nafter backward / overlapped step time: {spread(ratios)}"
    )


def main(
    world: int = 2,
    steps: int = 6,
    rounds: int = 3,
    micro_batch: int = 4,
    seq_len: int = 256,
    hidden_size: int = 512,
    num_layers: int = 4,
    num_heads: int = 8,
    intermediate_size: int = 1536,
    vocab_size: int = 8192,
    bucket_numel: int = 2**20,
    clip: float | None = None,
) -> str:
    """Run both arms in one set of `world` ranks and print the table."""
    positive(world=world, steps=steps, rounds=rounds)
    cfg = MulaConfig.from_name(
        "mula-tiny-dense", hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        intermediate_size=intermediate_size, vocab_size=vocab_size, max_position_embeddings=max(seq_len, 64),
    )  # fmt: skip
    spec = BenchSpec(dataclasses.asdict(cfg), steps, rounds, micro_batch, seq_len, bucket_numel, clip)
    rows = run_gloo(_rank, world, spec)[0]
    params = sum(p.numel() for p in Mula(cfg).parameters())
    header = (
        f"Dense Mula, hidden {hidden_size}, {num_layers} layers, {params / 1e6:.1f}M parameters, fp32, "
        f"{world} gloo ranks, micro-batch {micro_batch} x {seq_len} tokens, {bucket_numel} elements per "
        f"bucket, clip {clip}; {os.cpu_count()} CPU cores, 1 torch thread per rank; median of {steps} "
        f"steps per round (slowest rank), {rounds} interleaved rounds."
    )
    result = header + "\n\n" + table(rows)
    print(result)
    return result


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main)
