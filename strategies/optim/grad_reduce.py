"""Bucketed, EP-aware gradient reduction: the one engine behind both optimizer paths.

Dense parameters are replicated on all W ranks, each expert on the W/E ranks of its EDP group.
Every rank's loss is the mean over its own micro-batch, so the gradient of the global-batch loss is
(1/W) * sum over ranks of the local gradients. For dense parameters that sum runs over the world.
For expert parameters the all-to-all backward has already summed the contributions of the E ranks
of the EP group into the expert's owner, so the remaining sum runs over the EDP group only. Both are
therefore "pre-divide by W, then SUM-reduce" -- over the world for dense, over EDP for experts.
(Averaging expert gradients over EDP, or reducing them over the world, is wrong: the tests check it.)

Gradients are packed into flat buckets (``flat_buffers.plan_buckets``); post-accumulate-grad hooks
copy each gradient into its bucket, scaled by 1/W, and a bucket's reduction starts asynchronously as
soon as backward has produced all its gradients -- strictly in bucket order within each domain, so
every rank issues the same collectives in the same order. Two modes:

* plain (``sharded=False``, ``GradientSynchronizer``): each bucket is all-reduced in place and the
  parameters' ``.grad`` become views of the reduced bucket;
* sharded (``sharded=True``, ``EPShardedAdamW``): each bucket is reduce-scattered (or reduced per
  shard onto its owner, or all-reduced for the EP-unaware layout) and this rank's averaged shard
  lands in ``shard_grad``; gradients are consumed by the hooks (``p.grad`` becomes None).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial

from mula.layout.flat_buffers import Bucket, ParamEntry, Slot, plan_buckets
from mula.model.moe import is_expert_param
from mula.torch_compat import reduce_scatter_single as _reduce_scatter
from strategies.topology import LayoutMesh


def local_tensor(t: Tensor) -> Tensor:
    """This rank's part of `t`: the local shard of a DTensor (a tensor-parallel parameter or gradient),
    sharing its storage; `t` itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def is_tp_split(p: Tensor) -> bool:
    """Whether `p` is split over the TP group (a DTensor with a Shard placement): its elements differ
    between TP ranks, so sums over them (the gradient norm) add up over the TP group; a parameter
    replicated over it counts once."""
    return isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)


# the attribute marking a plain parameter replicated over the TP group whose gradient is partial there
_TP_PARTIAL = "tp_partial_mesh"


def mark_tp_partial(p: Tensor, tp_mesh: Any) -> None:
    """Mark plain parameter `p` as replicated over the 1-D `tp_mesh` with a *partial* gradient on each
    TP rank (an MoE layer's router and experts: each TP rank routes 1/T of the tokens,
    strategies/tensor_parallel_moe.py). As Megatron marks its sequence-parallel weights: the mark
    travels with the parameter, so every reducer (`laid_out_grad`) completes the sum."""
    setattr(p, _TP_PARTIAL, tp_mesh)


def laid_out_grad(p: Tensor, grad: Tensor) -> Tensor:
    """The gradient of parameter `p` in `p`'s own layout.

    A DTensor gradient can come back in another layout than its parameter: Partial (a sum over the TP
    group still to be taken: a norm weight under sequence parallelism sees 1/T of the tokens on each
    rank) or Replicate for a split parameter. Redistributing it to the parameter's placements takes
    the missing sum over the TP group (an all-reduce) or this rank's slice; skipping the all-reduce
    would silently train such weights on 1/T of the batch (tests/test_tensor_parallel.py checks it). A
    plain parameter marked by `mark_tp_partial` has a plain gradient that is Partial all the same: it
    gets the same sum (a new tensor, `grad` is kept)."""
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements):
        return grad.redistribute(p.device_mesh, p.placements)
    mesh = getattr(p, _TP_PARTIAL, None)
    if mesh is not None:
        return DTensor.from_local(grad, mesh, [Partial()], run_check=False).full_tensor()
    return grad


def local_grad(p: Tensor, grad: Tensor) -> Tensor:
    """This rank's gradient of parameter `p` as a plain tensor shaped like `p`'s local tensor
    (`laid_out_grad`, then its local shard)."""
    return local_tensor(laid_out_grad(p, grad))


def param_entry(
    index: int, name: str, p: Tensor, group: int, topology: LayoutMesh, matrix: tuple[int, int] | None = None
) -> ParamEntry:
    """The layout planner's view of parameter ``p``: its domain and its place in the global parameter
    (stacked expert parameters ``[E_local, ...]`` sit at ``ep_rank * numel`` of ``ep_size * numel``).
    A tensor-parallel (DTensor) parameter is its local shard: buckets hold local tensors. ``matrix``:
    the (rows, cols) of its Muon matrices, None when AdamW trains it."""
    p = local_tensor(p)
    shape = tuple(p.shape)
    if not is_expert_param(name):
        return ParamEntry(
            index, name, shape, p.numel(), str(p.dtype), group, "dense", 0, p.numel(), shape, matrix
        )
    if p.dim() < 1:
        raise ValueError(f"Expert parameter {name} must be stacked [E_local, ...], got a scalar.")
    t = topology
    return ParamEntry(
        index,
        name,
        shape,
        p.numel(),
        str(p.dtype),
        group,
        "expert",
        t.rank("ep") * p.numel(),
        t.size("ep") * p.numel(),
        (shape[0] * t.size("ep"), *shape[1:]),
        matrix,
    )


@dataclass
class Domain:
    """A set of buckets reduced (and, in sharded mode, sharded) over one process group."""

    name: str
    group: Any  # the group shards live in (None when it has one rank)
    size: int  # number of shards per bucket
    rank: int  # this rank's shard index
    scale: float  # gradients are pre-multiplied by this so the reduction sums to a mean
    global_ranks: list[int] = field(default_factory=list)  # group rank -> global rank
    rooted: bool = False  # reduce/broadcast per shard instead of reduce-scatter/all-gather
    all_reduce: bool = False  # all-reduce the whole bucket over reduce_group, keep this rank's slice
    reduce_group: Any = None
    buckets: list[Bucket] = field(default_factory=list)
    next_launch: int = 0  # index into buckets of the next reduction to launch this round


def make_domains(topology: LayoutMesh, *, sharded: bool, ep_aware: bool = True) -> dict[str, Domain]:
    """The dense and expert domains of a (W, E) layout; both pre-scale by 1/W (module docstring).

    Plain mode keeps whole buckets (one shard) and all-reduces them over the world (dense) or EDP
    (experts). Sharded mode shards dense buckets over the world (over EDP, all-reduced over the
    world, when not ``ep_aware``) and expert buckets over EDP."""
    t = topology
    replica_rank = t.rank("replica")
    world = t.group("replica") if t.size("replica") > 1 else None
    scale = 1.0 / t.size("replica")
    if not sharded:
        # EDP = 1: no reduction, the 1/W still applies
        edp = t.group("edp_cp") if t.size("edp_cp") > 1 else None
        return {
            "dense": Domain(
                "dense", None, 1, 0, scale, [replica_rank], all_reduce=world is not None, reduce_group=world
            ),
            "expert": Domain(
                "expert", None, 1, 0, scale, [replica_rank], all_reduce=edp is not None, reduce_group=edp
            ),
        }
    edp_ranks = t.group_ranks("edp_cp")
    expert = Domain("expert", t.group("edp_cp"), t.size("edp_cp"), t.rank("edp_cp"), scale, edp_ranks)
    if ep_aware:
        dense = Domain("dense", world, t.size("replica"), replica_rank, scale, t.group_ranks("replica"))
    else:
        dense = Domain(
            "dense", t.group("edp_cp"), t.size("edp_cp"), t.rank("edp_cp"), scale, edp_ranks,
            all_reduce=t.size("replica") > 1, reduce_group=world,
        )  # fmt: skip
    return {"dense": dense, "expert": expert}


@dataclass
class _Work:
    """An in-flight gradient reduction of one bucket."""

    handles: list[Any]  # collective work handles (empty when nothing is communicated)
    full: Tensor  # the full bucket buffer being reduced (kept alive until the reduction finishes)
    source: Tensor | None  # where this rank's reduced shard lands, if not straight in shard_grad
    add: bool  # add into the shard (it already holds gradients since zero_grad) rather than copy


@dataclass
class ReduceState:
    """Per-bucket gradient buffers and in-flight work."""

    domain: Domain
    shard_offset: int  # where this bucket's shard starts in the flat per-rank shard buffers
    dtype: torch.dtype  # dtype gradients are accumulated and reduced in
    grad_full: Tensor | None = None
    arrived: int = 0
    launched: bool = False
    shard_fresh: bool = True  # shard_grad slice holds nothing since zero_grad: copy, don't add
    written: set[int] = field(default_factory=set)  # slots of grad_full written since its last reduction
    gaps: list[tuple[int, int]] = field(default_factory=list)  # padding ranges of the full bucket
    reduce_work: list[_Work] = field(default_factory=list)


class GradReducer:
    """Bucketed gradient reduction over the dense and expert domains (see the module docstring).

    Args:
        params: the parameters, ``params[e.index]`` for every entry.
        entries: their layout entries (``param_entry``).
        topology: the EP layout.
        sharded: reduce into this rank's shard (``shard_grad``) instead of all-reducing whole buckets.
        bucket_numel, align: bucket size and alignment (``plan_buckets``).
        zero_stage: 1 keeps a full gradient buffer per bucket; 2 only while its reduction is in flight.
        overlap: launch reductions from gradient hooks; False reduces everything in ``reduce()``.
        reduce_dtype: dtype of the gradient buffers (None: the parameters' dtype).
        ep_aware: see ``make_domains``.
        collectives: "native", "rooted" or "auto" (``ShardingOptions.collectives``).
        device: where the gradient buffers live.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        entries: Sequence[ParamEntry],
        topology: LayoutMesh,
        *,
        sharded: bool,
        bucket_numel: int,
        align: int = 1,
        zero_stage: int = 1,
        overlap: bool = True,
        reduce_dtype: torch.dtype | None = None,
        ep_aware: bool = True,
        collectives: str = "native",
        device: torch.device,
    ) -> None:
        self.params, self.entries, self.topology = list(params), list(entries), topology
        self.sharded, self.zero_stage, self.device = sharded, zero_stage, device
        self.sync = True  # False: accumulation micro-batch (no_sync / GradientSynchronizer.enabled)
        self.round_open = False  # gradients arrived that are not yet reduced
        self.domains = make_domains(topology, sharded=sharded, ep_aware=ep_aware)
        for dom in self.domains.values():
            dom.rooted = _use_rooted(collectives, dom.group, dom.size, device)
        sizes = {d.name: d.size for d in self.domains.values()}
        self.buckets = plan_buckets(self.entries, sizes, bucket_numel, align)
        self.slots: dict[int, Slot] = {s.entry.index: s for b in self.buckets for s in b.slots}
        self.states: list[ReduceState] = []
        offset = 0
        for b in self.buckets:
            dom = self.domains[b.domain]
            dom.buckets.append(b)
            dtype = reduce_dtype or self.params[b.slots[0].entry.index].dtype
            st = ReduceState(dom, offset, dtype)
            offset += b.shard_numel
            if zero_stage == 1:
                st.grad_full = torch.zeros(b.numel, dtype=dtype, device=device)
            ends = [0] + [s.start + s.entry.numel for s in b.slots]
            starts = [s.start for s in b.slots] + [b.numel]
            st.gaps = [(e, s) for e, s in zip(ends, starts) if s > e]
            self.states.append(st)
        self.shard_grad = torch.zeros(offset, dtype=reduce_dtype, device=device) if sharded else None
        self.domain_ranges: dict[str, tuple[int, int]] = {}
        for name in ("dense", "expert"):
            idx = [i for i, b in enumerate(self.buckets) if b.domain == name]
            if idx:
                lo = self.states[idx[0]].shard_offset
                self.domain_ranges[name] = (
                    lo,
                    self.states[idx[-1]].shard_offset + self.buckets[idx[-1]].shard_numel,
                )
        self.overlap = overlap
        # on_launch(bucket index): called after a hook-driven launch of the step's last backward (sync),
        # so the offloaded optimizer can start that bucket's host update (strategies.optim.offload)
        self.on_launch: Any = None
        # a host worker thread may wait for a bucket's reduction while backward goes on (offload)
        self._wait_lock = threading.Lock()
        self._hooks: list[Any] = []
        if overlap:
            for entry in self.entries:
                self._hooks.append(
                    self.params[entry.index].register_post_accumulate_grad_hook(self._make_hook(entry.index))
                )

    # ----------------------------------------------------------------------------------------
    # arrival

    def _make_hook(self, index: int):
        def hook(p: Tensor) -> None:
            self._on_grad(index, p)

        return hook

    def _on_grad(self, index: int, p: Tensor) -> None:
        """Copy a freshly accumulated gradient into its bucket and launch ready buckets, in order.

        Sharded mode consumes ``p.grad`` (later gradients add up in the bucket; ZeRO-2 reduces every
        backward, accumulation included). Plain mode leaves ``p.grad`` to autograd, so each arrival
        overwrites with the running total, and accumulation micro-batches copy nothing."""
        if p.grad is None:
            return
        syncing = self.sync or (self.sharded and self.zero_stage == 2)
        if not self.sharded and not syncing:
            return
        slot = self.slots[index]
        st = self.states[slot.bucket]
        if syncing and st.launched:
            if not self.sharded:  # plain: the round's reduction already has this gradient
                return
            raise RuntimeError(
                f"A gradient for {slot.entry.name} arrived after its bucket was already reduced in this round; "
                "wrap all but the last accumulation backward in optimizer.no_sync(), or call "
                "reduce_gradients() between backward passes."
            )
        self._accumulate(slot, st, p.grad)
        if self.sharded:
            p.grad = None
        self.round_open = True
        if syncing:
            st.arrived += 1
            if st.arrived == len(self.buckets[slot.bucket].slots):
                self._launch_ready(st.domain)

    def _accumulate(self, slot: Slot, st: ReduceState, grad: Tensor) -> None:
        grad = local_grad(self.params[slot.entry.index], grad)
        if st.reduce_work and self.zero_stage == 1:
            self._wait(st)  # the in-flight reduction still uses grad_full
        if st.grad_full is None:
            st.grad_full = torch.empty(self.buckets[slot.bucket].numel, dtype=st.dtype, device=self.device)
        view = st.grad_full[slot.start : slot.start + slot.entry.numel]
        if self.sharded and slot.entry.index in st.written:
            view.add_(grad.reshape(-1), alpha=st.domain.scale)
        elif grad.dtype == view.dtype:  # first gradient since the last reduction (or plain's total)
            torch.mul(grad.reshape(-1), st.domain.scale, out=view)
            st.written.add(slot.entry.index)
        else:  # bf16 gradient into an fp32 bucket: widen first, so the 1/W scaling is not rounded
            view.copy_(grad.reshape(-1)).mul_(st.domain.scale)
            st.written.add(slot.entry.index)

    # ----------------------------------------------------------------------------------------
    # launch and wait

    def _launch_ready(self, dom: Domain) -> None:
        while dom.next_launch < len(dom.buckets):
            b = dom.buckets[dom.next_launch]
            if self.states[b.index].arrived < len(b.slots):
                return
            self._launch(b)
            if self.sync and self.on_launch is not None:
                self.on_launch(b.index)
        if all(d.next_launch == len(d.buckets) for d in self.domains.values()):
            # Every bucket was launched from the hooks: the round is complete (what is in flight is
            # waited for in reduce()); a further backward starts a new round.
            self._close_round()

    def _close_round(self) -> None:
        for d in self.domains.values():
            d.next_launch = 0
        for st in self.states:
            st.launched, st.arrived = False, 0
        self.round_open = False

    def _launch(self, b: Bucket) -> None:
        """Start reducing one bucket; in sharded mode this rank's averaged shard lands in shard_grad
        when waited for. Every reduction after the first since zero_grad adds into the shard
        (accumulation over ZeRO-2 micro-batches, or several backward passes), so the buffer it came
        from can be reused."""
        st = self.states[b.index]
        dom = st.domain
        if st.reduce_work:
            self._wait(st)
        if st.grad_full is None:  # no gradient on this rank (unused parameters): still take part
            st.grad_full = torch.empty(b.numel, dtype=st.dtype, device=self.device)
        # Zero what holds no gradient of this round: padding (a rooted reduce may have used it as
        # scratch) and parameters that got no gradient since the last reduction.
        for lo, hi in st.gaps:
            st.grad_full[lo:hi].zero_()
        for slot in b.slots:
            if slot.entry.index not in st.written:
                st.grad_full[slot.start : slot.start + slot.entry.numel].zero_()
        st.written.clear()
        full, r = st.grad_full, dom.rank
        add = not st.shard_fresh
        st.shard_fresh = False
        if dom.all_reduce:  # whole-bucket sum, then keep this rank's slice (all of it in plain mode)
            handles = [dist.all_reduce(full, group=dom.reduce_group, async_op=True)]
            source: Tensor | None = full[r * b.shard_numel : (r + 1) * b.shard_numel]
        else:
            shard = (
                None
                if self.shard_grad is None
                else self.shard_grad[st.shard_offset : st.shard_offset + b.shard_numel]
            )
            out = torch.empty_like(shard) if add and shard is not None else shard
            source, handles = reduce_scatter_shards(full, dom, out)
            if source is shard:  # landed in place
                source = None
        if not self.sharded:
            source = None  # plain: the result stays in grad_full, where the .grad views point
        st.reduce_work.append(_Work(handles, full, source, add))
        if self.zero_stage == 2:
            st.grad_full = None  # ZeRO-2: the full buffer lives only while in flight
        st.launched, st.arrived = True, 0
        dom.next_launch += 1

    def _wait(self, st: ReduceState) -> list[_Work]:
        with self._wait_lock:  # whoever comes first (main thread or offload worker) lands the shard
            landed = st.reduce_work
            for work in landed:
                for handle in work.handles:
                    handle.wait()
                if work.source is not None:
                    n = work.source.numel()
                    shard = self.shard_grad[st.shard_offset : st.shard_offset + n]
                    shard.add_(work.source) if work.add else shard.copy_(work.source)
            st.reduce_work = []
        return landed

    def wait_bucket(self, index: int) -> list[_Work]:
        """Block until bucket ``index``'s launched reduction has landed in ``shard_grad`` (thread-safe).
        Returns the landed work: a caller on another stream keeps its buffers alive until that stream
        has finished with them."""
        return self._wait(self.states[index])

    def reduce(self) -> None:
        """Finish this round: launch every bucket not yet launched (in order, on every rank) and
        wait. Idempotent.

        Every rank must have produced gradients since the last reduction (true for any loss of the
        model); a rank with none would skip the collectives the others launch."""
        if not self.overlap:
            for p, entry in zip(self.params, self.entries):
                if p.grad is not None:
                    slot = self.slots[entry.index]
                    self._accumulate(slot, self.states[slot.bucket], p.grad)
                    if self.sharded:
                        p.grad = None
                    self.round_open = True
        if self.round_open:
            for dom in self.domains.values():
                while dom.next_launch < len(dom.buckets):
                    self._launch(dom.buckets[dom.next_launch])
            self._close_round()
        for st in self.states:
            self._wait(st)

    def point_grads(self) -> None:
        """Plain mode, after ``reduce()``: make every ``p.grad`` a view of its reduced bucket (the next
        step's zero_grad drops the alias)."""
        for b, st in zip(self.buckets, self.states):
            for slot in b.slots:
                p = self.params[slot.entry.index]
                view = st.grad_full[slot.start : slot.start + slot.entry.numel].view(slot.entry.shape)
                if isinstance(p, DTensor):  # the reduced local shard, as the parameter's DTensor gradient
                    view = DTensor.from_local(view, p.device_mesh, p.placements, run_check=False)
                p.grad = view

    def zero_grad(self) -> None:
        """Forget accumulated gradients (flat buffers are zeroed or overwritten, never freed)."""
        for st in self.states:
            self._wait(st)
            if self.zero_stage == 2:
                st.grad_full = None
            st.written.clear()  # the next gradient overwrites; the rest is zeroed at launch
            st.shard_fresh = True
        self._close_round()
        if self.shard_grad is not None:
            self.shard_grad.zero_()
        for p in self.params:
            p.grad = None

    def remove_hooks(self) -> None:
        """Detach the gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def reduce_scatter_shards(full: Tensor, dom: Domain, out: Tensor | None) -> tuple[Tensor, list[Any]]:
    """Start summing ``full`` (a bucket's flat buffer, one shard per rank of ``dom``) over the domain so
    that this rank gets the sum of its shard: (where it lands, the work handles). A reduce-scatter
    into ``out``, or, in a rooted domain, one reduce per shard onto its owner, landing in place in
    ``full`` (whose other shards are then scratch); with one rank, ``full`` is the result."""
    n, r = dom.size, dom.rank
    if n == 1:  # (every domain of the plain, unsharded mode: no `out`)
        return full, []
    if dom.rooted:
        chunks = full.chunk(n)
        handles = [
            dist.reduce(chunks[i], dst=dom.global_ranks[i], group=dom.group, async_op=True) for i in range(n)
        ]
        return chunks[r], handles
    return out, [_reduce_scatter(out, full, group=dom.group, async_op=True)]


def _use_rooted(choice: str, group: Any, size: int, device: torch.device) -> bool:
    if choice != "auto" or size == 1:
        return choice == "rooted" and size > 1
    return dist.get_backend(group) == "gloo" and device.type == "cpu"
