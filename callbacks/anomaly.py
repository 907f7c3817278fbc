"""Skip optimizer steps with a non-finite loss/gradient or a loss spike; roll back if anomalies persist.

Per optimizer step (automatic optimization):

* ``on_before_backward`` accumulates the (accumulation-normalised) loss of each micro-batch;
* ``on_before_optimizer_step`` (gradients ready, before clipping and the update) all-reduces, in
  one collective, the loss sum and a "some local loss or gradient is non-finite" count. Every rank
  therefore sees the same global mean loss and the same verdict: skip if anything was non-finite,
  or if the loss is a spike -- robust z-score ``(loss - median) / (1.4826 * MAD)`` over the last
  ``window`` accepted losses above ``zscore_threshold``;
* a skipped step runs forward and backward but not the update: parameters and optimizer state (and,
  under XPUMoEStrategy, the router's balancing bias) stay untouched (a strategy that owns the step, XPUMoEStrategy, is told with ``skip_optimizer_step``;
  under other strategies the gradients are dropped, and torch optimizers skip parameters without one).
  Under XPUMoEStrategy the non-finite-gradient check is the strategy's flag, computed over the
  optimizer's gradient shards inside the global-norm all-reduce (a sharded optimizer keeps no ``.grad``). Lightning still counts the
  step (``global_step`` and the LR schedule advance; the batch is consumed); ``ft/skipped_steps``
  counts skips.

After ``max_consecutive`` anomalous steps in a row, ``on_max_consecutive="rollback"`` reloads the
model, optimizer, LR scheduler and RNG states from the newest valid checkpoint from before the
anomalies (at most ``max_rollbacks`` times) while the data position moves on, i.e. training
continues past the offending batches; ``"stop"`` (or no such checkpoint / rollbacks exhausted) ends
training on all ranks with exit code 65 (``ExitCode.DIVERGED``) and a message saying why.

The rollback rule, through two duck-typed methods the checkpoint callback asks for:

* the run is *unhealthy* from its first anomalous step until ``healthy_steps`` accepted steps in a
  row; ``protected_step()`` is then the last step before that first anomaly (else None), and the
  newest checkpoint at or before it is kept from pruning and is where a rollback goes;
* ``blocks_checkpoint()`` is true from an anomalous step (or a rollback) until the next accepted
  step: periodic checkpoints wait, so none is taken inside a streak.

Both follow from counters that are updated from the all-reduced verdict only, so every rank answers the same.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from callbacks import _dist, _peers
from callbacks.exit_codes import TrainingDiverged
from mula.torch_compat import foreach_norm
from mula.training.strategy_contract import mula_strategy

log = logging.getLogger(__name__)

_MAD_TO_STD = 1.4826  # MAD of a normal distribution times this is its standard deviation


def robust_zscore(value: float, history: list[float], min_rel_scale: float = 1e-3) -> float:
    """``(value - median) / (1.4826 * MAD)`` of ``history``; the scale is floored at ``min_rel_scale * |median|``
    so that a perfectly flat history does not make every tiny fluctuation infinite."""
    ordered = sorted(history)
    median = _median(ordered)
    mad = _median(sorted(abs(x - median) for x in ordered))
    scale = max(_MAD_TO_STD * mad, min_rel_scale * abs(median), 1e-12)
    return (value - median) / scale


def _grads_finite(
    trainer: pl.Trainer, optimizer: torch.optim.Optimizer, device: torch.device
) -> torch.Tensor:
    """Whether this step's gradients are finite: the strategy's verdict when it owns the step
    (XPUMoEStrategy: computed over the optimizer's gradient shards inside the global-norm all-reduce,
    the same on every rank; a sharded optimizer keeps no `.grad`), else this rank's `.grad` tensors."""
    strategy = mula_strategy(trainer.strategy)
    if strategy is not None and strategy.last_grads_finite is not None:
        return strategy.last_grads_finite.to(device)
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return torch.tensor(True, device=device)
    norms = foreach_norm(grads)
    return torch.isfinite(torch.stack([n.float() for n in norms]).sum()).to(device)


def _skip_update(trainer: pl.Trainer, optimizer: torch.optim.Optimizer, verdict: str) -> None:
    """Leave parameters and optimizer state untouched this step: through the strategy when it owns the
    step (`skip_optimizer_step`), else by dropping the gradients -- torch optimizers skip every
    parameter without one (no update, no moment or weight-decay change)."""
    strategy = mula_strategy(trainer.strategy)
    if strategy is not None:
        strategy.skip_optimizer_step(verdict)
    else:
        optimizer.zero_grad(set_to_none=True)


def _median(ordered: list[float]) -> float:
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


class AnomalyGuard(Callback):
    """Agree across ranks to skip optimizer steps with non-finite values or loss spikes; roll back or stop.

    Args:
        check_grads: also treat non-finite gradients as anomalies (one fused norm over local grads).
        zscore_threshold: robust z-score above which a loss is a spike (None disables spike detection).
        window: number of recent accepted losses the median/MAD are computed over.
        min_history: no spike detection before this many accepted losses (early training is noisy).
        max_consecutive: consecutive anomalous steps that trigger ``on_max_consecutive``.
        on_max_consecutive: "rollback" to the newest valid checkpoint from before the anomalies, or "stop".
        max_rollbacks: rollbacks allowed per run before stopping instead.
        healthy_steps: accepted steps in a row after an anomaly that make the run healthy again (until
            then the checkpoint from before the first anomaly is kept and rollbacks go there).
    """

    def __init__(
        self,
        check_grads: bool = True,
        zscore_threshold: float | None = 6.0,
        window: int = 200,
        min_history: int = 20,
        max_consecutive: int = 5,
        on_max_consecutive: Literal["rollback", "stop"] = "rollback",
        max_rollbacks: int = 3,
        healthy_steps: int = 10,
    ) -> None:
        if zscore_threshold is not None and zscore_threshold <= 0:
            raise ValueError(f"zscore_threshold must be > 0 or None, got {zscore_threshold}.")
        if window < 3 or not 1 <= min_history <= window:
            raise ValueError(
                f"Need window >= 3 and 1 <= min_history <= window, got {window=} {min_history=}."
            )
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {max_consecutive}.")
        if on_max_consecutive not in ("rollback", "stop"):
            raise ValueError(f"on_max_consecutive must be 'rollback' or 'stop', got {on_max_consecutive!r}.")
        if max_rollbacks < 0:
            raise ValueError(f"max_rollbacks must be >= 0, got {max_rollbacks}.")
        if healthy_steps < 1:
            raise ValueError(f"healthy_steps must be >= 1, got {healthy_steps}.")
        self.check_grads = check_grads
        self.zscore_threshold = zscore_threshold
        self.window = window
        self.min_history = min_history
        self.max_consecutive = max_consecutive
        self.on_max_consecutive = on_max_consecutive
        self.max_rollbacks = max_rollbacks
        self.healthy_steps = healthy_steps
        # Checkpointed state (identical on all ranks, so rank 0's copy is enough).
        self.history: deque[float] = deque(maxlen=window)
        self.skipped_steps = 0
        self.consecutive = 0
        self.rollbacks = 0
        self.streak_start: int | None = None  # last step before the first anomaly while unhealthy
        self.good_steps = 0  # accepted steps in a row since the last anomaly or rollback
        # Per-step scratch.
        self._loss_sum: torch.Tensor | None = None
        self._escalate = False
        self.last_verdict: str = "ok"
        self.last_loss: float = float("nan")

    # ------------------------------------------------------------------ checkpointed state

    @override
    def state_dict(self) -> dict[str, Any]:
        """Loss window and counters (so that a resumed run takes the same decisions)."""
        return {
            "history": list(self.history),
            "skipped_steps": self.skipped_steps,
            "consecutive": self.consecutive,
            "rollbacks": self.rollbacks,
            "streak_start": self.streak_start,
            "good_steps": self.good_steps,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.history = deque(state_dict.get("history", []), maxlen=self.window)
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.consecutive = int(state_dict.get("consecutive", 0))
        self.rollbacks = int(state_dict.get("rollbacks", 0))
        start = state_dict.get("streak_start")
        self.streak_start = None if start is None else int(start)
        self.good_steps = int(state_dict.get("good_steps", 0))

    # ------------------------------------------------------------------ interface for checkpointing

    def blocks_checkpoint(self) -> bool:
        """True from an anomalous step (or a rollback) until the next accepted step: no periodic save now."""
        return self.streak_start is not None and self.good_steps == 0

    def protected_step(self) -> int | None:
        """While the run is unhealthy, the last step before its first anomaly: the newest checkpoint at or
        before it must survive pruning, and rollbacks go there. None when healthy."""
        return self.streak_start

    # ------------------------------------------------------------------ hooks

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Refuse manual optimization (the verdict is taken between backward and the update)."""
        if not pl_module.automatic_optimization:
            raise ValueError("AnomalyGuard supports automatic optimization only.")

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        """Accumulate the micro-batch losses of this optimizer step (already divided by the accumulation)."""
        value = loss.detach().float()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Take the (rank-agreed) verdict for this step."""
        device = trainer.strategy.root_device
        loss_sum = self._loss_sum if self._loss_sum is not None else torch.zeros((), device=device)
        self._loss_sum = None
        bad = ~torch.isfinite(loss_sum)
        if self.check_grads:
            bad = bad | ~_grads_finite(trainer, optimizer, device)
        # One collective and one host sync: [sum of finite losses, number of ranks with a non-finite value].
        # (The guard's verdict is taken on the host every step: a run with AnomalyGuard has this one sync
        # per step, mula.host_sync; without it, the strategy's non-finite skip stays on the device.)
        local = torch.stack([torch.where(bad, torch.zeros_like(loss_sum), loss_sum), bad.float()])
        total, n_bad = _dist.all_reduce_tensor(local.to(device), "sum").tolist()
        loss = total / _dist.world_size()
        self.last_loss = loss if n_bad == 0 else float("nan")
        verdict = "ok"
        if n_bad > 0:
            verdict = "non-finite loss or gradient"
        elif self.zscore_threshold is not None and len(self.history) >= self.min_history:
            z = robust_zscore(loss, list(self.history))
            if z > self.zscore_threshold:
                verdict = f"loss spike (loss {loss:.4g}, robust z-score {z:.1f} > {self.zscore_threshold})"
        self.last_verdict = verdict
        if verdict == "ok":
            self.history.append(loss)
            self.consecutive = 0
            self.good_steps += 1
            if self.streak_start is not None and self.good_steps >= self.healthy_steps:
                self.streak_start = None  # healthy again: the pre-anomaly checkpoint may be pruned
            return
        if self.streak_start is None:
            self.streak_start = trainer.global_step  # the last completed (accepted) step
        self.good_steps = 0
        _skip_update(trainer, optimizer, verdict)
        self.skipped_steps += 1
        self.consecutive += 1
        step = trainer.global_step + 1
        rank_zero_warn(f"Skipping optimizer step {step} on all ranks: {verdict}.")
        if self.consecutive >= self.max_consecutive:
            self._escalate = True  # acted upon at the step boundary, outside the optimizer step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log the skip counter; roll back or stop after too many consecutive anomalies."""
        pl_module.log(
            "ft/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False, sync_dist=False
        )
        if not self._escalate:
            return
        self._escalate = False
        reason = f"{self.consecutive} consecutive anomalous steps (last: {self.last_verdict}) at step {trainer.global_step}"
        if self.on_max_consecutive == "stop":
            self._stop(f"Training stopped: {reason}.")
        if self.rollbacks >= self.max_rollbacks:
            self._stop(
                f"Training stopped: {reason}, and the {self.max_rollbacks} allowed rollbacks are used up."
            )
        checkpointer = _peers.checkpointer(trainer)
        bound = self.streak_start
        path = checkpointer.latest_valid_checkpoint(trainer, bound) if checkpointer is not None else None
        if path is None:
            self._stop(
                f"Training stopped: {reason}, and there is no valid checkpoint from before the anomalies"
                f" (step <= {bound}) to roll back to."
            )
        self._rollback(trainer, checkpointer, path)
        self.rollbacks += 1
        self.consecutive = 0
        self.good_steps = 0  # still unhealthy: the next periodic save waits for an accepted step
        rank_zero_warn(
            f"{reason}: rolled back model, optimizer, LR scheduler and RNG to {path}; training continues with the"
            f" next batches (rollback {self.rollbacks}/{self.max_rollbacks})."
        )

    def _rollback(self, trainer: pl.Trainer, checkpointer: _peers.Checkpointer, path: Any) -> None:
        """Load model/optimizer/scheduler/RNG state; loop counters and data position stay where they are."""
        strategy = trainer.strategy
        checkpoint = strategy.load_checkpoint(path)
        strategy.load_model_state_dict(checkpoint, strict=True)
        strategy.load_optimizer_state_dict(checkpoint)
        for config, state in zip(trainer.lr_scheduler_configs, checkpoint.get("lr_schedulers", [])):
            config.scheduler.load_state_dict(state)
        checkpointer.apply_rng_from(checkpoint, trainer)
        strategy.barrier("AnomalyGuard.rollback")

    def _stop(self, message: str) -> None:
        if _dist.rank() == 0:
            log.error(message)
        raise TrainingDiverged(message)


__all__ = ["AnomalyGuard", "robust_zscore"]
