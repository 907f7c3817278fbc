"""GradReducer in both modes on 4 gloo CPU processes (E = 2) vs gradients averaged in one process.

Every rank feeds known per-rank gradients through backward (so the hooks fire), over two
micro-batches (the first one not synchronised), with one parameter that gets no gradient. The
reference, computed in-process from all ranks' gradients: dense = (1/W) * sum over the world,
experts = (1/W) * sum over the rank's EDP group (they arrive already summed over EP). Plain mode must
leave it in ``p.grad``; sharded mode must leave this rank's slice of it in ``shard_grad``.
"""

from __future__ import annotations

import torch
from dist_helpers import run_distributed
from torch import nn

from mula.model.moe import is_expert_param
from strategies.optim.grad_reduce import GradReducer, param_entry
from strategies.topology import build_topology

WORLD, EP = 4, 2
SHAPES = {"layer.w": (5, 3), "layer.b": (7,), "norm.w": (3,), "moe.experts.w": (2, 4, 3)}
UNUSED = "norm.w"
MICRO = 2
VARIANTS = [
    {"sharded": False, "overlap": True},
    {"sharded": False, "overlap": False},
    {"sharded": True, "overlap": True, "collectives": "native"},
    {"sharded": True, "overlap": True, "collectives": "rooted", "zero_stage": 2},
    {"sharded": True, "overlap": False, "collectives": "native"},
]


def _grad(rank: int, micro: int, name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 100 * micro + sorted(SHAPES).index(name))
    return torch.randn(SHAPES[name], generator=gen)


def _expected(rank: int, name: str) -> torch.Tensor:
    ranks = range(WORLD) if not is_expert_param(name) else range(rank % EP, WORLD, EP)
    if name == UNUSED:
        return torch.zeros(SHAPES[name])
    return sum(_grad(q, m, name) for q in ranks for m in range(MICRO)) / WORLD


def _run(rank: int, variant: dict) -> dict[str, torch.Tensor]:
    topo = build_topology(EP)
    named = [(n, nn.Parameter(torch.zeros(s))) for n, s in SHAPES.items()]
    params = [p for _, p in named]
    entries = [param_entry(i, n, p, 0, topo) for i, (n, p) in enumerate(named)]
    options = {k: v for k, v in variant.items() if k != "sharded"}
    reducer = GradReducer(
        params, entries, topo, sharded=variant["sharded"], bucket_numel=16, align=4,
        reduce_dtype=torch.float32 if variant["sharded"] else None, device=torch.device("cpu"), **options,
    )  # fmt: skip
    used = [(n, p) for n, p in named if n != UNUSED]
    for micro in range(MICRO):
        reducer.sync = micro == MICRO - 1
        torch.autograd.backward([p for _, p in used], [_grad(rank, micro, n) for n, _ in used])
        if variant.get("zero_stage") == 2 and not reducer.sync:
            reducer.reduce()  # what EPShardedAdamW.no_sync does on exit for ZeRO-2
    reducer.reduce()
    if not variant["sharded"]:
        reducer.point_grads()
        return {n: p.grad.clone() for n, p in named}
    out = {}
    for entry in entries:
        slot = reducer.slots[entry.index]
        st = reducer.states[slot.bucket]
        for seg in reducer.buckets[slot.bucket].segments(st.domain.rank):
            if seg.slot.entry.index == entry.index:
                lo = st.shard_offset + seg.shard_start
                out[f"{entry.name}@{seg.param_start}"] = reducer.shard_grad[lo : lo + seg.length].clone()
    return out


def _worker(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    return [_run(rank, v) for v in VARIANTS]


def test_both_modes_match_single_process_average() -> None:
    results = run_distributed(_worker, WORLD)
    for rank, runs in enumerate(results):
        for variant, got in zip(VARIANTS, runs):
            assert got, variant
            for key, value in got.items():
                name, _, start = key.partition("@")
                expected = _expected(rank, name)
                if start:
                    expected = expected.reshape(-1)[int(start) : int(start) + value.numel()]
                torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-7, msg=f"{variant} {key}")
