"""Sharded Muon's exchange of its buckets: which elements each rank sends to which matrix owner.

A Muon bucket's flat buffer is sharded element-wise over its domain's n ranks (rank r holds
``[r S, (r + 1) S)``, S = ``shard_numel``) and each of its matrices has one owner that orthogonalises
it (`mula.layout.flat_buffers.matrix_owners`). Rank r sends owner o the elements of its slice that lie
in o's matrices, in bucket order; o receives, from each rank in rank order, the pieces of its matrices
that rank holds. The slices follow each other in the buffer, so what o receives is its matrices whole,
one after another in bucket order. The orthogonalised matrices go back along the same pieces: the
transposed all-to-all, whose result on rank r lands in the order its send buffer had.

Each rank so receives its own matrices and its own slice of the result (each about 1/n of the bucket
when the owners' shares are even), where an all-gather and a reduce-scatter of the bucket move
(n - 1)/n of it each. Pure bookkeeping, like flat_buffers: the optimizer
(strategies/optim/sharded_muon.py) and the planner (`mula.plan`) read the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mula.layout.flat_buffers import Bucket, MatrixTask, matrix_owners

Run = tuple[int, int]  # [lo, hi) of a rank's slice of a bucket


@dataclass(frozen=True)
class ExchangePlan:
    """One rank's part in the all-to-all of one Muon bucket (module docstring).

    send: per destination rank, the [lo, hi) runs of this rank's slice that go to it, in bucket order;
    recv: per source rank, the elements received from it; owned: this rank's matrices, each with its
    offset in the received buffer (their concatenation in bucket order)."""

    rank: int
    send: tuple[tuple[Run, ...], ...]
    recv: tuple[int, ...]
    owned: tuple[tuple[MatrixTask, int], ...]

    @property
    def send_sizes(self) -> list[int]:
        """Elements sent to each rank (the all-to-all's input split sizes)."""
        return [sum(hi - lo for lo, hi in runs) for runs in self.send]

    @property
    def received(self) -> int:
        """Elements of the matrices this rank owns (its receive buffer)."""
        return sum(self.recv)

    def off_rank(self) -> tuple[int, int]:
        """(elements sent to other ranks, elements received from them) by the forward all-to-all; the
        return trip swaps the two."""
        r = self.rank
        return sum(self.send_sizes) - self.send_sizes[r], self.received - self.recv[r]


def _overlap(a: int, b: int, lo: int, hi: int) -> tuple[int, int]:
    return max(a, lo), min(b, hi)


def exchange_plan(bucket: Bucket, tasks: Sequence[MatrixTask], rank: int) -> ExchangePlan:
    """Domain rank ``rank``'s plan for Muon bucket ``bucket`` whose matrices are ``tasks`` (one bucket's
    `matrix_owners`). Adjacent runs to one owner merge into one copy."""
    n, s = bucket.group_size, bucket.shard_numel
    lo, hi = rank * s, (rank + 1) * s
    send: list[list[Run]] = [[] for _ in range(n)]
    recv = [0] * n
    owned: list[tuple[MatrixTask, int]] = []
    offset = 0
    for t in sorted(tasks, key=lambda t: t.start):
        end = t.start + t.rows * t.cols
        a, b = _overlap(t.start, end, lo, hi)
        if a < b:
            runs = send[t.owner]
            if runs and runs[-1][1] == a - lo:
                runs[-1] = (runs[-1][0], b - lo)
            else:
                runs.append((a - lo, b - lo))
        if t.owner == rank:
            owned.append((t, offset))
            offset += end - t.start
            for j in range(n):
                a, b = _overlap(t.start, end, j * s, (j + 1) * s)
                recv[j] += max(0, b - a)
    return ExchangePlan(rank, tuple(tuple(r) for r in send), tuple(recv), tuple(owned))


@dataclass(frozen=True)
class ExchangeVolume:
    """What sharded Muon's exchange costs the busiest rank per optimizer step.

    sent: bytes sent to other ranks over both trips (the forward all-to-all of the update and the return
    of the orthogonalised slices), which is also what the rank receives from them; calls: all-to-alls (two per bucket with peers);
    transient: peak bytes of the exchange's buffers (the update's slice, its packed send buffer that
    the result returns into, the received matrices: four buckets' at once, as the optimizer pipelines
    them) plus the Newton-Schulz scratch of the largest matrix the rank owns."""

    sent: int
    calls: int
    transient: int


# buckets whose exchange buffers live at once: the next bucket's send in flight while one is
# orthogonalised and two returns are pending (strategies/optim/sharded_muon.py)
BUCKETS_IN_FLIGHT = 4


def newton_schulz_scratch(rows: int, cols: int) -> int:
    """Elements Newton-Schulz holds beyond its input for one [rows, cols] matrix: the scaled iterate and
    the next one (a b each), the Gram matrix and its polynomial (a^2 each), a = min, b = max."""
    a, b = min(rows, cols), max(rows, cols)
    return 2 * a * b + 2 * a * a


def exchange_volume(buckets: Sequence[Bucket], elem_bytes: int) -> ExchangeVolume:
    """`ExchangeVolume` of the Muon buckets among ``buckets`` (a rank's, as `plan_buckets` lays them out)
    with the update in ``elem_bytes`` per element (`muon_ns_dtype`): the maximum over the domain ranks
    of each quantity, from the plans every rank builds (`exchange_plan` on `matrix_owners`)."""
    owners = matrix_owners(list(buckets))
    by_rank: dict[tuple[str, int], list[int]] = {}
    calls = 0
    biggest = 0
    for b in buckets:
        if not b.muon:
            continue
        calls += 2 * (b.group_size > 1)
        for r in range(b.group_size):
            plan = exchange_plan(b, owners[b.index], r)
            out, into = plan.off_rank()
            acc = by_rank.setdefault((b.domain, r), [0, 0])
            acc[0] += out + into  # forward: out; the return: what came in goes back
            scratch = max((newton_schulz_scratch(t.rows, t.cols) for t, _ in plan.owned), default=0)
            acc[1] = max(acc[1], scratch)
            received = plan.received if b.group_size > 1 else 0  # (alone, a rank receives in place)
            biggest = max(biggest, 2 * b.shard_numel + received)
    # a rank is one rank of the dense domain and one of the expert domain: their worst ranks add up
    sent = sum(max(v[0] for (d, _), v in by_rank.items() if d == dom) for dom in {d for d, _ in by_rank})
    scratch = max((v[1] for v in by_rank.values()), default=0)
    return ExchangeVolume(sent * elem_bytes, calls, (BUCKETS_IN_FLIGHT * biggest + scratch) * elem_bytes)
