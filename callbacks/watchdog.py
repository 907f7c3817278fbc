"""Hang watchdog: no progress for T seconds -> all threads' stacks to the run directory, then exit 124.

A daemon thread checks the time since the last heartbeat (a completed training or validation
batch, a checkpoint save). When it exceeds ``timeout_s`` (``first_step_timeout_s`` before the first
completed step, which includes data start-up and compilation) it writes
``<run dir>/watchdog/hang-rank<R>-<host>-pid<P>.txt`` (a header plus ``faulthandler`` stacks of every
thread), then calls ``os._exit(124)`` so that the launcher (torchrun, SLURM, ``mula-resilient``)
can restart the run, which resumes from the last checkpoint.

If the main thread hangs while holding the GIL, Python threads cannot run; a C-level
``faulthandler.dump_traceback_later`` backstop, re-armed at every heartbeat, then dumps the stacks
to stderr and exits with code 1 ``backstop_grace_s`` later.

Collective timeouts: a rank stuck in a collective is blocked until the process-group timeout
(``DDPStrategy(timeout=...)``, 30 min by default in Lightning) aborts it, and that abort leaves no
stacks behind. Keep ``timeout_s`` below the strategy's process-group timeout, so that every rank's
watchdog fires (and dumps where it was waiting) first; ``setup`` warns when it is not.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from callbacks.exit_codes import ExitCode
from mula.training.lightning_compat import process_group_timeout
from mula.training.step_boundary import StepBoundary

log = logging.getLogger(__name__)


class HangWatchdog(Callback):
    """Dump every thread's stack and exit non-zero when training makes no progress for ``timeout_s``.

    Args:
        timeout_s: seconds without a completed step (or validation batch, or checkpoint save) before firing.
        first_step_timeout_s: the limit until the first step completes (default: 3 x ``timeout_s``).
        dump_dir: where stack dumps go (default ``<trainer.default_root_dir>/watchdog``).
        exit_code: process exit code when it fires (default 124, ``ExitCode.HANG``).
        poll_interval_s: how often the thread checks (default: ``timeout_s / 20``, between 0.1 and 30 s).
        backstop_grace_s: delay of the C-level backstop after ``timeout_s`` (for GIL-holding hangs; 0 disables).
    """

    def __init__(
        self,
        timeout_s: float = 1200.0,
        first_step_timeout_s: float | None = None,
        dump_dir: str | None = None,
        exit_code: int = int(ExitCode.HANG),
        poll_interval_s: float | None = None,
        backstop_grace_s: float = 60.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}.")
        if first_step_timeout_s is not None and first_step_timeout_s <= 0:
            raise ValueError(f"first_step_timeout_s must be > 0, got {first_step_timeout_s}.")
        if not 1 <= exit_code <= 255:
            raise ValueError(f"exit_code must be in 1..255, got {exit_code}.")
        self.timeout_s = float(timeout_s)
        self.first_step_timeout_s = (
            float(first_step_timeout_s) if first_step_timeout_s else 3.0 * self.timeout_s
        )
        self.dump_dir = dump_dir
        self.exit_code = exit_code
        self.poll_interval_s = poll_interval_s or min(30.0, max(0.1, self.timeout_s / 20))
        self.backstop_grace_s = backstop_grace_s
        self._last_beat = time.monotonic()
        self._steps_done = 0
        # never started: the first completed batch counts as a step (`timeout_s` applies from then on)
        self._steps = StepBoundary()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rank = 0
        self._world = 1
        self._dump_path: Path | None = None
        self._backstop = backstop_grace_s > 0

    # ------------------------------------------------------------------ heartbeat

    def heartbeat(self) -> None:
        """Record progress (also called by ``FaultTolerantCheckpoint`` around saves)."""
        self._last_beat = time.monotonic()
        if self._thread is not None and self._backstop:
            try:
                faulthandler.dump_traceback_later(
                    self._limit() + self.backstop_grace_s, exit=True, file=sys.stderr
                )
            except (AttributeError, ValueError, OSError, RuntimeError):  # stderr without a file descriptor
                self._backstop = False

    def _limit(self) -> float:
        return self.timeout_s if self._steps_done else self.first_step_timeout_s

    # ------------------------------------------------------------------ Lightning hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve the dump directory and check the process-group timeout."""
        if stage != "fit":
            return
        self._rank, self._world = trainer.global_rank, trainer.world_size
        base = Path(self.dump_dir) if self.dump_dir else Path(trainer.default_root_dir) / "watchdog"
        host = socket.gethostname().split(".")[0]
        self._dump_path = base / f"hang-rank{self._rank:05d}-{host}-pid{os.getpid()}.txt"
        pg_timeout = process_group_timeout(trainer.strategy)
        if pg_timeout is not None and pg_timeout.total_seconds() <= self.timeout_s:
            rank_zero_warn(
                f"The strategy's process-group timeout ({pg_timeout.total_seconds():.0f}s) is not longer than the"
                f" hang watchdog's timeout ({self.timeout_s:.0f}s): a rank stuck in a collective would be aborted"
                " without a stack dump. Set the strategy's `timeout` above the watchdog's `timeout_s`."
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start watching (covers checkpoint restore, sanity check and the first step)."""
        if self._thread is None and self._dump_path is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="mula-hang-watchdog", daemon=True)
            self._thread.start()
            self.heartbeat()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """A completed batch is progress."""
        if self._steps.crossed(trainer):
            self._steps_done += 1
        self.heartbeat()

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        """Validation batches are progress too."""
        self.heartbeat()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Validation/epoch boundaries are progress."""
        self.heartbeat()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Stop watching."""
        self._shutdown()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Stop watching (the process is ending through an exception)."""
        self._shutdown()

    def _shutdown(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
            faulthandler.cancel_dump_traceback_later()

    # ------------------------------------------------------------------ the watching thread

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            idle = time.monotonic() - self._last_beat
            if idle > self._limit():
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        assert self._dump_path is not None
        phase = "" if self._steps_done else ", waiting for the first step"
        header = (
            f"Mula hang watchdog: no training progress for {idle:.1f}s (limit {self._limit():.1f}s{phase});"
            f" rank {self._rank}/{self._world}, host {socket.gethostname()}, pid {os.getpid()},"
            f" last step {self._steps.seen}, {time.strftime('%Y-%m-%d %H:%M:%S')}.\n\n"
        )
        try:
            self._dump_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self._dump_path, "w", encoding="utf-8") as f:
                f.write(header)
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
                f.flush()
                os.fsync(f.fileno())
            where = str(self._dump_path)
        except OSError as err:  # still dump somewhere and still exit
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            where = f"stderr (could not write {self._dump_path}: {err})"
        sys.stderr.write(f"{header.strip()} Stacks written to {where}; exiting with code {self.exit_code}.\n")
        sys.stderr.flush()
        os._exit(self.exit_code)
