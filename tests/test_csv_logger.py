"""`mula.training.csv_logger.CSVLogger`: Lightning's files, and a metrics file a crash during a header rewrite keeps."""

import csv

import pytest
from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger

from mula.training.csv_logger import CSVLogger

ROWS = [  # each new key makes the writer rewrite the whole file under a wider header
    ({"train/loss": 4.5}, 0),
    ({"train/loss": 4.25, "eval/acc": 0.25}, 1),
    ({"checkpoint/bytes": 1024.0}, 1),
    ({"train/loss": 4.0, "train/lr": 1e-3}, 2),
]


def _log(logger, rows) -> None:
    for metrics, step in rows:
        logger.log_metrics(metrics, step=step)
        logger.save()


def test_files_are_lightnings_byte_for_byte(tmp_path):
    ours, theirs = CSVLogger(tmp_path / "ours", name=""), LightningCSVLogger(tmp_path / "theirs", name="")
    for logger in (ours, theirs):
        _log(logger, ROWS)
        logger.log_metrics({"val/loss": 3.5}, step=3)  # buffered: the end of the run writes it
        logger.finalize("success")
    assert ours.log_dir.endswith("version_0")
    assert (tmp_path / "ours/version_0/metrics.csv").read_bytes() == (
        tmp_path / "theirs/version_0/metrics.csv"
    ).read_bytes()
    assert "val/loss" in (tmp_path / "ours/version_0/metrics.csv").read_text()
    assert sorted(p.name for p in (tmp_path / "ours/version_0").iterdir()) == ["metrics.csv"]


class Killed(BaseException):
    """Stands for the process dying inside the rewrite."""


@pytest.mark.parametrize("cls, keeps", [(CSVLogger, True), (LightningCSVLogger, False)])
def test_a_death_during_a_header_rewrite_keeps_every_row(tmp_path, monkeypatch, cls, keeps):
    """The rows already written survive a death after the rewrite began; Lightning's own writer has
    truncated the file by then (why this class exists: tests/test_downstream_eval.py lost its evaluations)."""
    logger = cls(tmp_path, name="")
    _log(logger, ROWS[:1])
    path = tmp_path / "version_0" / "metrics.csv"
    before = path.read_text()

    def die(self, *args, **kwargs):
        raise Killed

    monkeypatch.setattr(csv.DictWriter, "writeheader", die)
    with pytest.raises(Killed):
        _log(logger, ROWS[1:2])
    assert (path.read_text() == before) is keeps
    if keeps:
        with open(path, newline="") as f:
            assert [r["train/loss"] for r in csv.DictReader(f)] == ["4.5"]
