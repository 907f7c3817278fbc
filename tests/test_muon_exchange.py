"""Sharded Muon's all-to-all (strategies/optim/muon_exchange.py, plan: mula/layout/muon_exchange.py)
against one process holding the whole bucket.

The reference is what the all-gather version computed: the whole bucket's update, every matrix
orthogonalised whole, each rank's slice of the result. On 4 gloo ranks each rank sends its slice's
pieces to their owners, the owners orthogonalise, the slices come back: every rank's slice is the
reference's bit for bit (`torch.equal`), and each rank moves at most 2/W of the buckets' bytes (counted
by `mula.bench.collectives.CollectiveMeter`), exactly what the planner's `exchange_volume` says, where the
all-gather and reduce-scatter moved 2 (W - 1)/W of them. Planted, each fails: one owner's slices not
sent back (zeros instead), the returned slices unpacked as another owner's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed

from mula.bench.collectives import CollectiveMeter
from mula.layout.flat_buffers import ParamEntry, matrix_owners, plan_buckets
from mula.layout.muon_exchange import exchange_plan, exchange_volume
from mula.training.muon import newton_schulz
from strategies.optim.grad_reduce import Domain
from strategies.optim.muon_exchange import BucketExchange

WORLD = 4
DTYPE = torch.bfloat16


def _entries() -> list[ParamEntry]:
    """Two stacks of equal matrices (each rank owns a quarter of each) and a lone matrix that fills a
    bucket of its own; alignment 8 puts padding between and after them."""
    shapes = [(8, 16, 24), (4, 24, 16), (16, 16)]
    out = []
    for i, shape in enumerate(shapes):
        n = 1
        for d in shape:
            n *= d
        out.append(ParamEntry(i, f"p{i}", shape, n, "float32", 0, "dense", 0, n, shape, shape[-2:]))
    return out


def _buckets(world: int) -> list:
    return plan_buckets(_entries(), {"dense": world, "expert": 1}, bucket_numel=4000, align=8)


def _update(numel: int, index: int) -> torch.Tensor:
    """Bucket ``index``'s whole update (every rank draws the same), the padding zero as the optimizer's."""
    g = torch.Generator().manual_seed(index)
    full = torch.randn(numel, generator=g).to(DTYPE)
    real = torch.zeros(numel, dtype=torch.bool)
    for slot in _buckets(WORLD)[index].slots:
        real[slot.start : slot.start + slot.entry.numel] = True
    return full * real


def reference(rank: int, world: int) -> list[torch.Tensor]:
    """One process: every matrix of every bucket orthogonalised whole, this rank's slice of each."""
    buckets = _buckets(world)
    out = []
    for b, tasks in matrix_owners(buckets).items():
        full = _update(buckets[b].numel, b)
        result = torch.zeros_like(full)
        for t in tasks:
            n = t.rows * t.cols
            result[t.start : t.start + n] = newton_schulz(
                full[t.start : t.start + n].view(t.rows, t.cols), 5
            ).flatten()
        s = buckets[b].shard_numel
        out.append(result[rank * s : (rank + 1) * s])
    return out


def _exchange(rank: int, world: int, bug: str | None) -> list[torch.Tensor]:
    """Every bucket's slice through `BucketExchange`, with ``bug`` planted."""
    buckets = _buckets(world)
    dom = Domain("dense", dist.group.WORLD, world, rank, 1.0, list(range(world)))
    out = []
    for b, tasks in matrix_owners(buckets).items():
        ex = BucketExchange(exchange_plan(buckets[b], tasks, rank), dom)
        s = buckets[b].shard_numel
        update = _update(buckets[b].numel, b)[rank * s : (rank + 1) * s].clone()
        packed, received, handles = ex.send(update)
        for h in handles:
            h.wait()
        for _, x in ex.matrices(received):
            x.copy_(newton_schulz(x, 5))
        if bug == "not_returned" and rank == 1:
            received.zero_()
        for h in ex.give_back(received, packed):
            h.wait()
        if bug == "wrong_owner":  # the returned pieces unpacked as if each came from the next owner
            ex._runs = [run for runs in ex.plan.send[1:] + ex.plan.send[:1] for run in runs]
        out.append(ex.unpack(packed, update))
    return out


def _worker(rank: int, world: int) -> dict[str, Any]:
    with CollectiveMeter() as meter:
        sound = _exchange(rank, world, None)
    totals = meter.totals()
    return {
        "sound": sound,
        "moved": {key: totals[key] for key in ("sent", "received", "calls")},
        "bugs": {bug: _exchange(rank, world, bug) for bug in ("not_returned", "wrong_owner")},
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_worker, WORLD)


def _same(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(outs, refs, strict=True))


def test_every_slice_is_one_process_result_bit_for_bit(runs: list[dict[str, Any]]) -> None:
    for rank, run in enumerate(runs):
        assert _same(run["sound"], reference(rank, WORLD)), rank


@pytest.mark.parametrize("bug", ["not_returned", "wrong_owner"])
def test_a_planted_bug_fails(runs: list[dict[str, Any]], bug: str) -> None:
    assert not all(_same(run["bugs"][bug], reference(rank, WORLD)) for rank, run in enumerate(runs))


def test_each_rank_moves_at_most_2_over_w_of_the_buckets(runs: list[dict[str, Any]]) -> None:
    """Measured bytes to and from other ranks, both trips: at most 2/W of the buckets' (the all-gather
    and reduce-scatter moved 2 (W - 1)/W), and the busiest rank's exactly the planner's."""
    buckets = _buckets(WORLD)
    total = sum(b.numel for b in buckets) * DTYPE.itemsize
    volume = exchange_volume(buckets, DTYPE.itemsize)
    for run in runs:
        moved = run["moved"]
        assert {k for k, v in moved["calls"].items() if v} == {"all_to_all"}
        sent, received = moved["sent"]["all_to_all"], moved["received"]["all_to_all"]
        assert sent == received  # what a rank sends to owners comes back to it
        assert received <= 2 * total / WORLD, (received, total)
        assert moved["calls"]["all_to_all"] == volume.calls == 2 * len(buckets)
    assert max(run["moved"]["sent"]["all_to_all"] for run in runs) == volume.sent
    assert volume.sent < 2 * (WORLD - 1) / WORLD * total / 2  # under half of the all-gather version's


@pytest.mark.parametrize("world", [1, 3, 4])
def test_the_plans_agree_between_ranks(world: int) -> None:
    """What rank r sends rank j is what j expects from r; each owner receives exactly its matrices."""
    buckets = _buckets(world)
    for b, tasks in matrix_owners(buckets).items():
        plans = [exchange_plan(buckets[b], tasks, r) for r in range(world)]
        for r, plan in enumerate(plans):
            assert [p.recv[r] for p in plans] == plan.send_sizes
            owned = [t for t in tasks if t.owner == r]
            assert [t for t, _ in plan.owned] == owned
            assert plan.received == sum(t.rows * t.cols for t in owned)
