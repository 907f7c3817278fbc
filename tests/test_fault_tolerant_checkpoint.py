"""FaultTolerantCheckpoint: crash-safe saves, pruning and exact auto-resume with directory (sharded)
checkpoints through a strategy's save_checkpoint; RNG capture, callback settings, and the
mula-resilient wrapper. The checkpoint files themselves are tested in test_checkpoint.py."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import SingleDeviceStrategy

from callbacks import (
    AnomalyGuard,
    FaultTolerantCheckpoint,
    HangWatchdog,
    PreemptionHandler,
    StragglerDetector,
)
from callbacks.anomaly import robust_zscore
from callbacks.rng_state import capture_rng_state, restore_rng_state
from mula.checkpoint import (
    auto_resume_ckpt_path,
    checkpoint_name,
    list_checkpoints,
    read_manifest,
    verify_checkpoint,
)

sys.path.insert(0, str(Path(__file__).parent))
from ft_app import StepRecorder, TinyData, TinyLM

REPO = Path(__file__).resolve().parents[1]


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------ RNG, z-score


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    torch.save({"rng": capture_rng_state(torch.device("cpu"))}, tmp_path / "rng.pt")

    def draw():
        return random.random(), float(np.random.rand()), float(np.random.randn()), torch.rand(3).tolist()

    first = draw()
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"], torch.device("cpu"))
    assert draw() == first


def test_robust_zscore():
    history = [3.0, 3.1, 2.9, 3.05, 2.95, 3.0, 3.02]
    assert abs(robust_zscore(3.0, history)) < 1
    assert robust_zscore(6.0, history) > 20
    assert robust_zscore(3.0 * 1.0005, [3.0] * 10) < 1  # flat history: the floor keeps tiny noise small


def test_preemption_handler_records_configured_signals_and_restores_previous_handlers():
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import LightningEnvironment

    handler = PreemptionHandler(signals=["USR1", "SIGTERM"])
    trainer = SimpleNamespace(
        _accelerator_connector=SimpleNamespace(cluster_environment=LightningEnvironment())
    )
    before = signal.getsignal(signal.SIGUSR1)
    handler._install(trainer)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # a real signal; the handler only records it
        time.sleep(0.01)
        assert handler.received == signal.SIGUSR1
    finally:
        handler._uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before


@pytest.mark.parametrize(("every_n_steps", "agreed"), [(None, [3, 6]), (2, [2, 4, 6])])
def test_preemption_handler_agrees_on_logging_steps_only(monkeypatch, every_n_steps, agreed):
    """The ranks' agreement on a signal reads a flag on the host: on logging steps (or every_n_steps)."""
    from types import SimpleNamespace

    from callbacks import _dist

    asked = []
    monkeypatch.setattr(_dist, "any_rank", lambda flag, device: asked.append(trainer.global_step) or False)
    handler = PreemptionHandler(every_n_steps=every_n_steps)
    trainer = SimpleNamespace(global_step=0, log_every_n_steps=3, strategy=SimpleNamespace(root_device="cpu"))
    handler._steps.start(trainer)
    for step in range(1, 7):
        trainer.global_step = step
        handler.on_train_batch_end(trainer, None, None, None, step)
    assert asked == agreed


@pytest.mark.parametrize(
    "factory",
    [
        lambda: FaultTolerantCheckpoint(every_n_steps=0),
        lambda: PreemptionHandler(every_n_steps=0),
        lambda: FaultTolerantCheckpoint(keep_last=0),
        lambda: FaultTolerantCheckpoint(checksum="md5"),
        lambda: PreemptionHandler(signals=["SIGNOPE"]),
        lambda: AnomalyGuard(on_max_consecutive="panic"),
        lambda: AnomalyGuard(window=10, min_history=20),
        lambda: HangWatchdog(timeout_s=0),
        lambda: StragglerDetector(threshold=0.9),
    ],
)
def test_bad_settings_are_rejected_with_a_clear_error(factory):
    with pytest.raises(ValueError):
        factory()


# ------------------------------------------------------------------------------------------ sharded directories


class DirectoryCheckpointStrategy(SingleDeviceStrategy):
    """Saves like sharded strategies do: a DCP directory plus Lightning's metadata file."""

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        path = Path(filepath)
        path.mkdir(parents=True, exist_ok=True)
        dcp.save({"state_dict": checkpoint.pop("state_dict")}, checkpoint_id=path)
        torch.save(checkpoint, path / "meta.pt")

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        path = Path(checkpoint_path)
        meta = torch.load(path / "meta.pt", weights_only=False)
        state = {"state_dict": self.lightning_module.state_dict()}
        dcp.load(state, checkpoint_id=path)
        meta["state_dict"] = state["state_dict"]
        return meta


def _fit(root: Path, max_steps: int, ckpt_cb: FaultTolerantCheckpoint, ckpt_path=None) -> None:
    pl.seed_everything(1234, verbose=False)
    trainer = pl.Trainer(
        strategy=DirectoryCheckpointStrategy(device=torch.device("cpu")),
        max_steps=max_steps,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[ckpt_cb, StepRecorder()],
    )
    if ckpt_path == "auto":
        ckpt_path = auto_resume_ckpt_path(trainer)
    trainer.fit(TinyLM(), TinyData(), ckpt_path=ckpt_path)


def test_directory_checkpoints_are_atomic_verified_pruned_and_resume_exactly(tmp_path, caplog):
    torch.set_num_threads(1)
    run = tmp_path / "run"
    _fit(run, 6, FaultTolerantCheckpoint(every_n_steps=2, keep_last=2))
    reference = {r["step"]: r for r in map(json.loads, (run / "record-rank0.jsonl").read_text().splitlines())}
    ckpts = run / "checkpoints"
    assert [e.step for e in list_checkpoints(ckpts)] == [6, 4]  # step 2 pruned
    newest = ckpts / checkpoint_name(6)
    assert newest.is_dir() and read_manifest(newest).kind == "dir" and verify_checkpoint(newest) is None
    assert not list(ckpts.glob(".tmp-*"))
    assert (ckpts / "last.ckpt").resolve() == newest.resolve()

    shard = next(newest.glob("*.distcp"))
    _flip_byte(shard, shard.stat().st_size // 2)
    with caplog.at_level(logging.WARNING, logger="mula.checkpoint.discovery"):
        _fit(run, 6, FaultTolerantCheckpoint(every_n_steps=2, keep_last=2), ckpt_path="auto")
    assert "step=000000006.ckpt" in caplog.text and "corrupted" in caplog.text
    rows = [json.loads(line) for line in (run / "record-rank0.jsonl").read_text().splitlines()]
    resumed = rows[6:]  # the same file holds the reference run's six rows, then the resumed run's
    assert [r["step"] for r in resumed] == [5, 6]
    for row in resumed:
        ref = reference[row["step"]]
        assert (row["loss"], row["params"], row["batch"]) == (ref["loss"], ref["params"], ref["batch"])
    assert verify_checkpoint(newest) is None  # re-saved at step 6, replacing the damaged one


def test_time_based_checkpoints(tmp_path):
    run = tmp_path / "run"
    _fit(run, 3, FaultTolerantCheckpoint(every_n_steps=None, every_n_minutes=1e-9, keep_last=5))
    manifests = [read_manifest(e.path) for e in list_checkpoints(run / "checkpoints")]
    assert [(m.step, m.reason) for m in manifests] == [(3, "timer"), (2, "timer"), (1, "timer")]


# ------------------------------------------------------------------------------------------ mula-resilient

SCRIPT = str(REPO / "scripts" / "mula-resilient")


def test_resilient_wrapper_restarts_until_success_or_gives_up():
    ok = subprocess.run(
        [
            SCRIPT,
            "-n",
            "5",
            "-d",
            "0",
            "--",
            "bash",
            "-c",
            "echo $MULA_RESTART_COUNT; [ $MULA_RESTART_COUNT -ge 2 ]",
        ],
        check=False,
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and ok.stdout.split() == ["0", "1", "2"]
    fail = subprocess.run(
        [SCRIPT, "-n", "2", "-d", "0", "--", "bash", "-c", "exit 3"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert fail.returncode == 3 and "giving up after 2 restart(s)" in fail.stderr
    final = subprocess.run(
        [SCRIPT, "-n", "5", "-d", "0", "--", "bash", "-c", "exit 65"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert final.returncode == 65 and final.stderr.count("\n") == 1 and "not restarting" in final.stderr
    bad = subprocess.run([SCRIPT, "-n", "x", "--", "true"], check=False, capture_output=True, text=True)
    assert bad.returncode == 2 and "-n must be" in bad.stderr


def test_resilient_wrapper_forwards_sigterm_and_does_not_restart(tmp_path):
    ready = tmp_path / "ready"
    child = f'trap "kill %1; exit 75" TERM; sleep 30 >/dev/null 2>&1 & touch {ready}; wait'
    proc = subprocess.Popen(
        [SCRIPT, "-n", "5", "-d", "0", "--", "bash", "-c", child], stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 75
    assert "not restarting" in proc.stderr.read()
