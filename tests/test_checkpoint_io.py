"""Checkpoint I/O at scale, on 4 CPU ranks with real processes (tests/ft_app.py, XPUMoEStrategy's sharded
checkpoints): asynchronous saves equal to synchronous ones, crash safety of a background write under
SIGKILL and SIGTERM, and a restart that reads each file of the checkpoint once in total.

A background write is made slow deterministically by ft_app's test-only storage writer
(``FT_WRITE_GATE``): it holds the write of a named checkpoint until the test removes a file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from test_fault_tolerance import (
    APP,
    REPO,
    SHARDED,
    _assert_same_as,
    _config,
    _env,
    _flip_byte,
    _metrics,
    _runs,
)

from mula.checkpoint import checkpoint_name, list_checkpoints, read_manifest, temp_path, verify_checkpoint

STEPS, EVERY = 20, 5
RANKS = 4


def _config4(run_dir: Path, async_save: bool, **checkpoint) -> Path:
    """ft_app on 4 ranks, 20 steps, a save every 5 (keep 2), the sharded strategy."""
    path = _config(
        run_dir,
        devices=RANKS,
        strategy=SHARDED,
        checkpoint={"every_n_steps": EVERY, "keep_last": 2, "async_save": async_save, **checkpoint},
    )
    config = json.loads(path.read_text())
    config["trainer"]["max_steps"] = STEPS
    config["trainer"]["val_check_interval"] = 100
    config["trainer"]["num_sanity_val_steps"] = 0
    # one epoch longer than the run: no new data-loader iterator (which draws from the RNG) mid-run, so
    # a run resumed from any step is bitwise the reference, also one that did not save at that step
    config["data"] = {"num_samples": RANKS * 4 * (STEPS + 1)}
    path.write_text(json.dumps(config))
    return path


def _start(config: Path, **env: str) -> subprocess.Popen:
    """The app in a session of its own, so that the test can signal all of its ranks at once."""
    log_path = config.with_suffix(f".{time.monotonic_ns()}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(APP), "fit", "--config", str(config)],
            cwd=REPO,
            env={**_env(), **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proc.log_path = log_path  # type: ignore[attr-defined]
    return proc


def _finish(proc: subprocess.Popen, timeout: float = 400) -> tuple[int, str]:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return rc, proc.log_path.read_text()  # type: ignore[attr-defined]


def _wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        assert proc.poll() is None, (
            f"exited with {proc.returncode} before {what}: {proc.log_path.read_text()[-3000:]}"
        )
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"{what} did not happen in {timeout}s")


def _gate(tmp_path: Path, step: int) -> tuple[Path, Path]:
    """A gate directory holding the background write of step `step`'s checkpoint; its block file."""
    gate = tmp_path / "gate"
    gate.mkdir()
    block = gate / f"block-{temp_path(Path(checkpoint_name(step))).name}"
    block.write_text("")
    return gate, block


@pytest.fixture(scope="module")
def sync_reference(tmp_path_factory) -> list[dict]:
    """20 steps on 4 ranks, synchronous saves every 5 steps: rank 0's per-step losses and weights."""
    run_dir = tmp_path_factory.mktemp("sync") / "run"
    rc, log = _finish(_start(_config4(run_dir, async_save=False)))
    assert rc == 0, log[-3000:]
    (rows,) = _runs(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return rows


@pytest.fixture(scope="module")
def async_run(tmp_path_factory) -> tuple[Path, list[dict], str]:
    run_dir = tmp_path_factory.mktemp("async") / "run"
    rc, log = _finish(_start(_config4(run_dir, async_save=True)))
    assert rc == 0, log[-3000:]
    (rows,) = _runs(run_dir)
    return run_dir, rows, log


def test_async_saves_give_the_weights_of_synchronous_saves(sync_reference, async_run):
    run_dir, rows, _ = async_run
    _assert_same_as(rows, sync_reference)  # every step's loss, batch and weights, bitwise
    kept = list_checkpoints(run_dir / "checkpoints")
    assert [e.step for e in kept] == [20, 15]
    assert all(verify_checkpoint(e.path) is None for e in kept)
    saves = [r for r in _metrics(run_dir) if r.get("checkpoint/save_total_s")]
    assert sorted({int(r["step"]) for r in saves}) == [5, 10, 15, 20]
    for row in saves:
        assert 0 < float(row["checkpoint/save_blocking_s"]) <= float(row["checkpoint/save_total_s"])
        assert float(row["checkpoint/bytes"]) > 0
    assert float(saves[-1]["checkpoint/bytes"]) == read_manifest(kept[0].path).total_bytes


def test_a_restart_reads_each_file_once_and_refuses_a_corrupted_shard_on_every_rank(
    sync_reference, async_run, tmp_path
):
    """verify: checksum on 4 ranks: the newest checkpoint's corrupted shard is found (the same sentence,
    on every rank) and the previous one resumed from; each file was hashed by one rank, once."""
    source, _, _ = async_run
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir, symlinks=True)
    ckpts = run_dir / "checkpoints"
    newest, previous = (e.path for e in list_checkpoints(ckpts))
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    _flip_byte(shard)
    for record in run_dir.glob("record-rank*.jsonl"):
        record.unlink()
    hashed = tmp_path / "hashed.jsonl"
    config = _config4(run_dir, async_save=True, every_n_steps=100, save_on_train_end=False)
    rc, log = _finish(_start(config, FT_HASH_LOG=str(hashed), FT_SMALL_CHECKPOINT_BYTES="0"))
    assert rc == 0, log[-3000:]

    refusal = f"Skipping checkpoint {newest}: {shard} does not match its sha256 checksum (corrupted)."
    assert log.count(refusal) == RANKS, log[-3000:]
    (resumed,) = _runs(run_dir)
    assert resumed[0]["step"] == 16 and resumed[-1]["step"] == STEPS
    _assert_same_as(resumed, sync_reference)

    lines = [json.loads(line) for line in hashed.read_text().splitlines()]
    reads = Counter(line["path"] for line in lines)
    assert max(reads.values()) == 1, reads  # no file hashed twice, by any process
    manifest = read_manifest(previous)
    of_previous = [line for line in lines if Path(line["path"]).parent == previous]
    assert sum(line["bytes"] for line in of_previous) == manifest.total_bytes  # its size once, not 4 times
    assert len({line["pid"] for line in of_previous}) > 1  # divided among the ranks
    assert all(Path(line["path"]).parent in (newest, previous) for line in lines)


def test_sigkill_during_a_background_write_resumes_from_the_previous_checkpoint(sync_reference, tmp_path):
    run_dir = tmp_path / "run"
    gate, block = _gate(tmp_path, 10)
    config = _config4(run_dir, async_save=True)
    proc = _start(config, FT_WRITE_GATE=str(gate))
    _wait_for(lambda: any(gate.glob("started-*")), proc, "the background write of step 10")
    os.killpg(proc.pid, signal.SIGKILL)
    _finish(proc)
    ckpts = run_dir / "checkpoints"
    partial = temp_path(ckpts / checkpoint_name(10))
    assert partial.is_dir() and not (ckpts / checkpoint_name(10)).exists()
    assert [e.step for e in list_checkpoints(ckpts)] == [5] and verify_checkpoint(
        ckpts / checkpoint_name(5)
    ) is None

    block.unlink()
    rc, log = _finish(_start(config))
    assert rc == 0, log[-3000:]
    assert not partial.exists()  # removed at the start (setup), before the resumed run saves step 10 again
    assert f"Auto-resuming from {ckpts / checkpoint_name(5)}" in log
    resumed = _runs(run_dir)[-1]
    assert resumed[0]["step"] == 6 and resumed[-1]["step"] == STEPS
    _assert_same_as(resumed, sync_reference)


def test_sigterm_during_a_background_write_waits_for_it_exits_75_and_resumes_exactly(
    sync_reference, tmp_path
):
    run_dir = tmp_path / "run"
    gate, block = _gate(tmp_path, 10)
    config = _config4(run_dir, async_save=True)
    proc = _start(config, FT_WRITE_GATE=str(gate))
    _wait_for(lambda: any(gate.glob("started-*")), proc, "the background write of step 10")
    proc.send_signal(signal.SIGTERM)  # rank 0 only: the ranks agree at the next step boundary
    waiting = "Waiting for the checkpoint of step 10 being written in the background."
    _wait_for(lambda: waiting in proc.log_path.read_text(), proc, "the preemption waiting for the write")
    assert not (run_dir / "checkpoints" / checkpoint_name(10)).exists()
    block.unlink()
    rc, log = _finish(proc)
    assert rc == 75, log[-3000:]
    ckpts = run_dir / "checkpoints"
    steps = [e.step for e in list_checkpoints(ckpts)]
    assert 10 in steps and all(verify_checkpoint(e.path) is None for e in list_checkpoints(ckpts))
    preempted = steps[0]
    assert preempted > 10

    rc, log = _finish(_start(config))
    assert rc == 0, log[-3000:]
    resumed = _runs(run_dir)[-1]
    assert resumed[0]["step"] == preempted + 1 and resumed[-1]["step"] == STEPS
    _assert_same_as(resumed, sync_reference)
