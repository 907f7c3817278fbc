"""Auto-resume when every checkpoint of a run is invalid: stop with one sentence, never train from step 0
silently, never delete them; `--restart_from_scratch=true` is the explicit way to start over."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from test_checkpoint import _file_ckpt, _flip_byte
from test_cli import FAST, TINY_MOE, read_metrics, run_mula

from mula.checkpoint import NoValidCheckpoint, auto_resume_ckpt_path, find_resume_checkpoint, list_checkpoints


def _snapshot(dirpath: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dirpath.iterdir()) if not p.is_symlink()}


def test_all_committed_checkpoints_invalid_is_an_error_and_nothing_is_deleted(tmp_path):
    for step in (2, 4):
        _flip_byte(_file_ckpt(tmp_path, step), 10)
    _file_ckpt(tmp_path, 6, manifest=False)  # an unfinished save on top
    before = _snapshot(tmp_path)
    with pytest.raises(NoValidCheckpoint) as err:
        find_resume_checkpoint(tmp_path)
    message = str(err.value)
    assert message.startswith(f"{tmp_path} has 2 committed checkpoint(s) and none is valid (newest: ")
    assert "step=000000004.ckpt" in message and "corrupted" in message
    assert "--restart_from_scratch=true" in message and "\n" not in message
    assert _snapshot(tmp_path) == before


def test_only_unfinished_saves_start_from_scratch_with_a_warning(tmp_path, caplog):
    """A crash during the very first save committed nothing: restarting from step 0 loses nothing."""
    _file_ckpt(tmp_path, 4, manifest=False)
    with caplog.at_level(logging.WARNING, logger="mula.checkpoint.discovery"):
        assert find_resume_checkpoint(tmp_path) is None
    assert "No complete checkpoint" in caplog.text and "starting from scratch" in caplog.text


def test_restart_from_scratch_only_when_asked_and_a_valid_checkpoint_still_wins(tmp_path, caplog):
    bad = _file_ckpt(tmp_path, 4)
    _flip_byte(bad, 10)

    class Callback:
        def resume_checkpoint_path(self, trainer):
            return find_resume_checkpoint(tmp_path)

    class FakeTrainer:
        callbacks = [Callback()]  # noqa: RUF012

    with pytest.raises(NoValidCheckpoint):
        auto_resume_ckpt_path(FakeTrainer())
    with caplog.at_level(logging.WARNING, logger="mula.checkpoint.discovery"):
        assert auto_resume_ckpt_path(FakeTrainer(), restart_from_scratch=True) is None
    assert "none is valid" in caplog.text and "training from step 0" in caplog.text
    good = _file_ckpt(tmp_path, 2)
    assert auto_resume_ckpt_path(FakeTrainer(), restart_from_scratch=True) == str(good)  # e.g. a requeue
    assert bad.exists()


def test_mula_fit_on_a_run_of_only_corrupted_checkpoints(tmp_path):
    """exit 2 and one sentence, nothing deleted; with --restart_from_scratch=true it trains from step 0."""
    args = ["fit", "-c", str(TINY_MOE), *FAST[4:], "--trainer.max_steps=2", "--trainer.val_check_interval=2",
            "--trainer.log_every_n_steps=1"]  # fmt: skip
    proc = run_mula(args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpts = tmp_path / "runs" / "mula-tiny-moe" / "checkpoints"
    (newest,) = list_checkpoints(ckpts)
    _flip_byte(newest.path, os.path.getsize(newest.path) // 2)
    before = _snapshot(ckpts)

    proc = run_mula([*args, "--trainer.max_steps=4"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mula: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "has 1 committed checkpoint(s) and none is valid" in errors[0] and "corrupted" in errors[0]
    assert "--restart_from_scratch=true" in errors[0]
    assert _snapshot(ckpts) == before
    assert not (tmp_path / "runs" / "mula-tiny-moe" / "version_1").exists()

    proc = run_mula([*args, "--trainer.max_steps=4", "--restart_from_scratch=true"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training from step 0, as --restart_from_scratch=true asks" in proc.stderr
    rows = read_metrics(tmp_path / "runs" / "mula-tiny-moe" / "version_1" / "metrics.csv")
    assert [r["step"] for r in rows if r.get("train/loss")] == ["0", "1", "2", "3"]
    assert [e.step for e in list_checkpoints(ckpts)] == [4, 2]
