"""EP-aware sharded AdamW: fp32 master weights and Adam moments split exactly once across all ranks.

Layout (W ranks, expert-parallel size E, EDP = W / E; see strategies/topology.py):

* dense parameters are replicated on all W ranks, so their gradients are reduce-scattered over the
  world and each rank keeps 1/W of their optimizer state;
* expert parameters (names containing ".experts.") differ between EP ranks and are replicated only
  across the EDP group, so their gradients are reduce-scattered over EDP and each rank keeps 1/EDP of
  its P_expert/E local expert elements, i.e. P_expert/W.

Under tensor parallelism (T > 1, docs/tensor-parallel.md) "all W ranks" is the data-parallel world
of one TP index (W / T ranks, ``topology.group("replica")``): the buffers hold each rank's *local* TP shard
(a DTensor parameter's local tensor), so every TP index shards its own part of the model, and the
global norm sums TP-split elements over the TP group (replicated ones, e.g. norm weights, once).

Each rank therefore holds 12 * (P_dense + P_expert) / W bytes (fp32 master + exp_avg + exp_avg_sq)
plus a few alignment-padding elements per bucket (see ``flat_buffers.padding_bound``). An EP-unaware
optimizer (everything sharded over EDP, the comparison in benchmarks/optimizer.py) holds
12 * (P_dense / EDP + P_expert / W).

Per step (the order the strategy follows, see ``EPShardedAdamW``):

1. backward (``strategies.optim.grad_reduce``): post-accumulate-grad hooks move each gradient into its
   bucket's flat buffer, scaled by 1/W (dense gradients are the rank's own; expert gradients arrive
   from the all-to-all backward already summed over the EP group, so their sum over EDP covers every
   rank once), and launch an async reduce-scatter as soon as a bucket is complete — in bucket order, so every rank issues the
   same collectives in the same order;
2. ``reduce_gradients()``: launch what is left, wait, the rank now has its averaged gradient shard;
3. ``grad_norm()``: one all-reduce of the local sum of squares (every element is owned by exactly
   one rank, so it is counted once) and of a non-finite count gives the global norm and whether
   every gradient is finite; ``clip_grad_norm_(max_norm, norm=...)`` scales the shard by it;
4. ``step()``: AdamW on the local shard bucket by bucket (lr, betas, eps, weight decay read from
   ``param_groups`` every step, so Lightning LR schedulers work), each bucket's all-gather of the
   updated parameters (in the model's dtype, fp32 or bf16) launched as soon as it is updated so it
   overlaps the update of the next bucket — and optionally the next forward.

Mixed precision (``trainer.precision: bf16-true``): the model parameters and their gradients are
bf16 on the device (2 bytes per element each, or only the shards and in-flight buckets for
gradients under ZeRO-2), the master weights and moments fp32 and only in this rank's shard (12 bytes
per owned element); the master shard is built from the parameters as they are when the optimizer is
constructed, updated in fp32, and cast to bf16 for the all-gather. ``reduce_dtype`` (fp32 by default)
decides whether bf16 gradients are accumulated and reduce-scattered in fp32 or in bf16.

Offload (``offload=True``): the master weights and moments live in host memory and each bucket's host
update starts during backward, validated after the global norm (``strategies.optim.offload``,
docs/offload.md); ``offload_tail_buckets`` keeps the last buckets' state on the device.

Options: ``strategies.optim.sharding_options``; the update arithmetic: ``strategies.optim.adamw``; the norm
and clipping: ``strategies.optim.clipping``; byte counts and metrics: ``strategies.optim.reporting``;
checkpoints: ``strategies.optim.state``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mula.layout.flat_buffers import ParamEntry, Segment
from mula.training.muon import is_muon_group
from strategies.optim import state as optim_state
from strategies.optim.adamw import shard_runs, update_runs
from strategies.optim.clipping import ShardClipping
from strategies.optim.grad_reduce import GradReducer, is_tp_split, local_tensor, param_entry
from strategies.optim.offload import HostUpdate, host_memory, pinned
from strategies.optim.param_gather import ParamGather
from strategies.optim.reporting import ShardReporting
from strategies.optim.sharding_options import ShardingOptions, torch_dtype
from strategies.topology import LayoutMesh, build_topology

__all__ = ["EPShardedAdamW", "ShardingOptions"]

_KINDS = ("master", "exp_avg", "exp_avg_sq")


@dataclass
class _Progress:
    """The optimizer's mutable scalar state (see the note in ``EPShardedAdamW.__init__``)."""

    steps_done: int = 0  # optimizer steps taken (drives clip_after_step)
    clipped: bool = False  # clip_grad_norm_ already ran for the coming step
    last_norm: Tensor | None = None
    last_step_ms: float = 0.0


class EPShardedAdamW(ShardClipping, ShardReporting, torch.optim.Optimizer):
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
        topology: LayoutMesh | None = None,
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
            first = len(entries)
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(
                        "Every optimizer parameter needs a name: pass named_params covering all groups."
                    )
                if not p.requires_grad:
                    raise ValueError(
                        f"Parameter {names[id(p)]} does not require grad; leave it out of the optimizer."
                    )
                matrix = self._matrix_shape(group, len(entries) - first)
                entries.append(param_entry(len(self._params), names[id(p)], p, gi, self.topology, matrix))
                self._params.append(p)
        if not self._params:
            raise ValueError("EPShardedAdamW got no parameters.")
        devices = {p.device for p in self._params}
        # meta parameters only in a dry run (`mula plan --dry_run`): shapes without storage, fake collectives
        if len(devices) != 1 or (next(iter(devices)).type == "meta" and not _fake_backend()):
            raise ValueError(
                f"All parameters must be materialised on one device, found {sorted(map(str, devices))}."
            )
        self.device = next(iter(devices))
        self.state_device = host_memory(self.device) if self.options.offload else self.device
        opt = self.options
        self.reducer = GradReducer(
            self._params,
            entries,
            self.topology,
            sharded=True,
            bucket_numel=opt.bucket_numel,
            align=opt.align,
            zero_stage=opt.zero_stage,
            overlap=opt.overlap_grad_reduce,
            reduce_dtype=torch_dtype(opt.reduce_dtype),
            ep_aware=opt.ep_aware,
            collectives=opt.collectives,
            device=self.device,
        )
        self.buckets = self.reducer.buckets
        self.entries = entries
        self._names = {id(p): e.name for e, p in zip(entries, self._params)}
        # where this rank's shard holds elements of TP-split parameters (the norm sums them over TP)
        self._tp_split_ranges = [
            (off + seg.shard_start, off + seg.shard_start + seg.length)
            for e, p in zip(entries, self._params)
            if is_tp_split(p)
            for off, seg in self.local_segments(e)
        ]
        self.step_count = torch.zeros((), dtype=torch.float32, device=self.state_device)
        self._allocate()
        # Mutable scalars live in one shared object: Lightning's LightningOptimizer runs our methods
        # with itself as ``self`` and forwards only *reads* to us, so attribute writes would split.
        self._p = _Progress()
        self._hooks: list[Any] = []
        if self.options.overlap_param_gather:
            if module is None:
                raise ValueError(
                    "overlap_param_gather=True needs module= (the module the parameter names refer to)."
                )
            self._hooks.extend(self._gather.forward_waits(module))
        self._gather_params()  # replicas become bit-identical to the master shards

    # ----------------------------------------------------------------------------------------
    # construction

    @classmethod
    def from_adamw(
        cls,
        adamw: torch.optim.Optimizer,
        named_params: Iterable[tuple[str, Tensor]],
        topology: LayoutMesh | None,
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

    def _matrix_shape(self, group: dict[str, Any], position: int) -> tuple[int, int] | None:
        """(rows, cols) of the Muon matrices of the `position`-th parameter of param `group`, None when
        AdamW trains it: here always (``EPShardedMuon`` trains the groups marked as Muon's)."""
        if is_muon_group(group):
            raise ValueError(
                "EPShardedAdamW got a Muon param group; build an EPShardedMuon for model.optimizer=muon."
            )
        return None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the flat layout is fixed once built."""
        if not self._initialising:
            raise ValueError("EPShardedAdamW cannot add param groups after construction; build a new one.")
        super().add_param_group(param_group)

    def _allocate(self) -> None:
        """Flat buffers: the parameters become views of per-bucket buffers (``ParamGather``); per rank
        one flat fp32 master/exp_avg/exp_avg_sq shard (gradient buffers belong to the reducer)."""
        opt = self.options
        pin = opt.offload and pinned(self.device)
        states = self.reducer.states
        n = len(self.buckets)
        # offload: the last `offload_tail_buckets` buckets (the last reductions of backward, nothing
        # left to overlap their host update with) keep their state on the device; a suffix of the shard
        tail = min(opt.offload_tail_buckets, n) if opt.offload else 0
        self.tail_buckets = set(range(n - tail, n))
        numel = self.reducer.shard_grad.numel()
        self.tail_start = states[n - tail].shard_offset if tail else numel
        self._gather = ParamGather(
            self._params,
            self.buckets,
            states,
            offload=[opt.offload and i not in self.tail_buckets for i in range(n)],
            device=self.device,
        )
        self._runs = [shard_runs(b.segments(st.domain.rank)) for b, st in zip(self.buckets, states)]
        zeros = {"dtype": torch.float32, "device": self.state_device}
        self.master = torch.zeros(self.tail_start, **zeros)
        self.exp_avg = torch.zeros(self.tail_start, **zeros)
        self.exp_avg_sq = torch.zeros(self._second_moment_numel(), **zeros)
        on_device = {"dtype": torch.float32, "device": self.device}
        self.tail_state = tuple(torch.zeros(numel - self.tail_start, **on_device) for _ in range(3))
        self.shard_grad = self.reducer.shard_grad
        self.host_grad = (
            torch.zeros(
                self.tail_start, dtype=torch_dtype(opt.reduce_dtype), device=self.state_device, pin_memory=pin
            )
            if opt.offload
            else None
        )
        for b, st in zip(self.buckets, states):
            for seg in b.segments(st.domain.rank):
                p = self._params[seg.slot.entry.index]
                buf, lo = self.state_buffer("master", st.shard_offset)
                lo += seg.shard_start
                src = local_tensor(p.detach()).reshape(-1)[seg.param_start : seg.param_start + seg.length]
                buf[lo : lo + seg.length].copy_(src)
        self._host: HostUpdate | None = None
        if opt.offload:
            self._host = HostUpdate(
                self.reducer,
                [i for i in range(n) if i not in self.tail_buckets],
                (self.master, self.exp_avg, self.exp_avg_sq),
                self.host_grad,
                self.step_count,
                self.param_groups,
                self._update_bucket,
                speculate=opt.offload_speculation,
            )

    def _second_moment_numel(self) -> int:
        """Elements of ``exp_avg_sq`` (beyond offload's tail): the whole shard, every bucket is AdamW's."""
        return self.tail_start

    def state_kinds(self, entry: ParamEntry) -> tuple[str, ...]:
        """The state ``entry``'s parameter keeps (what checkpoints save for it)."""
        return _KINDS

    def state_buffer(self, kind: str, offset: int) -> tuple[Tensor, int]:
        """(flat tensor, offset in it) holding ``kind`` ("master", "exp_avg", "exp_avg_sq") at offset
        ``offset`` of this rank's shard: the host buffers, or the device ones of the tail buckets."""
        if offset >= self.tail_start and self.tail_state[0].numel():
            return self.tail_state[_KINDS.index(kind)], offset - self.tail_start
        return getattr(self, kind), offset

    def bucket_state(self, index: int) -> tuple[Tensor, Tensor, Tensor]:
        """Bucket ``index``'s shard of (master, exp_avg, exp_avg_sq), wherever it lives."""
        lo, hi = self._shard_range(index)
        out = []
        for kind in _KINDS:
            buf, at = self.state_buffer(kind, lo)
            out.append(buf[at : at + hi - lo])
        return out[0], out[1], out[2]

    # ----------------------------------------------------------------------------------------
    # gradients

    def reduce_gradients(self) -> None:
        """Finish this round's gradient reduction: launch every bucket not yet launched (in order, on
        every rank), wait, and leave the averaged gradient shard in ``shard_grad``. Idempotent.

        Every rank must have produced gradients since the last reduction (true for any loss of the
        model); a rank with none would skip the collectives the others launch."""
        self.reducer.reduce()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient-accumulation micro-batch: ZeRO-1 only accumulates (no communication); ZeRO-2
        reduce-scatters as usual and folds the result into the shards on exit."""
        prev, self.reducer.sync = self.reducer.sync, False
        try:
            yield
        finally:
            self.reducer.sync = prev
            if self.options.zero_stage == 2:
                self.reduce_gradients()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear accumulated gradients (flat buffers are zeroed, never freed, whatever set_to_none)."""
        if self._host is not None:  # a skipped step: undo what was speculated
            self._host.discard()
        self.reducer.zero_grad()
        self._p.clipped = False

    # ----------------------------------------------------------------------------------------
    # update

    @property
    def masks_update_on_device(self) -> bool:
        """Whether ``step(found_inf=...)`` skips on the device, without a host read: yes for AdamW's
        buckets updated on the device; not with ``offload`` (the host validates its speculation) nor
        with Muon's buckets (their exchange and Newton-Schulz take no mask)."""
        return self._host is None and not any(b.muon for b in self.buckets)

    @torch.no_grad()
    def step(self, closure=None, found_inf: Tensor | None = None):  # type: ignore[override]
        """Run ``closure`` (forward + backward) if given, then reduce, clip (``max_grad_norm``), update
        the local shard with AdamW and all-gather the new parameters. Returns the closure's loss.

        ``found_inf`` (a 0-dim float tensor on the device, as torch's fused optimizers take from a
        GradScaler): where it is non-zero the step changes nothing -- neither the shard, the moments
        nor the step count -- decided on the device (the strategy's non-finite skip, no host read).
        Requires ``masks_update_on_device``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t0 = time.perf_counter()
        self.reduce_gradients()
        if self.options.max_grad_norm is not None and not self._p.clipped:
            self.clip_grad_norm_(self.options.max_grad_norm)
        if found_inf is None:
            self.step_count.add_(1)
        else:
            if not self.masks_update_on_device:
                raise ValueError(
                    "step(found_inf=...) needs masks_update_on_device: this optimizer offloads its update "
                    "or holds Muon buckets; read the verdict on the host and skip step() instead."
                )
            self.step_count.add_(1 - found_inf.to(self.step_count.dtype))
        if self._host is not None:  # validate the speculative host updates, run the rest
            self._host.finish()
        step = self.step_count.to(self.device)  # (the device buckets' step count)
        self._update_and_gather(step, found_inf)
        if not self.options.overlap_param_gather:
            self.wait_for_params()
        self._p.steps_done += 1
        self._p.clipped = False
        self._p.last_step_ms = (time.perf_counter() - t0) * 1e3
        return loss

    def _update_and_gather(self, step: Tensor, found_inf: Tensor | None = None) -> None:
        """Update every bucket's shard (the device ones; offload's host updates are done) and launch
        each bucket's parameter all-gather as soon as it is updated."""
        for i in range(len(self.buckets)):
            if self._host is None or i in self.tail_buckets:
                self._update_bucket(i, self.shard_grad, step, found_inf)
            self._gather.launch(i, self.bucket_state(i)[0])

    def _shard_range(self, index: int) -> tuple[int, int]:
        lo = self.reducer.states[index].shard_offset
        return lo, lo + self.buckets[index].shard_numel

    def _update_bucket(
        self, index: int, grads: Tensor, step: Tensor, found_inf: Tensor | None = None
    ) -> None:
        """AdamW on bucket ``index``'s shard with ``grads`` (device shard or its host copy) at ``step``
        (none where ``found_inf`` is non-zero)."""
        lo, hi = self._shard_range(index)
        update_runs(
            self._runs[index], self.bucket_state(index), grads[lo:hi], step, self.param_groups, found_inf
        )

    def wait_for_params(self) -> None:
        """Block until every all-gather launched by ``step()`` has landed in the model parameters
        (needed before reading parameters outside a forward when ``overlap_param_gather`` is on)."""
        self._gather.wait_all()

    def _gather_params(self) -> None:
        for i in range(len(self.buckets)):
            self._gather.launch(i, self.bucket_state(i)[0])
        self.wait_for_params()

    # ----------------------------------------------------------------------------------------
    # checkpoints

    def sharded_state_dict(self) -> dict[str, Any]:
        """State for ``torch.distributed.checkpoint`` (``strategies.optim.state``): per parameter
        (global name) master/exp_avg/exp_avg_sq over the flattened *global* parameter, the step count
        and the param groups. Local shards are views of the live buffers, so ``dcp.load`` into this
        dict loads in place; then call ``load_sharded_state_dict``."""
        return optim_state.sharded_state_dict(self)

    state_dict = sharded_state_dict  # Lightning's default optimizer_state() gets the sharded form

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``sharded_state_dict()`` produced (after ``dcp.load`` filled it), possibly saved at
        another (W, E) layout, then refresh the model parameters from the loaded master weights."""
        optim_state.load_sharded_state_dict(self, state_dict)
        self._p.steps_done = int(self.step_count.item())
        self._gather_params()

    load_state_dict = load_sharded_state_dict

    def name_of(self, p: Tensor) -> str:
        """The name ``p`` was given in ``named_params``."""
        return self._names[id(p)]

    def param_of(self, entry: ParamEntry) -> Tensor:
        """The parameter ``entry`` describes (a DTensor under tensor parallelism)."""
        return self._params[entry.index]

    def local_segments(self, entry: ParamEntry) -> list[tuple[int, Segment]]:
        """(shard offset of its bucket, segment) of every piece of ``entry`` this rank owns."""
        slot = self.reducer.slots[entry.index]
        red = self.reducer.states[slot.bucket]
        return [
            (red.shard_offset, s)
            for s in self.buckets[slot.bucket].segments(red.domain.rank)
            if s.slot.entry.index == entry.index
        ]

    def close(self) -> None:
        """Land the parameter all-gathers still in flight (with `overlap_param_gather` the last step's
        only land in the next forward, which never comes after training), then remove the backward and
        forward hooks this optimizer registered."""
        self.wait_for_params()
        self.reducer.remove_hooks()
        if self._host is not None:
            self._host.close()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


# --------------------------------------------------------------------------------------------
# helpers


def _fake_backend() -> bool:
    """True under torch's fake process group (a dry run: collectives return at once, sending nothing)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "fake"


def _default_topology() -> LayoutMesh:
    """Every rank of the process group is a data-parallel rank (E = P = 1), or one process."""
    return build_topology(1)
