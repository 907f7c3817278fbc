"""Preemption: on SIGTERM/SIGUSR1, checkpoint at the next step boundary on all ranks, then exit 75.

The signal handler only records the signal. At the step boundary of each logging step (every
``log_every_n_steps`` steps, or ``every_n_steps``) the ranks agree (one all-reduce of a flag, read on the
host: a signal seen by any rank counts for all; on the other steps the host does not wait for the device,
mula.host_sync), then every rank takes part in a
crash-safe checkpoint (``FaultTolerantCheckpoint.save``), rank 0 requeues the SLURM job when
Lightning's ``SLURMEnvironment(auto_requeue=True)`` is in use, the step's metrics are handed to the
loggers and written out (so metrics.csv ends with the checkpointed step), and every rank exits with
``ExitCode.PREEMPTED`` (75). Re-running the same command resumes from that checkpoint.

Lightning's own SIGTERM handler (which raises ``SIGTERMException`` at the next batch, before any
checkpoint, and runs a broadcast inside the signal handler) and its SLURM SIGUSR1 handler are
replaced by this one for the duration of training.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from callbacks import _dist, _peers
from callbacks.exit_codes import ExitCode, Preempted
from mula.host_sync import logging_step
from mula.training.lightning_compat import cluster_environment, forget_lightning_sigterm, log_train_step_now
from mula.training.step_boundary import StepBoundary

log = logging.getLogger(__name__)


def _parse_signal(name: str | int) -> signal.Signals:
    if isinstance(name, int):
        return signal.Signals(name)
    key = name.upper()
    key = key if key.startswith("SIG") else "SIG" + key
    try:
        return signal.Signals[key]
    except KeyError:
        raise ValueError(f"Unknown signal {name!r}; use a name such as 'SIGTERM' or 'SIGUSR1'.") from None


class PreemptionHandler(Callback):
    """Turn preemption signals into a checkpoint at the next step boundary and a documented exit code.

    Args:
        signals: signal names to handle (default SIGTERM and SIGUSR1). On SLURM, the
            ``SLURMEnvironment.requeue_signal`` is added.
        exit_code: process exit code after the preemption checkpoint (default 75, ``ExitCode.PREEMPTED``).
        requeue: requeue the SLURM job after the checkpoint. None (default): follow the
            ``auto_requeue`` setting of Lightning's ``SLURMEnvironment`` plugin when running under SLURM.
        every_n_steps: agree on a signal at every this many step boundaries. None (default): on the
            trainer's logging steps (``log_every_n_steps``), whose metrics the host reads anyway; the
            signal should come that many steps before the job is killed.
    """

    def __init__(
        self,
        signals: list[str] | None = None,
        exit_code: int = int(ExitCode.PREEMPTED),
        requeue: bool | None = None,
        every_n_steps: int | None = None,
    ) -> None:
        names = ["SIGTERM", "SIGUSR1"] if signals is None else signals
        if not names:
            raise ValueError("PreemptionHandler needs at least one signal.")
        self.signals = [_parse_signal(s) for s in names]
        if not 1 <= exit_code <= 255:
            raise ValueError(f"exit_code must be in 1..255, got {exit_code}.")
        self.exit_code = exit_code
        self.requeue = requeue
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 or None, got {every_n_steps}.")
        self.every_n_steps = every_n_steps
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._steps = StepBoundary()
        self._checkpoint: _peers.Checkpointer | None = None

    # ------------------------------------------------------------------ signal handling

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Runs between two bytecodes of the main thread: only record; act at the next step boundary.
        if self.received is None:
            self.received = signal.Signals(signum)

    def _install(self, trainer: pl.Trainer) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("PreemptionHandler: not in the main thread, cannot install signal handlers.")
            return
        signals = list(self.signals)
        env = cluster_environment(trainer)
        if isinstance(env, SLURMEnvironment) and env.requeue_signal is not None:
            requeue_signal = signal.Signals(env.requeue_signal)
            if requeue_signal not in signals:
                signals.append(requeue_signal)
        for sig in signals:
            current = signal.getsignal(sig)
            if current != self._handle:
                self._previous.setdefault(sig, current)
                signal.signal(sig, self._handle)

    def _uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    # ------------------------------------------------------------------ Lightning hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Find the checkpoint callback; install handlers early (a SIGUSR1 would otherwise kill the process)."""
        if stage != "fit":
            return
        found = _peers.checkpointer(trainer)
        if found is None:
            raise ValueError(
                "PreemptionHandler needs a callbacks.FaultTolerantCheckpoint in trainer.callbacks to save with."
            )
        self._checkpoint = found
        self._install(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Re-install: Lightning registers its own SIGTERM/SLURM handlers after ``setup``."""
        self._install(trainer)
        if self.received is not None and trainer.received_sigterm:
            # A SIGTERM during start-up also reached Lightning's handler (composed with ours); we handle it
            # at the first step boundary with a checkpoint, so Lightning must not abort the loop first.
            forget_lightning_sigterm(trainer)
        self._steps.start(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """At a logging step's boundary: if any rank got a signal, checkpoint on all ranks, requeue, exit."""
        if not self._steps.crossed(trainer):
            return
        step = trainer.global_step
        # (a run that never logs agrees at every step)
        every = (trainer.log_every_n_steps or 1) if self.every_n_steps is None else self.every_n_steps
        if not logging_step(step, every):
            return
        if not _dist.any_rank(self.received is not None, trainer.strategy.root_device):
            return
        name = self.received.name if self.received is not None else "a preemption signal (on another rank)"
        rank_zero_info(
            f"Received {name}: checkpointing step {step}, then exiting with code {self.exit_code}."
        )
        path = self._checkpoint.save(trainer, reason="preemption")
        if trainer.is_global_zero and self._should_requeue(trainer):
            _requeue_slurm_job()
        rank_zero_info(f"Preemption checkpoint {path} written; re-run the same command to resume.")
        _flush_loggers(trainer)
        raise Preempted(self.exit_code)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Restore the previous handlers."""
        self._uninstall()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Restore the previous handlers; give Lightning's SIGTERM exit a non-zero code.

        Outside the training steps (e.g. a sanity check), Lightning itself ends the run on SIGTERM
        with ``SIGTERMException``, i.e. exit status 0, which launchers would read as "finished".
        It becomes 143 (128 + SIGTERM): terminated, no new checkpoint, restartable.
        """
        self._uninstall()
        if isinstance(exception, SIGTERMException) and exception.code in (None, 0):
            exception.code = 128 + int(signal.SIGTERM)

    def _should_requeue(self, trainer: pl.Trainer) -> bool:
        env = cluster_environment(trainer)
        on_slurm = isinstance(env, SLURMEnvironment) and "SLURM_JOB_ID" in os.environ
        if self.requeue is None:
            return on_slurm and bool(env.auto_requeue)
        return self.requeue and on_slurm


def _flush_loggers(trainer: pl.Trainer) -> None:
    """Log the checkpointed step and write the loggers' buffers before the exit.

    Lightning hands a step's metrics to the loggers only after every ``on_train_batch_end`` hook
    returned, and CSVLogger writes its buffer only every ``flush_logs_every_n_steps``: without this,
    the last step before the exit would be missing from metrics.csv.
    """
    log_train_step_now(trainer)
    for logger in trainer.loggers:
        logger.save()


def _requeue_slurm_job() -> None:
    """``scontrol requeue`` this job (array-aware), as Lightning's SLURM handler does."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job_id = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_]+", job_id):
        log.warning("Not requeuing: unexpected SLURM job id %r.", job_id)
        return
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], check=False).returncode
    except FileNotFoundError:
        log.warning("Not requeuing: scontrol not found.")
        return
    if result == 0:
        rank_zero_info(f"Requeued SLURM job {job_id}.")
    else:
        log.warning("Requeuing SLURM job %s failed with exit code %d.", job_id, result)
