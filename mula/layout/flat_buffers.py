"""Flat-buffer layout for the sharded optimizer: which element of which parameter lives where.

Parameters are packed into buckets (one flat buffer each). A bucket belongs to one *domain*: "dense"
(reduced and sharded over a group of ``n`` ranks, normally the world) or "expert" (over the EDP
group). Each parameter starts at a multiple of ``align`` elements and every bucket is padded to a
multiple of ``n * align`` so that rank ``r`` of the domain owns the contiguous slice
``[r * S, (r + 1) * S)`` of every bucket, ``S = numel / n`` — the layout that reduce-scatter and
all-gather produce and consume without copies. Padding elements carry zero gradients, so they stay
zero and never count towards norms.

Everything here is pure bookkeeping (no tensors, no communication) so it can be tested and reused
for checkpoint metadata (every rank can compute every other rank's shard ranges) and by the memory
planner (`mula.plan`), which predicts the optimizer's buffers from the same layout. It lives in
`mula` rather than `strategies` for that reason: `mula` never imports `strategies`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mula.layout.sharding_options import SENTENCES


@dataclass(frozen=True)
class ParamEntry:
    """One parameter as the layout planner sees it.

    ``global_offset``/``global_numel`` place this rank's (local) tensor inside the flattened *global*
    parameter: 0/numel for dense parameters; for stacked expert parameters ``[E_local, ...]`` on EP rank
    ``p`` they are ``p * numel`` and ``ep_size * numel`` (global expert ``p * E_local + j``).
    """

    index: int
    name: str
    shape: tuple[int, ...]
    numel: int
    dtype_key: str
    group: int
    domain: str
    global_offset: int
    global_numel: int
    global_shape: tuple[int, ...]
    # (rows, cols) of the matrices Muon orthogonalises in this parameter (`numel / (rows * cols)` of them,
    # consecutive in its flattened form); None for a parameter AdamW trains
    matrix: tuple[int, int] | None = None

    @property
    def matrices(self) -> int:
        """How many Muon matrices the parameter holds (0 for an AdamW parameter)."""
        if self.matrix is None:
            return 0
        return self.numel // (self.matrix[0] * self.matrix[1])


@dataclass(frozen=True)
class Slot:
    """Where a parameter sits in its bucket's full (unsharded) flat buffer."""

    entry: ParamEntry
    bucket: int
    start: int


@dataclass(frozen=True)
class Segment:
    """The part of a parameter held by one rank: ``length`` elements starting at ``param_start`` in the
    flattened local parameter, stored at ``shard_start`` in that rank's shard of the bucket."""

    slot: Slot
    param_start: int
    shard_start: int
    length: int

    @property
    def global_start(self) -> int:
        """Offset of this segment in the flattened global parameter (what checkpoints address)."""
        return self.slot.entry.global_offset + self.param_start


@dataclass
class Bucket:
    """A flat buffer of parameters of one domain and dtype, padded to ``group_size * align``."""

    index: int
    domain: str
    dtype_key: str
    group_size: int
    slots: list[Slot] = field(default_factory=list)
    numel: int = 0  # padded size of the full buffer
    muon: bool = False  # holds Muon matrices only (else AdamW parameters only)

    @property
    def shard_numel(self) -> int:
        """Elements of this bucket held by each rank of the domain (padding included)."""
        return self.numel // self.group_size

    @property
    def real_numel(self) -> int:
        """Parameter elements in the bucket (padding excluded)."""
        return sum(s.entry.numel for s in self.slots)

    def segments(self, rank: int) -> list[Segment]:
        """The pieces of parameters that ``rank`` (rank within the domain group) owns, in buffer order."""
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        out = []
        for slot in self.slots:
            a, b = max(lo, slot.start), min(hi, slot.start + slot.entry.numel)
            if a < b:
                out.append(Segment(slot, a - slot.start, a - lo, b - a))
        return out


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def plan_buckets(
    entries: list[ParamEntry], group_sizes: dict[str, int], bucket_numel: int, align: int
) -> list[Bucket]:
    """Pack parameters into buckets, domain by domain, in reverse registration order.

    Reverse order because backward produces gradients roughly from the last layer to the first, so
    the first buckets fill first and their reduce-scatter can start while backward continues.
    A bucket closes when the next parameter would push it past ``bucket_numel`` elements (a larger
    parameter gets a bucket of its own) or has another dtype. Dense buckets come first, then expert
    buckets, so each domain's shards are contiguous in the per-rank state buffers.

    Muon's matrices (``ParamEntry.matrix``) and AdamW's parameters fill buckets of their own, two open
    at a time, so that a bucket's update is one kind (only AdamW's hold a second moment); within a
    domain the buckets are then ordered by when backward completes them (their earliest-registered
    parameter's gradient comes last), the order in which reductions launch.
    """
    if bucket_numel < 1 or align < 1:
        raise SENTENCES.refuse("bucket-numel", bucket_numel=bucket_numel, align=align)
    buckets: list[Bucket] = []
    for domain in ("dense", "expert"):
        n = group_sizes[domain]
        mine: list[Bucket] = []
        current: dict[bool, Bucket] = {}
        for entry in reversed([e for e in entries if e.domain == domain]):
            kind = entry.matrix is not None
            bucket = current.get(kind)
            needed = _round_up(bucket.numel, align) + entry.numel if bucket else 0
            if (
                bucket is None
                or bucket.dtype_key != entry.dtype_key
                or (bucket.slots and needed > bucket_numel)
            ):
                bucket = current[kind] = Bucket(len(mine), domain, entry.dtype_key, n, muon=kind)
                mine.append(bucket)
            start = _round_up(bucket.numel, align)
            bucket.slots.append(Slot(entry, bucket.index, start))
            bucket.numel = start + entry.numel
        if any(b.muon for b in mine):  # one kind only: creation order is already completion order
            mine.sort(key=lambda b: -min(s.entry.index for s in b.slots))
        for bucket in mine:
            bucket.index = len(buckets)
            bucket.slots = [Slot(s.entry, bucket.index, s.start) for s in bucket.slots]
            bucket.numel = _round_up(max(bucket.numel, 1), n * align)
            buckets.append(bucket)
    return buckets


@dataclass(frozen=True)
class MatrixTask:
    """One Muon matrix of a bucket: ``rows`` x ``cols`` elements from ``start`` of the bucket's full flat
    buffer, of a parameter of param group ``group``, orthogonalised by domain rank ``owner``."""

    start: int
    rows: int
    cols: int
    group: int
    owner: int

    @property
    def cost(self) -> int:
        """Newton-Schulz work, proportional to its FLOPs: m * n * min(m, n)."""
        return self.rows * self.cols * min(self.rows, self.cols)


def matrix_owners(buckets: list[Bucket]) -> dict[int, list[MatrixTask]]:
    """Who orthogonalises each matrix of the Muon buckets: per bucket index its ``MatrixTask`` list.

    Each domain's ranks share its matrices by Newton-Schulz FLOPs, not bytes (longest processing time
    first within a bucket, the least-loaded rank so far taking the next matrix, ties to the lower rank;
    the loads carry over from bucket to bucket, so a bucket of fewer matrices than ranks still
    balances over the step). Every rank computes the same answer from the same layout."""
    out: dict[int, list[MatrixTask]] = {}
    loads: dict[str, list[int]] = {}
    for b in buckets:
        if not b.muon:
            continue
        load = loads.setdefault(b.domain, [0] * b.group_size)
        found = []
        for slot in b.slots:
            rows, cols = slot.entry.matrix  # type: ignore[misc]
            group = slot.entry.group
            found += [(slot.start + k * rows * cols, rows, cols, group) for k in range(slot.entry.matrices)]
        tasks = []
        for start, rows, cols, group in sorted(found, key=lambda t: (-t[1] * t[2] * min(t[1], t[2]), t[0])):
            owner = min(range(len(load)), key=lambda r: (load[r], r))
            task = MatrixTask(start, rows, cols, group, owner)
            load[owner] += task.cost
            tasks.append(task)
        out[b.index] = sorted(tasks, key=lambda t: t.start)
    return out


def padding_bound(buckets: list[Bucket], align: int) -> int:
    """Upper bound on the padding (in elements) in one rank's shards.

    Every rank holds ``numel / n`` elements of each bucket, and a bucket's padding is at most
    ``align - 1`` before each parameter after the first plus ``n * align - 1`` at the tail, so each rank
    holds at most ``ceil(((params - 1) * (align - 1) + n * align - 1) / n)`` padding elements per bucket
    above its exact share ``real / n``.
    """
    return sum(
        -(-((len(b.slots) - 1) * (align - 1) + b.group_size * align - 1) // b.group_size) for b in buckets
    )
