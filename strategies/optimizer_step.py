"""The training step of `XPUMoEStrategy`, in one place: the optimizer it builds and one optimizer step.

Order of a step (plain, sharded and pipelined runs alike), all in `OptimizerStep.optimizer_step`:
the step's last forward and backward (Lightning's closure) -> reduce the gradients -> the global norm
and a non-finite flag in one all-reduce -> `on_before_optimizer_step` hooks (a callback may veto the
update) -> clip -> update -> zero. Nothing else in the strategy, the module or the callbacks replaces
an optimizer's or Lightning's methods: the optimizer is built by `build_optimizer`, which the module's
`configure_optimizers` calls, and Lightning's precision plugin is not asked to clip (its clipping sees
only this rank's tensors): the trainer's `gradient_clip_val` / `gradient_clip_algorithm` are applied
here, by the global norm, and a module's `configure_gradient_clipping` hook is not called.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from mula.host_sync import logging_step, to_host
from mula.layout.rules import check_zero_stage
from mula.training.lightning_compat import call_before_optimizer_step_hooks
from mula.training.muon import MulaMuon, is_muon_group
from mula.training.strategy_contract import ShardedOptimizer
from strategies.optim.grad_sync import GradientSynchronizer, grad_norm, scale_grads_
from strategies.optim.sharding_options import torch_dtype

if TYPE_CHECKING:
    from mula.layout.parallel_layout import ParallelLayout
    from strategies.topology import LayoutMesh


NON_FINITE = "a gradient is not finite"
NON_FINITE_SKIPS = "non-finite skips (logging steps)"  # the `to_host` reason of `_report_skips`


@dataclass(frozen=True)
class StepOptions:
    """The strategy's options that shape the optimizer and its gradient reduction."""

    shard_optimizer: bool  # an `EPShardedAdamW` (else a `torch.optim.AdamW`, gradients all-reduced)
    optimizer_options: dict[str, Any]  # `EPShardedAdamW`'s keyword options (parsed dtypes)
    bucket_size_mb: float  # gradient bucket size of the unsharded path
    overlap_grad_reduce: bool  # start bucket all-reduces from backward hooks (unsharded path)


class OptimizerStep:
    """The optimizer a strategy builds and its one training step (a member of XPUMoEStrategy).

    Inputs, stated at construction:
        options: a `StepOptions`.
        layout: a callable giving the strategy's `ParallelLayout` (final once the process group exists).
        topology: a callable giving the layout's `LayoutMesh` (None before `setup_environment`).
        module: a callable giving the LightningModule: its trainable parameters, its trainer (the
            hooks around the update, `gradient_clip_val` / `gradient_clip_algorithm`, the step number).
        optimizers: a callable giving the strategy's optimizers (Lightning sets them in
            `setup_optimizers`).

    It builds the optimizer (`build_optimizer`) and, after Lightning's `setup_optimizers`, the gradient
    synchroniser of the unsharded path (`setup`); holds gradient communication back on accumulation
    micro-batches (`block_backward_sync`, `last_backward_sync`); and runs one optimizer step in its
    fixed order (`optimizer_step`): closure -> reduce -> check -> hooks -> clip, update -> zero. Its
    state: `last_grad_norm`, `last_grads_finite` (device tensors), and whether the current step's update
    is skipped (`update_skipped`, a device flag: a non-finite gradient or a callback's veto).

    The non-finite skip is decided on the device where the optimizer can mask its update by a device
    flag (`masks_update_on_device`: `EPShardedAdamW` without offload, the default); the skips are
    counted there and reported on the next logging step. Other optimizers (`shard_optimizer=False`'s
    `torch.optim.AdamW`, Muon, an offloaded update) read the verdict on the host: one host sync per
    step (mula.host_sync).
    """

    def __init__(
        self,
        options: StepOptions,
        layout: Callable[[], ParallelLayout],
        topology: Callable[[], LayoutMesh | None],
        module: Callable[[], Any],
        optimizers: Callable[[], list[Any]],
    ) -> None:
        self.options = options
        self._layout = layout
        self._topology = topology
        self._module = module
        self._optimizers = optimizers
        self.grad_sync: GradientSynchronizer | None = None  # the unsharded path's (built in `setup`)
        self.last_grad_norm: Tensor | None = None  # the last step's global gradient norm (before clipping)
        self.last_grads_finite: Tensor | None = None  # 0-dim bool: every gradient of the last step finite
        self._skip_reason: str | None = None  # set while a step's update is vetoed
        self._skip_claimed = False
        # non-finite steps skipped on the device since the last report (a 0-dim float tensor)
        self._unreported_skips: Tensor | None = None
        # multi-token prediction across pipeline stages: the embedding's copies on the first and last
        # stage, summed after the reduction and counted once in the norm (set by the strategy's setup)
        self.embedding_copies: Any = None

    def build_optimizer(self, params: Any, **adamw_kwargs: Any) -> torch.optim.Optimizer:
        """The optimizer for the module's `configure_optimizers` (MulaLightningModule asks for it): with
        `shard_optimizer` an `EPShardedAdamW` over this rank's (already sliced and materialised)
        parameters, else a `torch.optim.AdamW`. `adamw_kwargs` are AdamW's (lr, betas, eps, weight_decay),
        plus Muon's (momentum, ns_steps, adjust_lr, ns_dtype) when param groups are marked as Muon's: then an
        `EPShardedMuon` (Newton-Schulz split by matrix), or without `shard_optimizer` a replicated
        `MulaMuon` (each rank updates the whole matrices it holds, an expert's on its EP rank)."""
        layout = self._layout()
        params = list(params)
        muon = any(isinstance(g, dict) and is_muon_group(g) for g in params)
        # (Muon's layout was checked in XPUMoEStrategy.setup, `check_optimizer`, before the model was split)
        if muon and not self.options.shard_optimizer:
            return MulaMuon(params, **adamw_kwargs)
        if not self.options.shard_optimizer:
            if layout.tp > 1:
                # DTensor and plain parameters side by side: torch's multi-tensor kernels take one kind
                adamw_kwargs = {**adamw_kwargs, "foreach": False}
            return torch.optim.AdamW(params, **adamw_kwargs)
        from strategies.optim.sharded_optimizer import EPShardedAdamW

        topology = self._topology()
        assert topology is not None
        options = dict(self.options.optimizer_options)
        check_zero_stage(layout.pp, options.get("zero_stage", 1))
        if options.get("overlap_param_gather"):
            options["module"] = self._module()  # waits for each bucket's gather in forward pre-hooks
        if muon:
            from strategies.optim.sharded_muon import EPShardedMuon

            return EPShardedMuon(params, self.trainable(), topology, **adamw_kwargs, **options)
        return EPShardedAdamW(params, self.trainable(), topology, **adamw_kwargs, **options)

    def setup(self) -> None:
        """After Lightning's `setup_optimizers`: check the module's optimizers and build the gradient
        synchroniser of the unsharded path."""
        if self.grad_sync is not None:
            self.grad_sync.remove_hooks()
            self.grad_sync = None
        if self.options.shard_optimizer:
            optimizers = self._optimizers()
            if len(optimizers) != 1 or not isinstance(_unwrapped(optimizers[0]), ShardedOptimizer):
                found = ", ".join(type(o).__name__ for o in optimizers) or "none"
                raise ValueError(
                    "shard_optimizer=True needs configure_optimizers to return one optimizer built with "
                    f"trainer.strategy.build_optimizer(...) (MulaLightningModule does), got {found}; "
                    "build it that way or use shard_optimizer=False."
                )
            return
        # (with pipeline stages the buckets launch in each stage's last backward: `last_backward_sync`)
        topology = self._topology()
        assert topology is not None
        self.grad_sync = GradientSynchronizer(
            self.trainable(), topology, self.options.bucket_size_mb, self.options.overlap_grad_reduce
        )

    def teardown(self) -> None:
        """Detach the gradient hooks and close the sharded optimizer (its host worker, if offloaded); tell
        the non-finite skips no logging step told yet."""
        if self._unreported_skips is not None:
            self._report_skips(self._module().trainer.global_step)
        if self.grad_sync is not None:
            self.grad_sync.remove_hooks()
        sharded = self.sharded_optimizer()
        if sharded is not None:
            sharded.close()

    # ----- the training step -----------------------------------------------------------------
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient-accumulation micro-batch: accumulate locally, communicate nothing."""
        sharded = self.sharded_optimizer()
        if self.grad_sync is not None:
            self.grad_sync.enabled = False
        try:
            if sharded is not None:
                with sharded.no_sync():
                    yield
            else:
                yield
        finally:
            if self.grad_sync is not None:
                self.grad_sync.enabled = True

    @contextmanager
    def last_backward_sync(self) -> Generator[None, None, None]:
        """Inside `block_backward_sync`: the backward run in this block is the step's last for the
        parameters it reaches (a pipeline stage's last micro-batch), so their buckets start reducing as
        they complete, as in the last backward of a step without stages, and an offloaded optimizer's
        host updates start with them (`strategies.optim.offload`)."""
        sharded = self.sharded_optimizer()
        if sharded is not None:
            before, sharded.reducer.sync = sharded.reducer.sync, True
        elif self.grad_sync is not None:
            before, self.grad_sync.enabled = self.grad_sync.enabled, True
        try:
            yield
        finally:
            if sharded is not None:
                sharded.reducer.sync = before
            elif self.grad_sync is not None:
                self.grad_sync.enabled = before

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any]) -> Any:
        """One optimizer step, the same for plain, sharded and pipelined runs, in this order:

        1. Lightning's closure: the step's last micro-batch's forward and backward (with pipeline
           stages the whole schedule ran in `training_step`; this runs the hooks around backward);
        2. reduce: finish the gradient reduction backward started (dense over the stage's ranks,
           experts over their EDP group; with MTP across stages, then the embedding's two copies summed);
        3. check: the global gradient norm and whether every gradient is finite, in one all-reduce,
           so every rank reaches the same verdict;
        4. `on_before_optimizer_step` hooks (callbacks, then the module): a callback may veto the
           update with `skip_optimizer_step` (AnomalyGuard does, with the same verdict on every rank);
        5. clip to the trainer's `gradient_clip_val` by that global norm, then update -- both skipped
           when the update was vetoed; a non-finite gradient makes the update a no-op on the device
           (`masks_update_on_device`, no host read; told on the next logging step), or with other
           optimizers skips both after a host read of the verdict;
        6. zero the gradients.
        """
        closure_loss = closure()
        norm, finite = self._reduce_and_check_gradients()
        self.last_grad_norm = norm
        self.last_grads_finite = finite
        self._skip_reason = None
        self._skip_claimed = False
        trainer = self._module().trainer
        on_device = masks_update_on_device(_unwrapped(optimizer))
        if not on_device and not bool(finite):  # the host reads the verdict: this optimizer cannot mask
            self._skip_reason = NON_FINITE
        call_before_optimizer_step_hooks(trainer, optimizer)
        if self._skip_reason is None:
            self._clip_gradients(optimizer, norm)
            if on_device:
                self._masked_update(optimizer, finite)
            else:
                optimizer.step()
        elif not self._skip_claimed:  # nobody reported it (no AnomalyGuard): say so once per skip
            rank_zero_warn(
                f"Skipping optimizer step {trainer.global_step + 1} on all ranks: {self._skip_reason}."
            )
        optimizer.zero_grad()
        self._skip_reason = None
        if logging_step(trainer.global_step + 1, trainer.log_every_n_steps):
            self._report_skips(trainer.global_step + 1)
        return closure_loss

    def _masked_update(self, optimizer: Any, finite: Tensor) -> None:
        """The update, a no-op on the device where a gradient is not finite (no host read); the skip
        is counted on the device for `_report_skips`."""
        found_inf = (~finite).float()  # as torch's fused optimizers take it from a GradScaler
        _unwrapped(optimizer).step(found_inf=found_inf)
        unreported = self._unreported_skips
        self._unreported_skips = found_inf if unreported is None else unreported + found_inf

    def _report_skips(self, step: int) -> None:
        """On a logging step: warn about the non-finite steps skipped on the device since the last
        report (one host read, on a step whose metrics are read on the host anyway)."""
        if self._unreported_skips is None:
            return
        skipped = int(to_host(self._unreported_skips, NON_FINITE_SKIPS))
        self._unreported_skips = None
        if skipped:
            rank_zero_warn(
                f"Skipping optimizer steps on all ranks: {NON_FINITE} in {skipped} of the steps up to step "
                f"{step} (decided on the device, reported on logging steps)."
            )

    @property
    def update_skipped(self) -> Tensor:
        """Whether this step's update is skipped (a non-finite gradient or a callback's veto): a 0-dim
        bool tensor on the device, read on the device (no host sync)."""
        finite = self.last_grads_finite
        assert finite is not None, "update_skipped is known from on_before_optimizer_step on"
        return torch.ones_like(finite) if self._skip_reason is not None else ~finite

    def skip_optimizer_step(self, reason: str) -> None:
        """Veto this step's update: the parameters and optimizer state stay as they are, the gradients
        are dropped. The caller reports the skip."""
        self._skip_reason = reason
        self._skip_claimed = True

    def _reduce_and_check_gradients(self) -> tuple[Tensor, Tensor]:
        sharded = self.sharded_optimizer()
        if sharded is not None:
            return sharded.grad_norm()
        topology = self._topology()
        assert self.grad_sync is not None and topology is not None
        self.grad_sync.finish()
        trainable = self.trainable()
        if self.embedding_copies is not None:  # strategies/pipeline/embedding.py
            self.embedding_copies.sum_grads()
            trainable = [(n, p) for n, p in trainable if self.embedding_copies.counted(p)]
        return grad_norm(trainable, topology)

    def _clip_gradients(self, optimizer: Any, norm: Tensor) -> None:
        """Clip as the trainer says (`gradient_clip_val`, `gradient_clip_algorithm`), by the global norm."""
        trainer = self._module().trainer
        clip_val = trainer.gradient_clip_val
        if not clip_val:
            return
        sharded = self.sharded_optimizer()
        if sharded is not None:
            sharded.clip_grad_norm_(float(clip_val), norm=norm)
        elif trainer.gradient_clip_algorithm == "value":  # element-wise: local, gradients are synchronised
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_value_(params, clip_val)
        else:
            scale_grads_(self.trainable(), float(clip_val), norm)

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        """The module's parameters that take gradients, by name."""
        return [(n, p) for n, p in self._module().named_parameters() if p.requires_grad]

    def sharded_optimizer(self) -> Any:
        """The sharded optimizer in use (`EPShardedAdamW`, unwrapped from Lightning's wrapper), else None."""
        optimizers = self._optimizers()
        if not self.options.shard_optimizer or not optimizers:
            return None
        opt = _unwrapped(optimizers[0])
        return opt if isinstance(opt, ShardedOptimizer) else None


def masks_update_on_device(optimizer: Any) -> bool:
    """Whether `optimizer` skips its update on a device flag without a host read (`step(found_inf=...)`):
    a sharded optimizer that says so (`EPShardedAdamW` without offload)."""
    return isinstance(optimizer, ShardedOptimizer) and optimizer.masks_update_on_device


def _unwrapped(optimizer: Any) -> Any:
    """The optimizer Lightning's `LightningOptimizer` wraps (or `optimizer` itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def parse_optimizer_options(options: dict[str, Any]) -> dict[str, Any]:
    """YAML gives dtypes as strings ("bfloat16", "bf16", "fp32"): turn them into torch dtypes."""
    out = dict(options)
    if isinstance(out.get("reduce_dtype"), str):
        out["reduce_dtype"] = torch_dtype(out["reduce_dtype"])
    return out
