"""The sharded optimizer's model parameters: views of flat per-bucket buffers, refilled by all-gather.

Each bucket's full parameter buffer (in the model's dtype) is the concatenation of the domain ranks'
shards, so after the update every rank sends its fp32 master shard (cast to the model dtype) and
receives the others' -- one all-gather per bucket, or one broadcast per shard rooted at its owner
when the domain uses rooted collectives (gloo on CPU). A tensor-parallel (DTensor) parameter's local
shard is what lives in the buffer: the all-gather runs over its data-parallel group only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from mula.layout.flat_buffers import Bucket
from mula.torch_compat import all_gather_single as _all_gather
from mula.torch_compat import dtensor_local_tensor
from strategies.optim.grad_reduce import Domain, ReduceState, local_tensor
from strategies.optim.offload import host_memory, pinned


def gather_shards(full: Tensor, shard: Tensor, dom: Domain, *, non_blocking: bool = False) -> list[Any]:
    """Start filling ``full`` (a bucket's flat buffer) with every rank of ``dom``'s ``shard`` in rank
    order; returns the work handles. An all-gather, or, in a rooted domain (and with one rank), this
    rank's shard copied in place (``non_blocking``: from pinned host memory) and one broadcast per
    shard from its owner."""
    n, r = dom.size, dom.rank
    if dom.rooted or n == 1:
        chunks = full.chunk(n)
        chunks[r].copy_(shard, non_blocking=non_blocking)
        return [
            dist.broadcast(chunks[i], src=dom.global_ranks[i], group=dom.group, async_op=True)
            for i in range(n)
            if n > 1
        ]
    return [_all_gather(full, shard, group=dom.group, async_op=True)]


def _repoint(p: Tensor, view: Tensor) -> None:
    """Make parameter ``p`` (its local shard, for a DTensor) a view of ``view``. A DTensor's ``.data``
    and ``to_local()`` do not reach the tensor it wraps, so that tensor (``dtensor_local_tensor``) is re-pointed."""
    if isinstance(p, DTensor):
        dtensor_local_tensor(p).data = view
    else:
        p.data = view


class ParamGather:
    """Re-points ``params`` into flat per-bucket buffers and refreshes them from the owners' shards.

    Args:
        params: the parameters, ``params[e.index]`` for every entry of the buckets.
        buckets, states: the reducer's buckets and their per-bucket states (domain, shard offset).
        offload: per bucket (or one for all), whether its master shard lives in host memory (cast
            there, then one transfer).
        device: where the parameters live.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        buckets: Sequence[Bucket],
        states: Sequence[ReduceState],
        *,
        offload: bool | Sequence[bool],
        device: torch.device,
    ) -> None:
        self.buckets = list(buckets)
        self.offload = [offload] * len(self.buckets) if isinstance(offload, bool) else list(offload)
        self._domains = [st.domain for st in states]
        pin, host_device = pinned(device), host_memory(device)
        self.full: list[Tensor] = []  # the model parameters are views into these
        self._send: list[Tensor | None] = []  # all-gather input when it cannot be the master shard
        self._host_send: list[Tensor | None] = []  # offload: cast of the master shard in host memory
        self._work: list[list[Any]] = [[] for _ in self.buckets]
        for b, dom, off in zip(self.buckets, self._domains, self.offload):
            dtype = params[b.slots[0].entry.index].dtype
            full = torch.zeros(b.numel, dtype=dtype, device=device)
            for slot in b.slots:
                p = params[slot.entry.index]
                local = local_tensor(p.detach())  # a tensor-parallel parameter's own shard
                view = full[slot.start : slot.start + slot.entry.numel].view(local.shape)
                view.copy_(local)
                _repoint(p, view)
            self.full.append(full)
            native = not dom.rooted and dom.size > 1
            needs_send = native and (dtype != torch.float32 or off)
            self._send.append(torch.empty(b.shard_numel, dtype=dtype, device=device) if needs_send else None)
            host = (
                torch.empty(b.shard_numel, dtype=dtype, device=host_device, pin_memory=pin) if off else None
            )
            self._host_send.append(host)

    def param_bytes(self) -> int:
        """Bytes of the flat parameter buffers (the model parameters are views into them)."""
        return sum(f.numel() * f.element_size() for f in self.full)

    def host_bytes(self) -> int:
        """Bytes of the host send buffers (offload: the master shards cast to the model dtype)."""
        return sum(h.numel() * h.element_size() for h in self._host_send if h is not None)

    def launch(self, index: int, shard: Tensor) -> None:
        """Start filling bucket ``index`` from every rank's ``shard`` (this rank's fp32 master shard)."""
        src, off = shard, self.offload[index]
        if off:
            src = self._host_send[index].copy_(shard)  # cast on the host, then one transfer
        send = self._send[index]  # (only for a native all-gather)
        if send is not None:
            src = send.copy_(src, non_blocking=off)
        self._work[index] = gather_shards(self.full[index], src, self._domains[index], non_blocking=off)

    def wait(self, index: int) -> None:
        """Block until bucket ``index``'s parameters have landed."""
        for handle in self._work[index]:
            handle.wait()
        self._work[index] = []

    def wait_all(self) -> None:
        """Block until every launched bucket has landed."""
        for i in range(len(self.buckets)):
            self.wait(i)

    def forward_waits(self, module: torch.nn.Module) -> list[Any]:
        """Forward pre-hooks on the submodules of ``module`` owning parameters, each waiting for its
        buckets, so the all-gathers overlap the forward; returns their handles."""
        owners: dict[str, set[int]] = {}
        for b in self.buckets:
            for s in b.slots:
                owners.setdefault(s.entry.name.rpartition(".")[0], set()).add(b.index)
        hooks = []
        for owner, bucket_ids in owners.items():
            try:
                sub = module.get_submodule(owner)
            except AttributeError as err:
                raise ValueError(
                    f"Parameter owner {owner!r} is not a submodule of the given module."
                ) from err

            ids = sorted(bucket_ids)

            def wait(_mod, _args, ids=ids) -> None:
                for i in ids:
                    self.wait(i)

            hooks.append(sub.register_forward_pre_hook(wait))
        return hooks
