"""Lightning's CSVLogger, with a metrics file that a crash cannot empty.

Lightning's CSV writer rewrites `metrics.csv` in place whenever a metric appears for the first time (the
header grows): it truncates the file, then writes every row back. A run killed between the two (SIGKILL,
a node failure, the hang watchdog) loses every row logged so far, evaluations included. Here the new file
is written beside the old one and renamed over it (`mula/checkpoint/atomic.py`), so a reader sees either
the old rows or all of them.
"""

from __future__ import annotations

import csv
from pathlib import Path

from fsspec.utils import get_protocol
from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from mula.checkpoint.atomic import atomic_write


class AtomicExperimentWriter(ExperimentWriter):
    """Lightning's experiment writer whose header rewrite replaces `metrics.csv` atomically (on a local
    filesystem; object stores replace a whole object when it is closed: already all-or-nothing)."""

    @override
    def save(self) -> None:
        """Lightning's `save` (the same file, byte for byte) with the header rewrite made atomic."""
        if not self.metrics or get_protocol(self.metrics_file_path) != "file":
            super().save()
            return
        keys = sorted(set(self.metrics_keys).union(*self.metrics))
        path = Path(self.metrics_file_path)
        exists = path.is_file()
        if exists and keys != self.metrics_keys:  # a new column: every row again, under the wider header
            with open(path, newline="") as file:
                rows = list(csv.DictReader(file))
            with atomic_write(path) as partial, open(partial, "w", newline="") as file:
                writer = csv.DictWriter(file, fieldnames=keys)
                writer.writeheader()
                writer.writerows(rows)
        self.metrics_keys[:] = keys
        with open(path, "a" if exists else "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=keys)
            if not exists:
                writer.writeheader()
            writer.writerows(self.metrics)
        self.metrics = []


class CSVLogger(LightningCSVLogger):
    """`lightning.pytorch.loggers.CSVLogger` (same arguments, same files) that never empties `metrics.csv`
    when the process dies while a new metric's column is being added. Its writer is kept in its own
    attribute, so no private Lightning name is read (mula/training/lightning_compat.py)."""

    # made at the first `experiment`; a class default, not an `__init__`, so the constructor's signature
    # stays Lightning's (jsonargparse and `mula plan`'s recipe reader read it)
    _atomic_writer: AtomicExperimentWriter | None = None

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        writer = self._atomic_writer
        if writer is None:
            writer = self._atomic_writer = AtomicExperimentWriter(log_dir=self.log_dir)  # makes the directory
        return writer

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Write what is buffered, as Lightning's does (nothing where no writer was made: a launcher's
        main process)."""
        if self._atomic_writer is not None:
            self.save()
