"""The training step of `XPUMoEStrategy`, in one place: the optimizer it builds and one optimizer step.

Order of a step (plain, sharded and pipelined runs alike), all in `OptimizerSteps.optimizer_step`:
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
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from mula.layout.rules import check_zero_stage
from mula.training.lightning_compat import call_before_optimizer_step_hooks
from strategies.optim.grad_sync import GradientSynchronizer, grad_norm, scale_grads_
from strategies.optim.sharding_options import torch_dtype


class OptimizerSteps:
    """Optimizer construction and the optimizer step of an EP-aware strategy (a mixin of XPUMoEStrategy).

    Expects the host strategy to set `topology`, `shard_optimizer`, `optimizer_options`,
    `layout` (its `ParallelLayout`), `bucket_size_mb`, `overlap_grad_reduce`, `_pipeline`
    and `_grad_sync`, and Lightning's `lightning_module` and `optimizers`.
    """

    last_grad_norm: Tensor | None = None  # the last step's global gradient norm (before clipping)
    last_grads_finite: bool = True  # whether every gradient of the last step was finite
    _skip_reason: str | None = None  # set while a step's update is vetoed
    _skip_claimed = False

    def build_optimizer(self, params: Any, **adamw_kwargs: Any) -> torch.optim.Optimizer:
        """The optimizer for the module's `configure_optimizers` (MulaLightningModule asks for it): with
        `shard_optimizer` an `EPShardedAdamW` over this rank's (already sliced and materialised)
        parameters, else a `torch.optim.AdamW`. `adamw_kwargs` are AdamW's (lr, betas, eps, weight_decay)."""
        if not self.shard_optimizer:
            if self.layout.tp > 1:
                # DTensor and plain parameters side by side: torch's multi-tensor kernels take one kind
                adamw_kwargs = {**adamw_kwargs, "foreach": False}
            return torch.optim.AdamW(params, **adamw_kwargs)
        from strategies.optim.sharded_optimizer import EPShardedAdamW

        assert self.topology is not None
        options = dict(self.optimizer_options)
        check_zero_stage(self.layout.pp, options.get("zero_stage", 1))
        if options.get("overlap_param_gather"):
            options["module"] = self.lightning_module  # waits for each bucket's gather in forward pre-hooks
        return EPShardedAdamW(params, self._trainable(), self.topology, **adamw_kwargs, **options)

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        """The module's optimizers (built through `build_optimizer`), and the gradient synchroniser of
        the unsharded path."""
        super().setup_optimizers(trainer)
        if self._grad_sync is not None:
            self._grad_sync.remove_hooks()
            self._grad_sync = None
        if self.shard_optimizer:
            if len(self.optimizers) != 1 or not hasattr(self.optimizers[0], "reduce_gradients"):
                found = ", ".join(type(o).__name__ for o in self.optimizers) or "none"
                raise ValueError(
                    "shard_optimizer=True needs configure_optimizers to return one optimizer built with "
                    f"trainer.strategy.build_optimizer(...) (MulaLightningModule does), got {found}; "
                    "build it that way or use shard_optimizer=False."
                )
            return
        # (with pipeline stages the buckets launch in each stage's last backward: `last_backward_sync`)
        assert self.topology is not None
        self._grad_sync = GradientSynchronizer(
            self._trainable(), self.topology, self.bucket_size_mb, self.overlap_grad_reduce
        )

    # ----- the training step -----------------------------------------------------------------
    @property
    def zeroes_grads_after_step(self) -> bool:
        """Gradients are zeroed at the end of `optimizer_step`, so Lightning's zeroing before a step's
        first backward is not needed (and would wipe a pipeline step's gradients, whose backward passes
        run inside `training_step`): MulaLightningModule.optimizer_zero_grad then does nothing."""
        return True

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient-accumulation micro-batch: accumulate locally, communicate nothing."""
        sharded = self._sharded_optimizer()
        if self._grad_sync is not None:
            self._grad_sync.enabled = False
        try:
            if sharded is not None:
                with sharded.no_sync():
                    yield
            else:
                yield
        finally:
            if self._grad_sync is not None:
                self._grad_sync.enabled = True

    @contextmanager
    def last_backward_sync(self) -> Generator[None, None, None]:
        """Inside `block_backward_sync`: the backward run in this block is the step's last for the
        parameters it reaches (a pipeline stage's last micro-batch), so their buckets start reducing as
        they complete, as in the last backward of a step without stages, and an offloaded optimizer's
        host updates start with them (`strategies.optim.offload`)."""
        sharded = self._sharded_optimizer()
        if sharded is not None:
            before, sharded.reducer.sync = sharded.reducer.sync, True
        elif self._grad_sync is not None:
            before, self._grad_sync.enabled = self._grad_sync.enabled, True
        try:
            yield
        finally:
            if sharded is not None:
                sharded.reducer.sync = before
            elif self._grad_sync is not None:
                self._grad_sync.enabled = before

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """One optimizer step, the same for plain, sharded and pipelined runs, in this order:

        1. Lightning's closure: the step's last micro-batch's forward and backward (with pipeline
           stages the whole schedule ran in `training_step`; this runs the hooks around backward);
        2. reduce: finish the gradient reduction backward started (dense over the stage's ranks,
           experts over their EDP group);
        3. check: the global gradient norm and whether every gradient is finite, in one all-reduce,
           so every rank reaches the same verdict;
        4. `on_before_optimizer_step` hooks (callbacks, then the module): a callback may veto the
           update with `skip_optimizer_step` (AnomalyGuard does, with the same verdict on every rank);
        5. clip to the trainer's `gradient_clip_val` by that global norm, then update -- both skipped
           when a gradient is non-finite or the update was vetoed;
        6. zero the gradients.
        """
        closure_loss = closure()
        norm, finite = self._reduce_and_check_gradients()
        self.last_grad_norm = norm
        self.last_grads_finite = bool(finite)  # the step's one host sync
        self._skip_reason = None if self.last_grads_finite else "a gradient is not finite"
        self._skip_claimed = False
        call_before_optimizer_step_hooks(self.lightning_module.trainer, optimizer)
        if self._skip_reason is None:
            self._clip_gradients(optimizer, norm)
            optimizer.step()
        elif not self._skip_claimed:  # nobody reported it (no AnomalyGuard): say so once per skip
            step = self.lightning_module.trainer.global_step + 1
            rank_zero_warn(f"Skipping optimizer step {step} on all ranks: {self._skip_reason}.")
        optimizer.zero_grad()
        self._skip_reason = None
        return closure_loss

    @property
    def update_skipped(self) -> bool:
        """Whether this step's update is skipped (a non-finite gradient or a callback's veto). Final for
        the module's own `on_before_optimizer_step`, which runs after every callback's."""
        return self._skip_reason is not None

    def skip_optimizer_step(self, reason: str) -> None:
        """Veto this step's update (from an `on_before_optimizer_step` hook, on every rank alike): the
        parameters and optimizer state stay as they are, the gradients are dropped. The caller
        reports the skip."""
        self._skip_reason = reason
        self._skip_claimed = True

    def _reduce_and_check_gradients(self) -> tuple[Tensor, Tensor]:
        sharded = self._sharded_optimizer()
        if sharded is not None:
            return sharded.grad_norm()
        assert self._grad_sync is not None and self.topology is not None
        self._grad_sync.finish()
        return grad_norm(self._trainable(), self.topology)

    def _clip_gradients(self, optimizer: Any, norm: Tensor) -> None:
        """Clip as the trainer says (`gradient_clip_val`, `gradient_clip_algorithm`), by the global norm."""
        trainer = self.lightning_module.trainer
        clip_val = trainer.gradient_clip_val
        if not clip_val:
            return
        sharded = self._sharded_optimizer()
        if sharded is not None:
            sharded.clip_grad_norm_(float(clip_val), norm=norm)
        elif trainer.gradient_clip_algorithm == "value":  # element-wise: local, gradients are synchronised
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_value_(params, clip_val)
        else:
            scale_grads_(self._trainable(), float(clip_val), norm)

    def _trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.lightning_module.named_parameters() if p.requires_grad]

    def _sharded_optimizer(self) -> Any:
        if not self.shard_optimizer or not self.optimizers:
            return None
        opt = self.optimizers[0]
        opt = opt.optimizer if isinstance(opt, LightningOptimizer) else opt
        return opt if hasattr(opt, "reduce_gradients") else None


def parse_optimizer_options(options: dict[str, Any]) -> dict[str, Any]:
    """YAML gives dtypes as strings ("bfloat16", "bf16", "fp32"): turn them into torch dtypes."""
    out = dict(options)
    if isinstance(out.get("reduce_dtype"), str):
        out["reduce_dtype"] = torch_dtype(out["reduce_dtype"])
    return out
