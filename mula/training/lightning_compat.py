"""The private Lightning internals Mula relies on, each imported here and only here.

Lightning may move or change a private name in any release, so Mula pins the range it is tested with
(`TESTED_LIGHTNING`, the same range as the `lightning` requirement in pyproject.toml). A Lightning
outside it that moved one of these names fails on import with one sentence naming the name and the
tested range, instead of an AttributeError deep inside a training run.

Not importable, so not here: strategies/sharded_state.py (`rescale_loop_progress`) reads the layout of
Lightning's checkpoint dict, `checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]` with
"total"/"current" counters, which is equally private and equally tested only in this range; and
XPUMoEStrategy overrides Lightning's private `_configure_launcher` hook (setting the strategy's
`_launcher`), the one way Lightning gives a custom strategy to choose its launcher. No other module
imports a private Lightning name or overrides a private Lightning method (tests/test_lightning_compat.py).

The private attributes Mula reads or writes on Lightning's objects (the trainer's connectors and loops,
a strategy's process-group timeout, a WandbLogger's `wandb.init` arguments) are reached through the
named functions below, with the same tested range; no other module reads a private name through a
string (`getattr(x, "_name")`, same test).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning
from torchmetrics import MeanMetric

from mula.host_sync import logging_step

TESTED_LIGHTNING = ">=2.5,<2.7,!=2.6.2,!=2.6.3"  # keep equal to pyproject.toml's requirement

try:
    # The type of the registry that XPUAccelerator.register_accelerators receives (annotation only).
    from lightning.fabric.accelerators.registry import _AcceleratorRegistry

    # Distributed setup of XPUMoEStrategy, as Lightning's DDPStrategy does it: the shared init of the
    # process group (with Lightning's environment variables) and the all-reduce used by `reduce`.
    from lightning.fabric.utilities.distributed import (
        _distributed_is_initialized,
        _init_dist_connection,
        _sync_ddp_if_available,
    )

    # XPUMoEStrategy.setup moves restored optimizer state to the device, as DDPStrategy does.
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    # XPUMoEStrategy launches its ranks as subprocesses of `mula fit` when not started by a launcher.
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    # XPUMoEStrategy.optimizer_step runs the hooks Lightning's precision plugin runs before clipping.
    from lightning.pytorch.trainer.call import _call_callback_hooks, _call_lightning_module_hook
except ImportError as e:
    raise ImportError(
        f"Mula uses a private part of Lightning that lightning {lightning.__version__} does not have "
        f"({e}); Mula is tested with lightning{TESTED_LIGHTNING}, install a version in that range."
    ) from e

__all__ = [
    "TESTED_LIGHTNING",
    "_AcceleratorRegistry",
    "_SubprocessScriptLauncher",
    "_distributed_is_initialized",
    "_init_dist_connection",
    "_optimizers_to_device",
    "_sync_ddp_if_available",
    "call_before_optimizer_step_hooks",
    "cluster_environment",
    "dump_checkpoint",
    "ends_optimizer_step",
    "forget_lightning_sigterm",
    "leave_wandb_anonymous_unset",
    "log_train_step_now",
    "logs_train_step",
    "process_group_timeout",
    "sigterm_agreement_on_logging_steps",
]


def call_before_optimizer_step_hooks(trainer: Any, optimizer: Any) -> None:
    """Run `on_before_optimizer_step` of every callback, then of the LightningModule, as Lightning's
    `Precision._after_closure` does (with the hook name registered, so `self.log` works in them).

    For a strategy that owns the optimizer step and so does not go through the precision plugin's.
    """
    _call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
    _call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)


def cluster_environment(trainer: Any) -> Any:
    """The trainer's cluster environment (SLURM, torchelastic, ...), also for single-device strategies.

    Only `ParallelStrategy` exposes it publicly (`strategy.cluster_environment`); the trainer's private
    accelerator connector always knows it, which PreemptionHandler needs to requeue a 1-GPU SLURM job.
    """
    return trainer._accelerator_connector.cluster_environment


def ends_optimizer_step(trainer: Any) -> bool:
    """Whether the training micro-batch being run is the last of its gradient-accumulation window.

    Lightning's own rule (`_should_accumulate`), which also steps on the last batch of an epoch; valid
    from `training_step` to `on_train_batch_end` of that micro-batch.
    """
    return not trainer.fit_loop._should_accumulate()


def logs_train_step(trainer: Any) -> bool:
    """Whether Lightning hands the train metrics of the optimizer step being run to the loggers.

    Every `log_every_n_steps` steps, before a stop and under `fast_dev_run`; valid from `training_step`
    to `on_train_batch_end` of the window's last micro-batch.
    """
    return bool(trainer._logger_connector.should_update_logs or trainer.fast_dev_run)


def log_train_step_now(trainer: Any) -> None:
    """Hand the train metrics of this step to the loggers now, as Lightning does after `on_train_batch_end`.

    For a callback that ends training inside `on_train_batch_end` (a preemption): Lightning would hand
    them over only after every `on_train_batch_end` hook returned, so the step would be missing.
    """
    trainer._logger_connector.update_train_step_metrics()


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """The full checkpoint dict ``trainer.save_checkpoint`` would write (collective: every rank calls it).

    FaultTolerantCheckpoint writes it through ``strategy.save_checkpoint`` itself instead of calling
    ``trainer.save_checkpoint``, whose trailing barrier a rank that failed to write would never reach.
    """
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def process_group_timeout(strategy: Any) -> timedelta | None:
    """The timeout the strategy's process group was (or will be) created with; None when it has none.

    Lightning's DDP, FSDP, DeepSpeed and ModelParallel strategies keep their `timeout` argument in a
    private `_timeout` with no public reader (XPUMoEStrategy keeps it the same way); HangWatchdog compares
    it with its own timeout.
    """
    timeout = getattr(strategy, "_timeout", None)
    return timeout if isinstance(timeout, timedelta) else None


def forget_lightning_sigterm(trainer: Any) -> None:
    """Clear the SIGTERM Lightning's own handler recorded (public, read-only: `trainer.received_sigterm`).

    Lightning ends the fit loop at the next batch once it saw a SIGTERM; PreemptionHandler, which handles
    the signal itself at the next step boundary with a checkpoint, clears it when a SIGTERM during
    start-up reached both handlers.
    """
    trainer._signal_connector.received_sigterm = False


def sigterm_agreement_on_logging_steps(trainer: Any) -> None:
    """Run Lightning's SIGTERM agreement only on the first batch of a logging step (every
    `log_every_n_steps` steps; never when that is 0), for the fit the trainer is about to run.

    On more than one rank Lightning broadcasts rank 0's SIGTERM flag before every training batch and
    reads it with `.item()`: a host sync per micro-batch (mula.host_sync). On a logging step the host
    reads the step's metrics anyway. The agreement itself is Lightning's (its private, per-instance
    `_broadcast_sigterm_tensor`, called by the same ranks at the same batches); a SIGTERM Lightning's
    own handler recorded ends the run at the next logging step instead of the next batch.
    PreemptionHandler (every recipe) handles the signals itself and checkpoints first.
    """
    loop = trainer.fit_loop.epoch_loop
    agree = type(loop)._broadcast_sigterm_tensor
    last = [None]  # the step whose first batch was seen

    def on_logging_steps() -> None:
        step = trainer.global_step
        first, last[0] = step != last[0], step
        if first and logging_step(step + 1, trainer.log_every_n_steps):
            agree(loop)

    loop._broadcast_sigterm_tensor = on_logging_steps


def leave_wandb_anonymous_unset(logger: Any) -> None:
    """Leave `anonymous` out of the `wandb.init` arguments of Lightning's `WandbLogger` unless the recipe
    asked for anonymous logging.

    Lightning puts `anonymous=None` among the arguments it keeps for `wandb.init` (its private
    `_wandb_init`) whatever the recipe says, and wandb, which deprecated the setting, warns on every run
    that "the anonymous setting has no effect" whenever the argument is given at all.
    """
    init = getattr(logger, "_wandb_init", None)
    if isinstance(init, dict) and init.get("anonymous") is None:
        init.pop("anonymous", None)


def silence_lightning_deprecations() -> None:
    """Hide the deprecation warnings Lightning's own code raises through torch and a user cannot act on:
    Lightning's `utilities/_pytree.py` builds torch's `LeafSpec`, which torch 2.10+ deprecates (a
    FutureWarning on every `mula fit`). Only that message, so anything else still shows."""
    import warnings

    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )


class KeepsStateDtypes:
    """Mixin for a torchmetrics `Metric` (first in the bases) whose states keep their dtypes when the module
    is cast: `bf16-true` casts the LightningModule with `.to(dtype)`, metrics included, and torchmetrics
    guards only `.half()`/`.float()`-style casts, so a running sum would become bf16 and round every
    addition (and `update` would cast its inputs to bf16). Moves still apply (device). Reaches
    torchmetrics' private `_defaults` (the reset values) and `_dtype` (the inputs' dtype)."""

    def _apply(self, fn: Any, exclude_state: Any = ()) -> Any:
        dtypes = {key: getattr(self, key).dtype for key in self._defaults}
        compute_dtype = self._dtype  # what `update` casts its inputs to (MeanMetric's values)
        this = super()._apply(fn, exclude_state)  # type: ignore[misc]
        for key, dtype in dtypes.items():
            setattr(this, key, getattr(this, key).to(dtype))
            this._defaults[key] = this._defaults[key].to(dtype)
        this._dtype = compute_dtype
        return this


class FullPrecisionMean(KeepsStateDtypes, MeanMetric):
    """torchmetrics' `MeanMetric` whose sums stay float32 under a bf16 cast of the module (`val/loss`)."""
