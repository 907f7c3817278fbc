"""What the sharded optimizer reports: its bytes (state, padding, parameters, gradients, host memory
under offload) and the logger's metrics. A mixin of ``EPShardedAdamW``."""

from __future__ import annotations

from typing import Any

from mula.layout.flat_buffers import padding_bound


class ShardReporting:
    """Byte counts and ``metrics()`` of ``EPShardedAdamW`` (reads its buffers, reducer and options)."""

    master: Any
    tail_state: Any
    exp_avg: Any
    exp_avg_sq: Any
    buckets: Any
    reducer: Any
    options: Any
    shard_grad: Any
    _gather: Any
    _host: Any
    _p: Any

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: fp32 master weights + exp_avg + exp_avg_sq shards
        (on the host and, for offload's tail buckets, on the device)."""
        host = self.master.numel() + self.exp_avg.numel() + self.exp_avg_sq.numel()
        return 4 * (host + sum(t.numel() for t in self.tail_state))

    def device_state_bytes(self) -> int:
        """Bytes of optimizer state on the device: all of it, or with offload the tail buckets'."""
        if self._host is None:
            return self.state_bytes()
        return 4 * sum(t.numel() for t in self.tail_state)

    def owned_numel(self) -> int:
        """Parameter elements whose state this rank owns (padding excluded)."""
        return sum(
            s.length for b, st in zip(self.buckets, self.reducer.states) for s in b.segments(st.domain.rank)
        )

    def padding_bytes(self) -> int:
        """State bytes spent on alignment padding on this rank: ``state_bytes()`` less 12 per owned
        element of AdamW's buckets and 8 per owned element of Muon's (master + momentum)."""
        owned = sum(
            (8 if b.muon else 12) * s.length
            for b, st in zip(self.buckets, self.reducer.states)
            for s in b.segments(st.domain.rank)
        )
        return self.state_bytes() - owned

    def padding_bound_bytes(self) -> int:
        """The stated upper bound on ``padding_bytes()`` (``flat_buffers.padding_bound``) plus the
        rounding of this rank's exact share 12 * P / W."""
        return 12 * (padding_bound(self.buckets, self.options.align) + len(self.buckets))

    def param_bytes(self) -> int:
        """Bytes of the model parameters' flat buffers on this device (2 per element for bf16
        parameters, 4 for fp32; alignment padding included)."""
        return self._gather.param_bytes()

    def grad_buffer_bytes(self) -> int:
        """Bytes of persistent gradient buffers (full buckets for ZeRO-1, shards only for ZeRO-2)."""
        full = sum(
            st.grad_full.numel() * st.grad_full.element_size()
            for st in self.reducer.states
            if st.grad_full is not None and self.options.zero_stage == 1
        )
        return full + self.shard_grad.numel() * self.shard_grad.element_size()

    def host_bytes(self) -> int:
        """Host memory this optimizer holds (offload): the state, the saved slices speculation may
        restore, the gradient copy and the parameters' host send buffers; 0 without offload."""
        if self._host is None:
            return 0
        host_state = self.state_bytes() - self.device_state_bytes()
        return host_state + self._host.state_bytes() + self._gather.host_bytes()

    def metrics(self) -> dict[str, float]:
        """Values for the logger: optim/state_bytes, optim/padding_bytes, optim/param_bytes,
        optim/grad_buffer_bytes, optim/step_ms (host wall time of the last ``step()``),
        optim/grad_norm (last computed), mem/host_optimizer_bytes and mem/device_optimizer_bytes (where
        the state lives), and with offload optim/offload_rollbacks (steps whose speculative host update
        was undone) and optim/offload_speculated (bucket updates started during backward, over the run)."""
        out = {
            "mem/host_optimizer_bytes": float(self.host_bytes()),
            "mem/device_optimizer_bytes": float(self.device_state_bytes()),
            "optim/state_bytes": float(self.state_bytes()),
            "optim/param_bytes": float(self.param_bytes()),
            "optim/padding_bytes": float(self.padding_bytes()),
            "optim/grad_buffer_bytes": float(self.grad_buffer_bytes()),
            "optim/step_ms": self._p.last_step_ms,
        }
        if self._p.last_norm is not None:
            out["optim/grad_norm"] = float(self._p.last_norm)
        if self._host is not None:
            out["optim/offload_rollbacks"] = float(self._host.rollbacks)
            out["optim/offload_speculated"] = float(self._host.speculated)
        return out
