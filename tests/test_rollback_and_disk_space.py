"""The rollback rule (no checkpoint inside an anomaly streak, the pre-streak one protected until the run is
healthy) and the disk-space rule (check before each save, partial files removed when a save fails),
with in-process single-rank runs. The multi-rank versions are in test_fault_tolerance.py."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Checkpoint

from callbacks import AnomalyGuard, FaultTolerantCheckpoint, _disk_space
from callbacks.fault_tolerant_checkpoint import CheckpointSaveError
from mula.checkpoint import list_checkpoints, read_manifest, verify_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from ft_app import FaultInjector, StepRecorder, TinyData, TinyLM

FT_LOG = "callbacks.fault_tolerant_checkpoint"


class CheckpointLister(Checkpoint):
    """After every optimizer step: the steps of the checkpoints on disk. A ``Checkpoint`` so that Lightning
    runs it with the checkpoint callbacks, last, in list order: after FaultTolerantCheckpoint's save."""

    def __init__(self) -> None:
        self.seen: dict[int, list[int]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        dirpath = Path(trainer.default_root_dir) / "checkpoints"
        self.seen[trainer.global_step] = [e.step for e in list_checkpoints(dirpath)]


def _fit(root: Path, max_steps: int, callbacks: list[pl.Callback], ckpt_path: str | None = None) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(1234, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )
    trainer.fit(TinyLM(), TinyData(num_samples=96), ckpt_path=ckpt_path)


def _rows(root: Path) -> dict[int, dict]:
    lines = (root / "record-rank0.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


# ------------------------------------------------------------------------------------------ the rollback rule


def test_a_streak_longer_than_keep_last_rolls_back_to_the_checkpoint_from_before_it(tmp_path):
    """NaNs at steps 6-9 with a checkpoint every 3 steps and keep_last=2: saves at 6 and 9 would have
    pruned step 3 and made the rollback land inside the streak."""
    run = tmp_path / "run"
    lister = CheckpointLister()
    guard = AnomalyGuard(zscore_threshold=None, max_consecutive=4, max_rollbacks=1, healthy_steps=4)
    callbacks = [
        guard,
        FaultTolerantCheckpoint(every_n_steps=3, keep_last=2),
        lister,
        StepRecorder(),
        FaultInjector(nan_steps=[6, 7, 8, 9]),
    ]
    with pytest.warns(UserWarning, match="rolled back") as warned:
        _fit(run, 16, callbacks)
    rollback = next(str(w.message) for w in warned if "rolled back" in str(w.message))
    assert "step=000000003.ckpt" in rollback
    rows = _rows(run)
    assert (
        rows[9]["params"] == rows[3]["params"] != rows[8]["params"]
    )  # back before the streak (and step 4-5)
    assert rows[9]["rollbacks"] == 1 and rows[10]["params"] != rows[9]["params"]

    seen = lister.seen
    assert all(not set(steps) & {6, 7, 8, 9} for steps in seen.values())  # no checkpoint inside the streak
    assert seen[9] == [3]
    assert seen[10] == [10, 3]  # the save due at 9, deferred to the first accepted step after the rollback
    assert seen[12] == [12, 10, 3]  # step 3 kept beyond keep_last: not healthy yet (3 accepted steps)
    assert seen[15] == [15, 12]  # healthy since step 13 (4 accepted steps): back to keep_last
    assert guard.protected_step() is None


def test_guard_blocks_saves_until_an_accepted_step_and_protects_until_healthy():
    guard = AnomalyGuard(healthy_steps=2)
    assert not guard.blocks_checkpoint() and guard.protected_step() is None
    guard.streak_start, guard.good_steps = 7, 0  # as after the first anomalous step following step 7
    assert guard.blocks_checkpoint() and guard.protected_step() == 7
    guard.good_steps = 1
    assert not guard.blocks_checkpoint() and guard.protected_step() == 7
    restored = AnomalyGuard(healthy_steps=2)
    restored.load_state_dict(guard.state_dict())  # a resumed run keeps protecting the same checkpoint
    assert restored.protected_step() == 7 and restored.good_steps == 1


@pytest.mark.parametrize(
    "factory",
    [lambda: AnomalyGuard(healthy_steps=0), lambda: FaultTolerantCheckpoint(on_save_error="ignore")],
)
def test_bad_settings_are_rejected(factory):
    with pytest.raises(ValueError):
        factory()


# ------------------------------------------------------------------------------------------ disk space


@pytest.fixture
def checkpoint_bytes(tmp_path_factory) -> int:
    """The size of one TinyLM checkpoint of this test's runs (measured once)."""
    run = tmp_path_factory.mktemp("measure") / "run"
    _fit(run, 1, [FaultTolerantCheckpoint(every_n_steps=1, save_on_train_end=False)])
    return read_manifest(list_checkpoints(run / "checkpoints")[0].path).total_bytes


@pytest.fixture
def small_filesystem(tmp_path, monkeypatch):
    """``make(size)``: a directory on a filesystem of ``size`` bytes -- a tmpfs mount where this process may
    mount one (root), else the same limit simulated: free space from the bytes in it, and checkpoint
    writes that would exceed it written halfway and failed with ENOSPC."""
    mounted: list[Path] = []

    def make(size: int) -> Path:
        path = tmp_path / "small"
        path.mkdir()
        try:
            mount = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                capture_output=True,
                check=False,
            ).returncode
        except OSError:  # no mount command
            mount = -1
        if mount == 0:
            mounted.append(path)
            return path
        used = lambda: sum(f.lstat().st_size for f in path.rglob("*") if not f.is_dir())  # noqa: E731
        monkeypatch.setattr(_disk_space, "free_bytes", lambda d: max(0, size - used()))
        original = TorchCheckpointIO.save_checkpoint

        def save(self, checkpoint, filepath, storage_options=None):
            original(self, checkpoint, filepath, storage_options)
            if used() > size:
                data = Path(filepath).read_bytes()
                Path(filepath).write_bytes(data[: len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", save)
        return path

    yield make
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _room_for(checkpoint_bytes: int, n: float) -> int:
    """A filesystem size where n checkpoints (with their manifests) fit but not one more."""
    return int(n * (checkpoint_bytes + 8192))


def _steps(dirpath: Path) -> list[int]:
    entries = list_checkpoints(dirpath)
    assert all(verify_checkpoint(e.path) is None for e in entries)
    return [e.step for e in entries]


def test_a_save_that_cannot_fit_is_refused_before_writing_and_training_goes_on(
    small_filesystem, checkpoint_bytes, tmp_path, caplog
):
    needed = _disk_space.needed_bytes(checkpoint_bytes)
    dirpath = small_filesystem(needed + _room_for(checkpoint_bytes, 1.5))  # the check passes twice
    run = tmp_path / "run"
    ckpt = FaultTolerantCheckpoint(
        dirpath=str(dirpath), every_n_steps=1, keep_last=3, save_on_train_end=False
    )
    with caplog.at_level(logging.WARNING, logger=FT_LOG):
        _fit(run, 4, [ckpt, StepRecorder()])
    assert max(_rows(run)) == 4  # training went on
    assert _steps(dirpath) == [2, 1]
    assert not [p for p in dirpath.iterdir() if p.name.startswith(".tmp-")]
    assert "is short of space" in caplog.text  # the startup warning: keep_last=3 cannot fit
    assert f"Checkpoint of step 3 not saved: {dirpath} has" in caplog.text
    assert "free some space or lower keep_last" in caplog.text and "Training continues" in caplog.text


@pytest.mark.parametrize("on_save_error", ["skip", "raise"])
def test_enospc_while_writing_removes_the_partial_checkpoint(
    small_filesystem, checkpoint_bytes, tmp_path, monkeypatch, caplog, on_save_error
):
    dirpath = small_filesystem(_room_for(checkpoint_bytes, 2.5))
    monkeypatch.setattr(_disk_space, "space_problem", lambda d, b: None)  # as if the size check were wrong
    run = tmp_path / "run"
    ckpt = FaultTolerantCheckpoint(
        dirpath=str(dirpath),
        every_n_steps=1,
        keep_last=2,
        save_on_train_end=False,
        on_save_error=on_save_error,
    )
    if on_save_error == "raise":
        with pytest.raises(CheckpointSaveError, match=r"step 3 not saved: rank 0: OSError: \[Errno 28\]"):
            _fit(run, 4, [ckpt, StepRecorder()])
        assert max(_rows(run)) == 3
    else:
        with caplog.at_level(logging.ERROR, logger=FT_LOG):
            _fit(run, 4, [ckpt, StepRecorder()])
        assert max(_rows(run)) == 4
        assert "Checkpoint of step 3 not saved: rank 0: OSError: [Errno 28]" in caplog.text
        assert "Checkpoint of step 4 not saved" in caplog.text
    assert _steps(dirpath) == [2, 1]  # the earlier checkpoints are intact
    assert sorted(p.name for p in dirpath.iterdir()) == sorted(
        [f"step=00000000{s}.ckpt{suffix}" for s in (1, 2) for suffix in ("", ".manifest.json")]
        + ["last.ckpt"]
    )


def test_startup_warns_when_keep_last_plus_one_checkpoints_do_not_fit(tmp_path, monkeypatch, caplog):
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=100_000))
    with caplog.at_level(logging.WARNING, logger=FT_LOG):
        _fit(tmp_path / "run", 1, [FaultTolerantCheckpoint(every_n_steps=None, save_on_train_end=False)])
    assert "is short of space: 0.1 MiB free" in caplog.text and "keep_last=3" in caplog.text


def test_no_startup_warning_with_room(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=FT_LOG):
        _fit(tmp_path / "run", 1, [FaultTolerantCheckpoint(every_n_steps=None, save_on_train_end=False)])
    assert "short of space" not in caplog.text
