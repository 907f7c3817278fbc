"""What Mula's LightningModule, data module, downstream evaluation and callbacks may ask of the strategy,
and of the optimizer it builds.

`MulaStrategy` names each capability once, with its type and meaning; `strategies.XPUMoEStrategy`
provides all of them (tests/test_strategy_contract.py). A caller asks `mula_strategy(trainer.strategy)`:
the strategy when it provides the whole contract, None for Lightning's own strategies (single device,
DDP, FSDP, ...), where the caller does what it always did under them (`torch.optim.AdamW`, the trainer's
ranks as data-parallel ranks, no asynchronous save, ...). No caller looks a capability up by name.

The optimizers: `OptimizerBytes` is an optimizer that counts what it holds on this rank (`MulaMuon`, and
the sharded optimizers), which the memory metrics, `mula bench` and `mula plan --dry_run` report;
`ShardedOptimizer` is the one `build_optimizer` returns with `shard_optimizer: true` (`EPShardedAdamW`,
`EPShardedMuon`), which reduces the gradients itself and saves its state sharded. A caller asks
`isinstance(optimizer, ShardedOptimizer)`; a plain torch optimizer is neither.

Torch-free: the types below are for readers and type checkers only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# typing_extensions' Protocol checks `isinstance` as Python 3.12 does, reading members without running
# them: asking whether a strategy provides the contract evaluates none of its properties
from typing_extensions import Protocol, runtime_checkable

if TYPE_CHECKING:
    from concurrent.futures import Future
    from contextlib import AbstractContextManager

    from torch import Tensor
    from torch.optim import Optimizer

    from mula.downstream.lm import SpreadModel
    from mula.layout.parallel_layout import ParallelLayout


@runtime_checkable
class MulaStrategy(Protocol):
    """A Lightning strategy that owns Mula's training step and parallel layout (XPUMoEStrategy)."""

    # ----- the optimizer step (MulaLightningModule, AnomalyGuard) -----------------------------------
    def build_optimizer(self, params: Any, **adamw_kwargs: Any) -> Optimizer:
        """The optimizer of `configure_optimizers` over `params` (parameter groups), with AdamW's arguments."""
        ...

    @property
    def zeroes_grads_after_step(self) -> bool:
        """Whether the strategy zeroes the gradients at the end of its step (the module then does not zero them)."""
        ...

    @property
    def keeps_fp32_master_weights(self) -> bool:
        """Whether half-precision weights (`precision: bf16-true`) get fp32 master weights in the optimizer."""
        ...

    @property
    def offloads_optimizer(self) -> bool:
        """Whether the optimizer keeps its state in host memory and updates there (`optimizer_options.offload`)."""
        ...

    @property
    def last_grads_finite(self) -> Tensor | None:
        """Whether every gradient of the step being run is finite, on all ranks (set before `on_before_optimizer_step`):
        a 0-dim bool tensor on the device, so that deciding on it needs no host sync."""
        ...

    def skip_optimizer_step(self, reason: str) -> None:
        """Veto the update of the step being run (from `on_before_optimizer_step`, on every rank alike)."""
        ...

    @property
    def update_skipped(self) -> Tensor:
        """Whether the update of the step being run is skipped (a non-finite gradient or a veto): a 0-dim bool
        tensor on the device (state the step updates outside the optimizer is masked by it, no host sync)."""
        ...

    # ----- data (MulaDataModule, Throughput, DownstreamEval) ----------------------------------------
    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the ranks that read different data."""
        ...

    @property
    def data_parallel_size(self) -> int:
        """How many ranks read different data (W / (P x T x C)): the global batch is split over them."""
        ...

    @property
    def consumes_whole_step(self) -> bool:
        """Whether a step's data comes as one batch, the rank's whole share (pipeline stages split it)."""
        ...

    # ----- layout and evaluation (mula.downstream.trainer_eval) ----------------------------------------
    @property
    def tensor_parallel_size(self) -> int:
        """Ranks splitting each layer's tensors (T); under sequence parallelism a sequence is split over them."""
        ...

    def parallel_layout(self, world_size: int, config: Any = None) -> ParallelLayout:
        """The strategy's layout over `world_size` ranks, validated against a model config (ValueError)."""
        ...

    def spread_forward(self) -> SpreadModel:
        """The model's forward across the layout's ranks, for downstream evaluation."""
        ...

    # ----- checkpoints (FaultTolerantCheckpoint) --------------------------------------------------------
    def save_checkpoint_async(self, checkpoint: dict[str, Any], filepath: Any, group: Any) -> Future:
        """`save_checkpoint` staged to host memory (collective); the future completes when this rank's files are written."""
        ...


def mula_strategy(strategy: object) -> MulaStrategy | None:
    """`strategy` when it provides the whole `MulaStrategy` contract, else None (Lightning's own
    strategies, or no strategy): the caller's plain-Lightning behaviour then applies."""
    return strategy if isinstance(strategy, MulaStrategy) else None


@runtime_checkable
class OptimizerBytes(Protocol):
    """An optimizer that counts the bytes it holds on this rank (`MulaMuon`, `EPShardedAdamW`)."""

    def param_bytes(self) -> int:
        """Bytes of the parameters it updates, this rank's part of each."""
        ...

    def grad_buffer_bytes(self) -> int:
        """Bytes of the gradients a step reads (the sharded optimizer's buckets; else one per parameter)."""
        ...

    def state_bytes(self) -> int:
        """Bytes of its per-element state (master weights, moments, momentum; not step counters)."""
        ...


@runtime_checkable
class ShardedOptimizer(OptimizerBytes, Protocol):
    """The optimizer `MulaStrategy.build_optimizer` builds with `shard_optimizer: true`: gradients reduced
    into its own buckets, its state sharded over the ranks (`EPShardedAdamW`, `EPShardedMuon`)."""

    def reduce_gradients(self) -> None:
        """Finish reducing this step's gradients into this rank's shards (launched from backward hooks)."""
        ...

    @property
    def masks_update_on_device(self) -> bool:
        """Whether `step(found_inf=...)` skips the update on a device flag (non-zero: skip), with no host read."""
        ...

    def no_sync(self) -> AbstractContextManager[None]:
        """Gradient-accumulation micro-batches: accumulate locally, reduce nothing."""
        ...

    def grad_norm(self, norm_type: float = 2.0) -> tuple[Tensor, Tensor]:
        """(global gradient norm, whether every gradient is finite: a 0-dim bool tensor), the same on every rank."""
        ...

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, norm: Tensor | None = None) -> Tensor:
        """Scale the gradient shards to `max_norm` by the global norm (`norm`: already computed)."""
        ...

    def device_state_bytes(self) -> int:
        """Bytes of `state_bytes()` on the device: all of it, or with offload the part kept there."""
        ...

    def host_bytes(self) -> int:
        """Host memory it holds for offload (state, saved slices, gradient and parameter copies); else 0."""
        ...

    def sharded_state_dict(self) -> dict[str, Any]:
        """Its state for a sharded checkpoint (DTensors over the layout), loadable at another layout."""
        ...

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what `sharded_state_dict` saved, at this layout."""
        ...

    def metrics(self) -> dict[str, float]:
        """Its `optim/...` metrics (state bytes, padding, host bytes, ...)."""
        ...

    def close(self) -> None:
        """Land the parameter gathers in flight, remove its hooks, stop an offloaded update's host worker."""
        ...
