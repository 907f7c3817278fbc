"""Lightning's CSVLogger, with a metrics file that a crash cannot empty.

Lightning's CSV writer rewrites `metrics.csv` in place whenever a metric appears for the first time (the
header grows): it truncates the file, then writes every row back. A run killed between the two (SIGKILL,
a node failure, the hang watchdog) loses every row logged so far, evaluations included. Here the new file
is written beside the old one and renamed over it (`mula/checkpoint/atomic.py`), so a reader sees either the old rows or all of them.
"""

from __future__ import annotations

import csv

from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from typing_extensions import override

from mula.checkpoint.atomic import atomic_write


class AtomicExperimentWriter(ExperimentWriter):
    """Lightning's experiment writer whose header rewrite replaces `metrics.csv` atomically."""

    @override
    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        if not isinstance(self._fs, LocalFileSystem):
            # object stores replace a whole object when it is closed: already all-or-nothing
            super()._rewrite_with_new_header(fieldnames)
            return
        with open(self.metrics_file_path, newline="") as file:
            rows = list(csv.DictReader(file))
        with atomic_write(self.metrics_file_path) as partial, open(partial, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=fieldnames)
            writer.writeheader()
            writer.writerows(rows)


class CSVLogger(LightningCSVLogger):
    """`lightning.pytorch.loggers.CSVLogger` (same arguments, same files) that never empties `metrics.csv`
    when the process dies while a new metric's column is being added."""

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = AtomicExperimentWriter(log_dir=self.log_dir)
        return self._experiment
