"""EP-aware sharded AdamW: fp32 master weights and Adam moments split exactly once across all ranks.

Layout (W ranks, expert-parallel size E, EDP = W / E; see strategies/topology.py):

* dense parameters are replicated on all W ranks, so their gradients are reduce-scattered over the
  world and each rank keeps 1/W of their optimizer state;
* expert parameters (names containing ".experts.") differ between EP ranks and are replicated only
  across the EDP group, so their gradients are reduce-scattered over EDP and each rank keeps 1/EDP of
  its P_expert/E local expert elements, i.e. P_expert/W.

Each rank therefore holds 12 * (P_dense + P_expert) / W bytes (fp32 master + exp_avg + exp_avg_sq)
plus a few alignment-padding elements per bucket (see ``flat_buffers.padding_bound``). An EP-unaware
optimizer (everything sharded over EDP, the comparison in benchmarks/optimizer.py) holds
12 * (P_dense / EDP + P_expert / W).

Per step (the order the strategy follows, see ``EPShardedAdamW``):

1. backward: post-accumulate-grad hooks move each gradient into its bucket's flat buffer, scaled by
   1/W (dense gradients are the rank's own; expert gradients arrive from the all-to-all backward
   already summed over the EP group, so their sum over EDP covers every rank once), and launch an
   async reduce-scatter as soon as a bucket is complete — in bucket order, so every rank issues the
   same collectives in the same order;
2. ``reduce_gradients()``: launch what is left, wait, the rank now has its averaged gradient shard;
3. ``clip_grad_norm_(max_norm)``: one all-reduce of the local sum of squares (every element is
   owned by exactly one rank, so it is counted once) gives the global norm;
4. ``step()``: AdamW on the local shard bucket by bucket (lr, betas, eps, weight decay read from
   ``param_groups`` every step, so Lightning LR schedulers work), each bucket's all-gather of the
   updated parameters (in the model's dtype, fp32 or bf16) launched as soon as it is updated so it
   overlaps the update of the next bucket — and optionally the next forward.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mula.moe import is_expert_param
from strategies.flat_buffers import Bucket, ParamEntry, Segment, padding_bound, plan_buckets
from strategies.topology import ExpertParallelTopology

# torch >= 2.10 renamed the tensor collectives; keep working on the older names (torch >= 2.4).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

@dataclass
class ShardingOptions:
    """Knobs of EPShardedAdamW (all keyword arguments of the constructor and of ``from_adamw``).

    bucket_numel: elements per communication bucket (a larger parameter gets its own bucket).
    align: every parameter and every rank's shard starts at a multiple of this many elements.
    zero_stage: 1 keeps a full flat gradient buffer per bucket (gradients reduced once per
        optimizer step; accumulation with ``no_sync`` is free); 2 keeps gradients only as shards
        (a full bucket buffer lives only while its reduce-scatter is in flight; every backward,
        accumulation micro-batches included, reduce-scatters).
    overlap_grad_reduce: launch reduce-scatters from backward hooks; False reduces everything in
        ``reduce_gradients()`` (then ``p.grad`` stays readable until then).
    overlap_param_gather: leave the all-gathers in flight when ``step()`` returns and wait for each
        bucket in a forward pre-hook of the modules owning its parameters (needs ``module``).
    offload: keep master weights and moments in host memory and run the update on the CPU,
        overlapping each bucket's device-to-host copy with the update of the previous one.
    max_grad_norm: if set, ``step()`` clips to it unless ``clip_grad_norm_`` was already called.
    clip_after_step: no clipping during the first this-many optimizer steps (warmup); the norm is
        still computed and reported.
    reduce_dtype: dtype gradients are accumulated and reduced in.
    ep_aware: False shards dense state over EDP only (the EP-unaware comparison layout of the
        benchmark); dense gradients are then all-reduced over the world.
    collectives: "native" uses reduce-scatter and all-gather (NCCL/XCCL implement them optimally);
        "rooted" runs one reduce / broadcast per shard, rooted at the shard's owner (same traffic;
        gloo's reduce_scatter and all_gather are 2-6x slower than that on CPU); "auto" picks rooted
        for gloo, native otherwise.
    """

    bucket_numel: int = 2**24
    align: int = 16
    zero_stage: int = 1
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    offload: bool = False
    max_grad_norm: float | None = None
    clip_after_step: int = 0
    reduce_dtype: torch.dtype = torch.float32
    ep_aware: bool = True
    collectives: str = "auto"

    def __post_init__(self) -> None:
        if self.zero_stage not in (1, 2):
            raise ValueError(f"zero_stage must be 1 or 2, got {self.zero_stage}.")
        if self.bucket_numel < 1 or self.align < 1:
            raise ValueError(
                f"bucket_numel and align must be positive, got {self.bucket_numel}, {self.align}."
            )
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {self.max_grad_norm}.")
        if self.clip_after_step < 0:
            raise ValueError(f"clip_after_step must be >= 0, got {self.clip_after_step}.")
        if self.collectives not in ("auto", "native", "rooted"):
            raise ValueError(f"collectives must be 'auto', 'native' or 'rooted', got {self.collectives!r}.")
        if not self.reduce_dtype.is_floating_point:
            raise ValueError(f"reduce_dtype must be a floating-point dtype, got {self.reduce_dtype}.")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ShardingOptions:
        """Build from keyword arguments, naming any unknown one."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"Unknown EPShardedAdamW option(s) {unknown}; known options are {sorted(known)}."
            )
        return cls(**kwargs)


@dataclass
class _Domain:
    """A set of buckets reduced and sharded over one process group."""

    name: str
    group: Any
    size: int
    rank: int
    scale: float  # gradients are pre-multiplied by this so the reduction sums to a mean
    global_ranks: list[int] = field(default_factory=list)  # group rank -> global rank
    rooted: bool = False  # reduce/broadcast per shard instead of reduce-scatter/all-gather
    all_reduce: bool = False  # EP-unaware dense: all-reduce over the world, keep the EDP slice
    reduce_group: Any = None
    buckets: list[Bucket] = field(default_factory=list)
    next_launch: int = 0  # index into buckets of the next reduce-scatter to launch this round


@dataclass
class _Run:
    """A maximal range of one bucket shard whose parameters share a param group."""

    group: int
    lo: int
    hi: int


@dataclass
class _Progress:
    """The optimizer's mutable scalar state (see the note in ``EPShardedAdamW.__init__``)."""

    steps_done: int = 0  # optimizer steps taken (drives clip_after_step)
    round_open: bool = False  # gradients arrived that are not yet reduced
    clipped: bool = False  # clip_grad_norm_ already ran for the coming step
    sync: bool = True  # False inside no_sync()
    last_norm: Tensor | None = None
    last_step_ms: float = 0.0


@dataclass
class _Work:
    """An in-flight gradient reduction of one bucket."""

    handles: list[Any]  # collective work handles (empty when the group has one rank)
    full: Tensor  # the full bucket buffer being reduced (kept alive until the reduction finishes)
    source: Tensor | None  # where this rank's reduced shard lands, if not straight in shard_grad
    add: bool  # add into the shard (it already holds gradients since zero_grad) rather than copy


@dataclass
class _BucketState:
    """Per-bucket buffers and in-flight work."""

    domain: _Domain
    shard_offset: int  # where this bucket's shard starts in the flat per-rank state buffers
    param_full: Tensor  # the model parameters are views into this buffer
    grad_full: Tensor | None = None
    runs: list[_Run] = field(default_factory=list)
    arrived: int = 0
    launched: bool = False
    shard_fresh: bool = True  # shard_grad slice holds nothing since zero_grad: copy, don't add
    written: set[int] = field(default_factory=set)  # slots of grad_full written since its last reduction
    gaps: list[tuple[int, int]] = field(default_factory=list)  # padding ranges of the full bucket
    reduce_work: list[_Work] = field(default_factory=list)
    gather_work: list[Any] = field(default_factory=list)
    send: Tensor | None = None  # all-gather input (param dtype) when it cannot be the master shard
    host_send: Tensor | None = None  # offload: cast of the master shard in host memory
    copied_event: Any = None  # offload: device-to-host copy of the gradient shard done


class EPShardedAdamW(torch.optim.Optimizer):
    """Mixed-precision AdamW over flat buffers with EP-aware sharding of its state and gradients.

    Args:
        params: parameters or param-group dicts, as for ``torch.optim.AdamW`` (each group may set
            lr, betas, eps, weight_decay; group dicts are used as-is, so a scheduler holding them keeps
            working).
        named_params: ``(name, parameter)`` for every parameter in ``params`` (names decide dense vs
            expert and address the checkpoint); extra names (e.g. frozen parameters) are ignored.
        topology: the EP layout (``strategies.topology.build_topology``); None means one process, or
            the whole world with E = 1 when torch.distributed is initialised.
        module: the module the names are relative to; needed only for ``overlap_param_gather``.
        **options: fields of ``ShardingOptions``.

    The model parameters are re-pointed into flat per-bucket buffers (``p.data`` becomes a view), so
    the constructor must run after the model is materialised on its device, and every rank must
    construct it (it communicates once, to make replicas bit-identical).

    Calling sequence per optimizer step (what the strategy does):
        ``zero_grad()``; for each accumulation micro-batch but the last ``with opt.no_sync():
        loss.backward()``; the last ``loss.backward()``; optionally ``clip_grad_norm_(max_norm)``;
        ``step()``. ``step(closure)`` also runs the closure first, as Lightning does.
        ``reduce_gradients()`` may be called explicitly after backward; ``step`` and
        ``clip_grad_norm_`` call it when needed. After backward, gradients live in the optimizer
        (``p.grad`` is None): clip with ``clip_grad_norm_``, not ``torch.nn.utils.clip_grad_norm_``.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        named_params: Iterable[tuple[str, Tensor]],
        topology: ExpertParallelTopology | None = None,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        module: torch.nn.Module | None = None,
        **options: Any,
    ) -> None:
        self.options = ShardingOptions.from_kwargs(**options)
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(
                f"Invalid AdamW hyperparameters lr={lr}, betas={betas}, eps={eps}, wd={weight_decay}."
            )
        self._initialising = True
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self._initialising = False
        self.topology = topology if topology is not None else _default_topology()
        names = {id(p): n for n, p in named_params}
        self._params: list[Tensor] = []
        entries: list[ParamEntry] = []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(
                        "Every optimizer parameter needs a name: pass named_params covering all groups."
                    )
                if not p.requires_grad:
                    raise ValueError(
                        f"Parameter {names[id(p)]} does not require grad; leave it out of the optimizer."
                    )
                entries.append(self._entry(len(self._params), names[id(p)], p, gi))
                self._params.append(p)
        if not self._params:
            raise ValueError("EPShardedAdamW got no parameters.")
        devices = {p.device for p in self._params}
        if len(devices) != 1 or next(iter(devices)).type == "meta":
            raise ValueError(
                f"All parameters must be materialised on one device, found {sorted(map(str, devices))}."
            )
        self.device = next(iter(devices))
        self.state_device = torch.device("cpu") if self.options.offload else self.device
        self._domains = self._make_domains()
        sizes = {d.name: d.size for d in self._domains.values()}
        self.buckets = plan_buckets(entries, sizes, self.options.bucket_numel, self.options.align)
        self._entries = entries
        self._slots = {s.entry.index: s for b in self.buckets for s in b.slots}
        self._names = {id(p): e.name for e, p in zip(entries, self._params)}
        self._allocate()
        self._step_t = torch.zeros((), dtype=torch.float32, device=self.state_device)
        # Mutable scalars live in one shared object: Lightning's LightningOptimizer runs our methods
        # with itself as ``self`` and forwards only *reads* to us, so attribute writes would split.
        self._p = _Progress()
        self._hooks: list[Any] = []
        if self.options.overlap_grad_reduce:
            for entry, p in zip(entries, self._params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(entry.index)))
        if self.options.overlap_param_gather:
            if module is None:
                raise ValueError(
                    "overlap_param_gather=True needs module= (the module the parameter names refer to)."
                )
            self._register_forward_waits(module)
        self._gather_params()  # replicas become bit-identical to the master shards

    # ----------------------------------------------------------------------------------------
    # construction

    @classmethod
    def from_adamw(
        cls,
        adamw: torch.optim.Optimizer,
        named_params: Iterable[tuple[str, Tensor]],
        topology: ExpertParallelTopology | None,
        **options: Any,
    ) -> EPShardedAdamW:
        """Replace a ``torch.optim.AdamW`` (as returned by ``configure_optimizers``) by the sharded one.

        The AdamW's param-group dicts (lr, initial_lr, betas, eps, weight_decay, ...) are reused as
        they are; re-point ``scheduler.optimizer`` to the result. Its state must be empty (not stepped).
        """
        if not isinstance(adamw, torch.optim.AdamW):
            raise ValueError(f"from_adamw needs a torch.optim.AdamW, got {type(adamw).__name__}.")  # noqa: TRY004
        if any(adamw.state.values()):
            raise ValueError("from_adamw needs a fresh AdamW; load optimizer state after sharding instead.")
        for g in adamw.param_groups:
            if g.get("amsgrad") or g.get("maximize"):
                raise ValueError("EPShardedAdamW does not implement amsgrad or maximize.")
        d = adamw.defaults
        return cls(
            adamw.param_groups,
            named_params,
            topology,
            lr=float(d["lr"]),
            betas=tuple(d["betas"]),
            eps=d["eps"],
            weight_decay=d["weight_decay"],
            **options,
        )

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken so far (restored from checkpoints)."""
        return self._p.steps_done

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the flat layout is fixed once built."""
        if not getattr(self, "_initialising", False):
            raise ValueError("EPShardedAdamW cannot add param groups after construction; build a new one.")
        super().add_param_group(param_group)

    def _entry(self, index: int, name: str, p: Tensor, group: int) -> ParamEntry:
        expert = is_expert_param(name)
        topo = self.topology
        shape = tuple(p.shape)
        if expert:
            if p.dim() < 1:
                raise ValueError(f"Expert parameter {name} must be stacked [E_local, ...], got a scalar.")
            return ParamEntry(
                index,
                name,
                shape,
                p.numel(),
                str(p.dtype),
                group,
                "expert",
                topo.ep_rank * p.numel(),
                topo.ep_size * p.numel(),
                (shape[0] * topo.ep_size, *shape[1:]),
            )
        return ParamEntry(index, name, shape, p.numel(), str(p.dtype), group, "dense", 0, p.numel(), shape)

    def _make_domains(self) -> dict[str, _Domain]:
        t = self.topology
        world = t.world_group if t.world_size > 1 else None
        edp_ranks = t.edp_group_ranks()
        # Expert gradients that come back through the all-to-all are already sums over the EP group's
        # ranks' losses, so summing over EDP covers every rank once: scale by 1/W, like dense ones.
        edp = _Domain("expert", t.edp_group, t.edp_size, t.edp_rank, 1.0 / t.world_size, edp_ranks)
        if self.options.ep_aware:
            dense = _Domain(
                "dense", world, t.world_size, t.rank, 1.0 / t.world_size, list(range(t.world_size))
            )
        else:
            dense = _Domain(
                "dense", t.edp_group, t.edp_size, t.edp_rank, 1.0 / t.world_size, edp_ranks,
                all_reduce=t.world_size > 1, reduce_group=world,
            )  # fmt: skip
        for dom in (dense, edp):
            dom.rooted = self._use_rooted(dom.group, dom.size)
        return {"dense": dense, "expert": edp}

    def _use_rooted(self, group: Any, size: int) -> bool:
        choice = self.options.collectives
        if choice != "auto" or size == 1:
            return choice == "rooted" and size > 1
        return dist.get_backend(group) == "gloo" and self.device.type == "cpu"

    def _allocate(self) -> None:
        """Flat buffers: per bucket the full parameter buffer (params become views) and, for ZeRO-1,
        the full gradient buffer; per rank one flat fp32 master/exp_avg/exp_avg_sq/grad shard."""
        opt = self.options
        pin = self.options.offload and self.device.type != "cpu"
        self._bstate: list[_BucketState] = []
        offset = 0
        for b in self.buckets:
            dom = self._domains[b.domain]
            dom.buckets.append(b)
            dtype = self._params[b.slots[0].entry.index].dtype
            param_full = torch.zeros(b.numel, dtype=dtype, device=self.device)
            st = _BucketState(dom, offset, param_full)
            offset += b.shard_numel
            for slot in b.slots:
                p = self._params[slot.entry.index]
                view = param_full[slot.start : slot.start + slot.entry.numel]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)
            if opt.zero_stage == 1:
                st.grad_full = torch.zeros(b.numel, dtype=opt.reduce_dtype, device=self.device)
            ends = [0] + [s.start + s.entry.numel for s in b.slots]
            starts = [s.start for s in b.slots] + [b.numel]
            st.gaps = [(e, s) for e, s in zip(ends, starts) if s > e]
            st.runs = _runs(b.segments(dom.rank))
            if not dom.rooted and dom.size > 1 and (dtype != torch.float32 or opt.offload):
                st.send = torch.empty(b.shard_numel, dtype=dtype, device=self.device)
            if opt.offload:
                st.host_send = torch.empty(b.shard_numel, dtype=dtype, pin_memory=pin)
            self._bstate.append(st)
        zeros = {"dtype": torch.float32, "device": self.state_device}
        self.master = torch.zeros(offset, **zeros)
        self.exp_avg = torch.zeros(offset, **zeros)
        self.exp_avg_sq = torch.zeros(offset, **zeros)
        self.shard_grad = torch.zeros(offset, dtype=opt.reduce_dtype, device=self.device)
        self.host_grad = torch.zeros(offset, dtype=opt.reduce_dtype, pin_memory=pin) if opt.offload else None
        for b, st in zip(self.buckets, self._bstate):
            for seg in b.segments(st.domain.rank):
                p = self._params[seg.slot.entry.index]
                lo = st.shard_offset + seg.shard_start
                src = p.detach().reshape(-1)[seg.param_start : seg.param_start + seg.length]
                self.master[lo : lo + seg.length].copy_(src)
        self._domain_ranges = {}
        for name in ("dense", "expert"):
            idx = [i for i, b in enumerate(self.buckets) if b.domain == name]
            if idx:
                lo = self._bstate[idx[0]].shard_offset
                hi = self._bstate[idx[-1]].shard_offset + self.buckets[idx[-1]].shard_numel
                self._domain_ranges[name] = (lo, hi)

    # ----------------------------------------------------------------------------------------
    # gradients

    def _make_grad_hook(self, index: int):
        def hook(p: Tensor) -> None:
            self._on_grad(index, p)

        return hook

    def _on_grad(self, index: int, p: Tensor) -> None:
        """Move a freshly accumulated gradient into its bucket and launch ready buckets, in order."""
        if p.grad is None:
            return
        slot = self._slots[index]
        st = self._bstate[slot.bucket]
        syncing = self._p.sync or self.options.zero_stage == 2
        if syncing and st.launched:
            raise RuntimeError(
                f"A gradient for {slot.entry.name} arrived after its bucket was already reduced in this round; "
                "wrap all but the last accumulation backward in optimizer.no_sync(), or call "
                "reduce_gradients() between backward passes."
            )
        self._accumulate(slot, st, p.grad)
        p.grad = None
        self._p.round_open = True
        if syncing:
            st.arrived += 1
            if st.arrived == len(self.buckets[slot.bucket].slots):
                self._launch_ready(st.domain)

    def _accumulate(self, slot, st: _BucketState, grad: Tensor) -> None:
        if st.reduce_work and self.options.zero_stage == 1:
            self._wait_reduce(st)  # the in-flight reduction still uses grad_full
        if st.grad_full is None:
            st.grad_full = torch.empty(
                self.buckets[slot.bucket].numel, dtype=self.options.reduce_dtype, device=self.device
            )
        view = st.grad_full[slot.start : slot.start + slot.entry.numel]
        if slot.entry.index in st.written:
            view.add_(grad.reshape(-1), alpha=st.domain.scale)
        else:  # first gradient since the last reduction: overwrite (no zeroing pass needed)
            torch.mul(grad.reshape(-1), st.domain.scale, out=view)
            st.written.add(slot.entry.index)

    def _launch_ready(self, dom: _Domain) -> None:
        while dom.next_launch < len(dom.buckets):
            b = dom.buckets[dom.next_launch]
            if self._bstate[b.index].arrived < len(b.slots):
                return
            self._launch_reduce(b)
        if all(d.next_launch == len(d.buckets) for d in self._domains.values()):
            # Every bucket was launched from the hooks: the round is complete (what is in flight is
            # waited for in reduce_gradients); a further backward starts a new round.
            self._close_round()

    def _close_round(self) -> None:
        for d in self._domains.values():
            d.next_launch = 0
        for st in self._bstate:
            st.launched, st.arrived = False, 0
        self._p.round_open = False

    def _launch_reduce(self, b: Bucket) -> None:
        """Start reducing one bucket; this rank's averaged shard lands in shard_grad when waited for.

        Every reduction after the first since zero_grad adds into the shard (accumulation over
        ZeRO-2 micro-batches, or several backward passes), so the buffer it came from can be reused."""
        st = self._bstate[b.index]
        dom = st.domain
        if st.reduce_work:
            self._wait_reduce(st)
        if st.grad_full is None:  # no gradient on this rank (unused parameters): still take part
            st.grad_full = torch.empty(b.numel, dtype=self.options.reduce_dtype, device=self.device)
        # Zero what holds no gradient of this round: padding (a rooted reduce may have used it as
        # scratch) and parameters that got no gradient since the last reduction.
        for lo, hi in st.gaps:
            st.grad_full[lo:hi].zero_()
        for slot in b.slots:
            if slot.entry.index not in st.written:
                st.grad_full[slot.start : slot.start + slot.entry.numel].zero_()
        st.written.clear()
        full, n, r = st.grad_full, dom.size, dom.rank
        mine = full[r * b.shard_numel : (r + 1) * b.shard_numel]
        add = not st.shard_fresh
        st.shard_fresh = False
        if dom.all_reduce:  # EP-unaware dense: world sum, then keep this rank's EDP slice
            handles, source = [dist.all_reduce(full, group=dom.reduce_group, async_op=True)], mine
        elif n == 1:
            handles, source = [], mine
        elif dom.rooted:  # shard i is reduced onto its owner, in place
            chunks = full.chunk(n)
            handles = [
                dist.reduce(chunks[i], dst=dom.global_ranks[i], group=dom.group, async_op=True)
                for i in range(n)
            ]
            source = mine
        else:
            shard = self.shard_grad[st.shard_offset : st.shard_offset + b.shard_numel]
            source = torch.empty_like(shard) if add else None
            handles = [
                _reduce_scatter(shard if source is None else source, full, group=dom.group, async_op=True)
            ]
        st.reduce_work.append(_Work(handles, full, source, add))
        if self.options.zero_stage == 2:
            st.grad_full = None  # ZeRO-2: the full buffer lives only while in flight
        st.launched, st.arrived = True, 0
        dom.next_launch += 1

    def _wait_reduce(self, st: _BucketState) -> None:
        for work in st.reduce_work:
            for handle in work.handles:
                handle.wait()
            if work.source is not None:
                n = work.source.numel()
                shard = self.shard_grad[st.shard_offset : st.shard_offset + n]
                shard.add_(work.source) if work.add else shard.copy_(work.source)
        st.reduce_work = []

    def reduce_gradients(self) -> None:
        """Finish this round's gradient reduction: launch every bucket not yet launched (in order, on
        every rank), wait, and leave the averaged gradient shard in ``shard_grad``. Idempotent.

        Every rank must have produced gradients since the last reduction (true for any loss of the
        model); a rank with none would skip the collectives the others launch."""
        if not self.options.overlap_grad_reduce:
            for p, entry in zip(self._params, self._entries):
                if p.grad is not None:
                    slot = self._slots[entry.index]
                    self._accumulate(slot, self._bstate[slot.bucket], p.grad)
                    p.grad = None
                    self._p.round_open = True
        if self._p.round_open:
            for dom in self._domains.values():
                while dom.next_launch < len(dom.buckets):
                    self._launch_reduce(dom.buckets[dom.next_launch])
            self._close_round()
        for st in self._bstate:
            self._wait_reduce(st)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient-accumulation micro-batch: ZeRO-1 only accumulates (no communication); ZeRO-2
        reduce-scatters as usual and folds the result into the shards on exit."""
        prev, self._p.sync = self._p.sync, False
        try:
            yield
        finally:
            self._p.sync = prev
            if self.options.zero_stage == 2:
                self.reduce_gradients()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear accumulated gradients (flat buffers are zeroed, never freed, whatever set_to_none)."""
        for st in self._bstate:
            self._wait_reduce(st)
            if self.options.zero_stage == 2:
                st.grad_full = None
            st.written.clear()  # the next gradient overwrites; the rest is zeroed at launch
            st.shard_fresh = True
        self._close_round()
        self.shard_grad.zero_()
        for p in self._params:
            p.grad = None
        self._p.clipped = False

    # ----------------------------------------------------------------------------------------
    # clipping

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the (global) gradient to ``max_norm`` as ``torch.nn.utils.clip_grad_norm_`` would on the
        unsharded model; returns the total norm before clipping. One all-reduce over the world.

        No scaling during the first ``clip_after_step`` optimizer steps (warmup)."""
        if norm_type not in (2.0, float("inf")):
            raise ValueError(f"clip_grad_norm_ supports norm_type 2 or inf, got {norm_type}.")
        self.reduce_gradients()
        norm = self._global_norm(float(norm_type))
        if self._p.steps_done >= self.options.clip_after_step:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            self.shard_grad.mul_(coef.to(self.shard_grad.dtype))
        self._p.clipped = True
        return norm

    def _global_norm(self, norm_type: float) -> Tensor:
        parts = []
        for name, (lo, hi) in self._domain_ranges.items():
            g = self.shard_grad[lo:hi].float()
            if norm_type == float("inf"):
                parts.append(g.abs().max() if g.numel() else g.new_zeros(()))
            else:
                sq = torch.dot(g, g)
                if name == "dense" and not self.options.ep_aware:
                    sq = sq / self.topology.ep_size  # each dense element is held by E ranks
                parts.append(sq)
        total = torch.stack(parts).max() if norm_type == float("inf") else torch.stack(parts).sum()
        if self.topology.world_size > 1:
            op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
            dist.all_reduce(total, op=op, group=self.topology.world_group)
        norm = total if norm_type == float("inf") else total.sqrt()
        self._p.last_norm = norm
        return norm

    # ----------------------------------------------------------------------------------------
    # update

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Run ``closure`` (forward + backward) if given, then reduce, clip (``max_grad_norm``), update
        the local shard with AdamW and all-gather the new parameters. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t0 = time.perf_counter()
        self.reduce_gradients()
        if self.options.max_grad_norm is not None and not self._p.clipped:
            self.clip_grad_norm_(self.options.max_grad_norm)
        self._step_t.add_(1)
        grads = self.shard_grad
        if self.options.offload:
            grads = self.host_grad
            for b, st in zip(self.buckets, self._bstate):  # queue every copy; update as they land
                lo, hi = st.shard_offset, st.shard_offset + b.shard_numel
                self.host_grad[lo:hi].copy_(self.shard_grad[lo:hi], non_blocking=True)
                st.copied_event = _record_event(self.device)
        for b, st in zip(self.buckets, self._bstate):
            if st.copied_event is not None:
                st.copied_event.synchronize()
                st.copied_event = None
            self._update_bucket(b, st, grads)
            self._launch_gather(b, st)
        if not self.options.overlap_param_gather:
            self.wait_for_params()
        self._p.steps_done += 1
        self._p.clipped = False
        self._p.last_step_ms = (time.perf_counter() - t0) * 1e3
        return loss

    def _update_bucket(self, b: Bucket, st: _BucketState, grads: Tensor) -> None:
        by_group: dict[int, list[list[Tensor]]] = {}
        for run in st.runs:
            lo, hi = st.shard_offset + run.lo, st.shard_offset + run.hi
            lists = by_group.setdefault(run.group, [[], [], [], []])
            g = grads[lo:hi]
            lists[0].append(self.master[lo:hi])
            lists[1].append(g if g.dtype == torch.float32 else g.float())
            lists[2].append(self.exp_avg[lo:hi])
            lists[3].append(self.exp_avg_sq[lo:hi])
        for gi, (p, g, m, v) in by_group.items():
            group = self.param_groups[gi]
            beta1, beta2 = group["betas"]
            _adamw(
                p,
                g,
                m,
                v,
                self._step_t,
                lr=float(group["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                weight_decay=float(group["weight_decay"]),
                eps=float(group["eps"]),
            )

    def _launch_gather(self, b: Bucket, st: _BucketState) -> None:
        """Start the all-gather of this rank's updated shard of ``b`` into the model parameters."""
        dom = st.domain
        lo, hi = st.shard_offset, st.shard_offset + b.shard_numel
        n, r = dom.size, dom.rank
        if self.options.offload:
            st.host_send.copy_(self.master[lo:hi])  # cast on the host, then one transfer
            src = st.host_send
        else:
            src = self.master[lo:hi]
        if dom.rooted or n == 1:  # write the own shard in place, then its owner broadcasts each
            chunks = st.param_full.chunk(n)
            chunks[r].copy_(src, non_blocking=self.options.offload)
            st.gather_work = [
                dist.broadcast(chunks[i], src=dom.global_ranks[i], group=dom.group, async_op=True)
                for i in range(n)
                if n > 1
            ]
            return
        if st.send is not None:
            src = st.send.copy_(src, non_blocking=self.options.offload)
        st.gather_work = [_all_gather(st.param_full, src, group=dom.group, async_op=True)]

    def wait_for_params(self) -> None:
        """Block until every all-gather launched by ``step()`` has landed in the model parameters
        (needed before reading parameters outside a forward when ``overlap_param_gather`` is on)."""
        for st in self._bstate:
            self._wait_gather(st)

    def _wait_gather(self, st: _BucketState) -> None:
        for handle in st.gather_work:
            handle.wait()
        st.gather_work = []

    def _gather_params(self) -> None:
        for b, st in zip(self.buckets, self._bstate):
            self._launch_gather(b, st)
        self.wait_for_params()

    def _register_forward_waits(self, module: torch.nn.Module) -> None:
        owners: dict[str, set[int]] = {}
        for b in self.buckets:
            for s in b.slots:
                owners.setdefault(s.entry.name.rpartition(".")[0], set()).add(b.index)
        for owner, bucket_ids in owners.items():
            try:
                sub = module.get_submodule(owner)
            except AttributeError as err:
                raise ValueError(
                    f"Parameter owner {owner!r} is not a submodule of the given module."
                ) from err
            states = [self._bstate[i] for i in sorted(bucket_ids)]

            def wait(_mod, _args, states=states) -> None:
                for st in states:
                    self._wait_gather(st)

            self._hooks.append(sub.register_forward_pre_hook(wait))

    # ----------------------------------------------------------------------------------------
    # reporting

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: fp32 master weights + exp_avg + exp_avg_sq shards."""
        return self.master.numel() * 4 + self.exp_avg.numel() * 4 + self.exp_avg_sq.numel() * 4

    def owned_numel(self) -> int:
        """Parameter elements whose state this rank owns (padding excluded)."""
        return sum(s.length for b, st in zip(self.buckets, self._bstate) for s in b.segments(st.domain.rank))

    def padding_bytes(self) -> int:
        """State bytes spent on alignment padding on this rank (``state_bytes() - 12 * owned_numel()``)."""
        return self.state_bytes() - 12 * self.owned_numel()

    def padding_bound_bytes(self) -> int:
        """The stated upper bound on ``padding_bytes()`` (``flat_buffers.padding_bound``) plus the
        rounding of this rank's exact share 12 * P / W."""
        return 12 * (padding_bound(self.buckets, self.options.align) + len(self.buckets))

    def grad_buffer_bytes(self) -> int:
        """Bytes of persistent gradient buffers (full buckets for ZeRO-1, shards only for ZeRO-2)."""
        full = sum(
            st.grad_full.numel() * st.grad_full.element_size()
            for st in self._bstate
            if st.grad_full is not None and self.options.zero_stage == 1
        )
        return full + self.shard_grad.numel() * self.shard_grad.element_size()

    def metrics(self) -> dict[str, float]:
        """Values for the logger: optim/state_bytes, optim/padding_bytes, optim/grad_buffer_bytes,
        optim/step_ms (host wall time of the last ``step()``) and optim/grad_norm (last computed)."""
        out = {
            "optim/state_bytes": float(self.state_bytes()),
            "optim/padding_bytes": float(self.padding_bytes()),
            "optim/grad_buffer_bytes": float(self.grad_buffer_bytes()),
            "optim/step_ms": self._p.last_step_ms,
        }
        if self._p.last_norm is not None:
            out["optim/grad_norm"] = float(self._p.last_norm)
        return out

    # ----------------------------------------------------------------------------------------
    # checkpoints

    def sharded_state_dict(self) -> dict[str, Any]:
        """State for ``torch.distributed.checkpoint``: per parameter (global name) a 1-D ShardedTensor
        over the flattened *global* parameter for master/exp_avg/exp_avg_sq (expert parameters in
        global expert order), the step count and the param groups. Local shards are views of the live
        buffers, so ``dcp.load`` into this dict loads in place; then call ``load_sharded_state_dict``."""
        if not self.options.ep_aware and self.topology.ep_size > 1:
            raise ValueError("Checkpointing the EP-unaware comparison layout is not supported.")
        self.wait_for_params()
        state: dict[str, Any] = {}
        for entry in self._entries:
            state[entry.name] = {
                kind: _sharded_tensor(buf, self._global_shards(entry), entry, self)
                for kind, buf in (
                    ("master", self.master),
                    ("exp_avg", self.exp_avg),
                    ("exp_avg_sq", self.exp_avg_sq),
                )
            }
        # Param groups keyed by index (strings), not a list of dicts: if DCP ever falls back to its
        # pre-2.4 key format (it does when a saved key is missing here), the keys stay the same.
        groups = {}
        for i, group in enumerate(self.param_groups):
            g = {k: v for k, v in group.items() if k != "params"}
            g["param_names"] = [self._name_of(p) for p in group["params"]]
            groups[str(i)] = g
        return {"state": state, "param_groups": groups, "step": self._step_t.detach().clone()}

    state_dict = sharded_state_dict  # Lightning's default optimizer_state() gets the sharded form

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``sharded_state_dict()`` produced (after ``dcp.load`` filled it), possibly saved at
        another (W, E) layout, then refresh the model parameters from the loaded master weights."""
        groups = state_dict.get("param_groups")
        if isinstance(groups, dict):
            groups = [groups.get(str(i)) for i in range(len(groups))]
        if groups is None or len(groups) != len(self.param_groups) or None in groups:
            raise ValueError("The optimizer checkpoint has a different number of param groups.")
        for mine, saved in zip(self.param_groups, groups):
            names = [self._name_of(p) for p in mine["params"]]
            if list(saved["param_names"]) != names:
                raise ValueError(
                    "The optimizer checkpoint's param groups name other parameters than this model's."
                )
            for k, v in saved.items():
                if k not in ("params", "param_names"):
                    mine[k] = tuple(v) if k == "betas" else v
        step = state_dict["step"]
        self._step_t.copy_(step if isinstance(step, Tensor) else torch.tensor(float(step)))
        self._p.steps_done = int(self._step_t.item())
        for entry in self._entries:
            saved = state_dict["state"].get(entry.name)
            if saved is None:
                raise ValueError(f"The optimizer checkpoint has no state for parameter {entry.name}.")
            for kind, buf in (
                ("master", self.master),
                ("exp_avg", self.exp_avg),
                ("exp_avg_sq", self.exp_avg_sq),
            ):
                self._copy_in(entry, saved[kind], buf)
        self._gather_params()

    load_state_dict = load_sharded_state_dict

    def _copy_in(self, entry: ParamEntry, saved: Any, buf: Tensor) -> None:
        shards = saved.local_shards() if hasattr(saved, "local_shards") else None
        if shards is None:
            raise ValueError(
                f"Optimizer state for {entry.name} is not a ShardedTensor from sharded_state_dict()."
            )
        by_offset = {s.metadata.shard_offsets[0]: s.tensor for s in shards}
        for st, seg in self._local_segments(entry):
            t = by_offset.get(seg.global_start)
            if t is None or t.numel() != seg.length:
                raise ValueError(f"Optimizer state for {entry.name} does not match this layout's shards.")
            dst = buf[st.shard_offset + seg.shard_start : st.shard_offset + seg.shard_start + seg.length]
            if dst.data_ptr() != t.data_ptr():
                dst.copy_(t)

    def _name_of(self, p: Tensor) -> str:
        return self._names[id(p)]

    def _local_segments(self, entry: ParamEntry) -> list[tuple[_BucketState, Segment]]:
        slot = self._slots[entry.index]
        st = self._bstate[slot.bucket]
        return [
            (st, s)
            for s in self.buckets[slot.bucket].segments(st.domain.rank)
            if s.slot.entry.index == entry.index
        ]

    def _global_shards(self, entry: ParamEntry) -> list[tuple[int, int, int]]:
        """(world rank, global offset, length) of every piece of ``entry`` over the whole world. The
        layout is the same on every rank of a domain (and across EP ranks for experts), so it is
        computed locally."""
        slot = self._slots[entry.index]
        b = self.buckets[slot.bucket]
        t = self.topology
        out = []
        for rank in range(t.world_size):
            ep_rank, edp_rank = rank % t.ep_size, rank // t.ep_size
            dom_rank = rank if entry.domain == "dense" else edp_rank
            base = ep_rank * entry.numel if entry.domain == "expert" else 0
            pieces = [s for s in b.segments(dom_rank) if s.slot.entry.index == entry.index]
            # A rank holding nothing of this parameter gets an empty shard: DCP drops ShardedTensors
            # without local shards from a rank's plan, and a missing key derails its loading.
            out.extend((rank, base + s.param_start, s.length) for s in pieces)
            # It sits at the end of the tensor: DCP de-duplicates chunks by (key, offset) across
            # ranks, so an empty chunk at a real chunk's offset could replace that chunk.
            if not pieces:
                out.append((rank, entry.global_numel, 0))
        return out

    def close(self) -> None:
        """Remove the backward and forward hooks this optimizer registered."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


# --------------------------------------------------------------------------------------------
# helpers


def _default_topology() -> ExpertParallelTopology:
    if dist.is_available() and dist.is_initialized():
        w, r = dist.get_world_size(), dist.get_rank()
        world = dist.group.WORLD
        return ExpertParallelTopology(w, r, 1, w, 0, r, ep_group=None, edp_group=world, world_group=world)
    return ExpertParallelTopology(1, 0, 1, 1, 0, 0)


def _runs(segments: Sequence[Segment]) -> list[_Run]:
    """Merge consecutive segments of one param group (padding between them has zero gradient and
    stays zero under AdamW, so it can ride along) into as few update calls as possible."""
    runs: list[_Run] = []
    for s in segments:
        end = s.shard_start + s.length
        if runs and runs[-1].group == s.slot.entry.group:
            runs[-1].hi = end
        else:
            runs.append(_Run(s.slot.entry.group, s.shard_start, end))
    return runs


def _record_event(device: torch.device) -> Any:
    if device.type == "cpu":
        return None
    event = torch.Event(device=device)
    event.record()
    return event


_FUSED_DEVICES: set[str] | None = None


def _adamw(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    step: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
) -> None:
    """Decoupled-weight-decay Adam on lists of flat fp32 tensors; ``step`` is already incremented.

    Uses torch's fused kernel (one pass over memory) where the device has one, else the same math as
    ``torch.optim.AdamW(foreach=True)``."""
    global _FUSED_DEVICES
    if _FUSED_DEVICES is None:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        _FUSED_DEVICES = set(_get_fused_kernels_supported_devices())
    device = params[0].device
    if device.type in _FUSED_DEVICES and hasattr(torch, "_fused_adamw_"):
        torch._fused_adamw_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            [step] * len(params),
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
        )
        return
    n = float(step)
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    step_size = lr / (1 - beta1**n)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, (1 - beta2**n) ** 0.5)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -step_size)


def _sharded_tensor(
    buf: Tensor, shards: list[tuple[int, int, int]], entry: ParamEntry, opt: EPShardedAdamW
) -> Any:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    dev = buf.device
    metas = [ShardMetadata([off], [n], f"rank:{r}/{dev}") for r, off, n in shards]
    local = []
    segments = opt._local_segments(entry)
    for st, seg in segments:
        lo = st.shard_offset + seg.shard_start
        meta = next(
            m for (r, off, _), m in zip(shards, metas) if r == opt.topology.rank and off == seg.global_start
        )
        local.append(Shard(buf[lo : lo + seg.length], meta))
    if not segments:
        meta = next(m for (r, _, _), m in zip(shards, metas) if r == opt.topology.rank)
        local.append(Shard(buf[:0], meta))
    md = ShardedTensorMetadata(metas, torch.Size([entry.global_numel]), TensorProperties(dtype=buf.dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, md)
