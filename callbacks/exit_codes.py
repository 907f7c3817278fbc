"""Process exit codes of a Mula training run (documented in docs/resilience.md).

Launchers and ``scripts/mula-resilient`` use them to decide whether to restart.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Why a ``mula fit`` process ended."""

    #: Training finished.
    OK = 0
    #: Unhandled error (Python exception): restartable, resumes from the last checkpoint.
    ERROR = 1
    #: Too many consecutive anomalous steps and no rollback possible: do NOT restart blindly.
    DIVERGED = 65
    #: Preemption signal handled: a checkpoint of the last step was written; restart/requeue to resume.
    PREEMPTED = 75
    #: Hang watchdog fired: stacks are in <run dir>/watchdog/; restart to resume.
    HANG = 124


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint; exits the process with ``ExitCode.PREEMPTED``."""

    def __init__(self, code: int = ExitCode.PREEMPTED) -> None:
        super().__init__(int(code))


class TrainingDiverged(SystemExit):
    """Raised on every rank when anomalies persist; exits with ``ExitCode.DIVERGED`` after logging why."""

    def __init__(self, message: str, code: int = ExitCode.DIVERGED) -> None:
        super().__init__(int(code))
        self.message = message

    def __str__(self) -> str:
        return self.message
