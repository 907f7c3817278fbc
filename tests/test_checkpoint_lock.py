"""mula.checkpoint.lock: the run-directory lock (one training run per run directory).

Unit tests of the lock file protocol, and the lock at work: two `mula fit` processes on one run
directory, a stale lock taken over by `mula fit`, and a 2-rank run refused on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_cli import FAST, TINY_MOE, run_mula
from test_fault_tolerance import _config, _env

from callbacks import FaultTolerantCheckpoint
from mula.checkpoint import (
    RunDirLock,
    RunDirLocked,
    list_checkpoints,
    lock_run_dir_before_launch,
    verify_checkpoint,
)
from mula.checkpoint.lock import _JOB_ID_VARS, LOCK_NAME

REPO = Path(__file__).resolve().parents[1]


def _write_lock(run_dir: Path, host: str, pid: int, age_s: float = 0.0, job: str | None = None) -> Path:
    """A lock file as another run would have left it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    beat = time.time() - age_s
    info = {"host": host, "pid": pid, "job": job, "started": beat - 60, "heartbeat": beat, "token": "theirs"}
    path = run_dir / LOCK_NAME
    path.write_text(json.dumps(info))
    return path


def _dead_pid() -> int:
    """The pid of a process of this host that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_acquire_writes_the_holder_and_release_removes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    lock = RunDirLock(tmp_path / "run")
    lock.acquire()
    info = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert info["host"] == socket.gethostname() and info["pid"] == os.getpid() and info["job"] == "4242"
    assert info["heartbeat"] >= info["started"] > time.time() - 60
    lock.acquire()  # idempotent
    assert os.listdir(tmp_path / "run") == [LOCK_NAME]  # the unique name it was created under is gone
    assert pickle.loads(pickle.dumps(lock)).held  # spawn launchers pickle the callbacks holding it
    lock.release()
    lock.release()
    assert os.listdir(tmp_path / "run") == []


def test_a_live_holder_elsewhere_is_refused_with_one_sentence_naming_it(tmp_path):
    path = _write_lock(tmp_path, "node-a17", 31337, age_s=5, job="998877")
    with pytest.raises(RunDirLocked) as err:
        RunDirLock(tmp_path).acquire()
    message = str(err.value)
    assert "\n" not in message and message.count(". ") == 0
    for part in ("is in use by another run", "host node-a17", "pid 31337", "job 998877", "since ", "UTC"):
        assert part in message, message
    assert json.loads(path.read_text())["token"] == "theirs"  # untouched


def test_a_live_process_of_this_host_is_refused(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path, socket.gethostname(), sleeper.pid)
        with pytest.raises(RunDirLocked, match=f"pid {sleeper.pid}"):
            RunDirLock(tmp_path).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("why", ["dead pid on this host", "old heartbeat", "unparsable and old"])
def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, caplog, why):
    if why == "dead pid on this host":
        path = _write_lock(tmp_path, socket.gethostname(), _dead_pid())
        reason = "no longer exists on this host"
    elif why == "old heartbeat":
        path = _write_lock(tmp_path, "node-b03", 12345, age_s=400)
        reason = "no heartbeat for 400 s"
    else:
        path = tmp_path / LOCK_NAME
        path.write_text("half a lock")
        os.utime(path, (time.time() - 400, time.time() - 400))
        reason = "no heartbeat for 400 s"
    lock = RunDirLock(tmp_path, stale_after_s=300)
    with caplog.at_level(logging.WARNING, logger="mula.checkpoint.lock"):
        lock.acquire()
    assert "Broke the stale lock" in caplog.text and reason in caplog.text
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]
    lock.release()


def test_a_fresh_unparsable_lock_counts_as_held(tmp_path):
    (tmp_path / LOCK_NAME).write_text("")  # e.g. written by hand just now
    with pytest.raises(
        RunDirLocked, match=r"in use by another run \(an unreadable lock file, written 0 s ago\)"
    ):
        RunDirLock(tmp_path).acquire()


def test_the_heartbeat_keeps_a_live_lock_fresh(tmp_path, monkeypatch):
    """However slow the host: the holder's thread beats on until its lock is older than stale_after_s, and
    another node judging it at the moment of a beat finds it live, where without the beats it is stale."""
    import mula.checkpoint.lock as lock_module

    holder = RunDirLock(tmp_path, stale_after_s=1.0, heartbeat_s=0.1)
    holder.acquire()
    try:
        started = json.loads((tmp_path / LOCK_NAME).read_text())["heartbeat"]
        beat = started
        while beat <= started + 1.0:  # waits for the beats, not for a time (pytest's timeout bounds it)
            time.sleep(0.05)
            beat = json.loads((tmp_path / LOCK_NAME).read_text())["heartbeat"]
        other = RunDirLock(tmp_path, stale_after_s=1.0, heartbeat_s=0.1)
        other.host = "node-other"  # on another node, only the heartbeat tells
        # the other node's clock stands 0.5 s after the beat it reads: more than stale_after_s since the
        # lock was taken, less since the last beat
        clock = {k: getattr(time, k) for k in dir(time) if not k.startswith("_")}
        monkeypatch.setattr(lock_module, "time", SimpleNamespace(**{**clock, "time": lambda: beat + 0.5}))
        unbeaten = lock_module._read(tmp_path / LOCK_NAME)
        unbeaten.heartbeat = started
        assert "no heartbeat" in other._stale_reason(unbeaten)  # what the lock would be without its beats
        with pytest.raises(RunDirLocked):
            other.acquire()
    finally:
        monkeypatch.undo()
        holder.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_an_earlier_attempt_of_the_same_job_is_waited_for(tmp_path, monkeypatch, caplog):
    """A requeued job (same job id) waits for the old attempt's heartbeat to stop, then takes over;
    a zombie attempt that still beats keeps the lock."""
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    _write_lock(tmp_path, "node-dead", 1, job="777")
    lock = RunDirLock(tmp_path, stale_after_s=1.0, heartbeat_s=0.2)
    with caplog.at_level(logging.WARNING, logger="mula.checkpoint.lock"):
        lock.acquire()
    assert "earlier attempt of this job" in caplog.text and "Broke the stale lock" in caplog.text
    lock.release()

    path = _write_lock(tmp_path, "node-zombie", 2, job="777")
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.1):
            info = json.loads(path.read_text())
            info["heartbeat"] = time.time()
            path.with_suffix(".beat").write_text(json.dumps(info))
            os.replace(path.with_suffix(".beat"), path)  # as RunDirLock.refresh: never half-written

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        with pytest.raises(RunDirLocked, match="node-zombie"):
            RunDirLock(tmp_path, stale_after_s=1.0, heartbeat_s=0.2).acquire()
    finally:
        stop.set()
        thread.join()


def test_breaking_puts_back_a_fresh_lock_a_contender_created_meanwhile(tmp_path):
    """Two runs found the same stale lock; the first replaced it by its own: the second must not remove that."""
    _write_lock(tmp_path, "node-c", 5, age_s=1000)
    stale = json.loads((tmp_path / LOCK_NAME).read_text())
    winner = RunDirLock(tmp_path)
    winner.acquire()  # breaks the stale lock and holds it
    try:
        from mula.checkpoint.lock import LockInfo

        RunDirLock(tmp_path)._break(LockInfo(**stale), "late contender")
        assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == winner.info.token
        assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]
    finally:
        winner.release()


def test_only_rank_zero_of_a_self_launched_run_locks_before_launch(tmp_path):
    calls: list[int] = []

    class Locker:
        def lock_run_dir(self, trainer):
            calls.append(trainer.global_rank)

    def trainer(world_size: int, rank: int, external: bool) -> SimpleNamespace:
        env = SimpleNamespace(creates_processes_externally=external)
        return SimpleNamespace(
            world_size=world_size,
            global_rank=rank,
            strategy=SimpleNamespace(cluster_environment=env),
            callbacks=[object(), Locker()],
        )

    lock_run_dir_before_launch(trainer(1, 0, False))
    lock_run_dir_before_launch(trainer(4, 0, False))  # Lightning starts ranks 1..3 later
    lock_run_dir_before_launch(trainer(4, 0, True))  # torchrun/srun: decided in setup, by a broadcast
    lock_run_dir_before_launch(trainer(4, 2, False))
    assert calls == [0, 0]


def test_checkpoint_setup_refuses_before_removing_temporaries(tmp_path):
    """The temporaries in the checkpoint directory may be the other run's save in progress."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    in_progress = ckpts / ".tmp-step=000000100.ckpt"
    in_progress.write_bytes(b"another run is writing this")
    _write_lock(tmp_path, "node-a17", 31337)
    fake = SimpleNamespace(
        default_root_dir=str(tmp_path),
        is_global_zero=True,
        strategy=SimpleNamespace(barrier=lambda name: None),
    )
    callback = FaultTolerantCheckpoint()
    with pytest.raises(RunDirLocked, match="node-a17"):
        callback.setup(fake, None, "fit")
    assert in_progress.read_bytes() == b"another run is writing this"

    (tmp_path / LOCK_NAME).unlink()  # that run ended
    callback.setup(fake, None, "fit")
    assert not in_progress.exists() and (tmp_path / LOCK_NAME).is_file()
    callback.teardown(fake, None, "fit")
    assert not (tmp_path / LOCK_NAME).exists()
    callback.setup(fake, None, "validate")  # read-only stages take no lock
    assert not (tmp_path / LOCK_NAME).exists()


# ------------------------------------------------------------------------------------------ real processes


def _slow_run(run_dir: Path, steps: int, sleep_s: float) -> list[str]:
    """`mula fit` args for a tiny run of `steps` steps, each slowed down by `sleep_s` (ft_app.FaultInjector)."""
    injector = json.dumps(
        {"class_path": "ft_app.FaultInjector", "init_args": {"step_sleep_s": sleep_s, "module_path": ""}}
    )
    return ["fit", "-c", str(TINY_MOE), *FAST[4:], f"--trainer.max_steps={steps}", "--trainer.val_check_interval=4",
            f"--trainer.default_root_dir={run_dir}", f"--trainer.callbacks+={injector}"]  # fmt: skip


def test_two_mula_fit_on_one_run_directory(tmp_path, monkeypatch):
    """The second run stops with exit 2 and a sentence naming the first, which ends normally with its
    checkpoints intact; a lock left by a dead process is then taken over by the next run."""
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{REPO / 'tests'}")
    for var in _JOB_ID_VARS:  # so that the lock of the dead process below is not one of this job's
        monkeypatch.delenv(var, raising=False)
    run_dir = tmp_path / "runs" / "shared"
    lock_file = run_dir / LOCK_NAME
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    log_path = tmp_path / "first.log"
    with open(log_path, "w") as log:
        first = subprocess.Popen(
            [sys.executable, "-m", "mula.cli", *_slow_run(run_dir, 12, 1.0)],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while not lock_file.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert lock_file.exists(), log_path.read_text()[-3000:]

        second = run_mula(_slow_run(run_dir, 12, 0.0), cwd=tmp_path, timeout=300)
        assert first.poll() is None, "the first run ended before the second was refused: slow it down more"
        assert second.returncode == 2, second.stderr[-3000:]
        errors = [line for line in second.stderr.splitlines() if line.startswith("mula: error:")]
        assert len(errors) == 1, second.stderr[-3000:]
        assert (
            f"host {socket.gethostname()}, pid {first.pid}" in errors[0]
            and "in use by another run" in errors[0]
        )
        assert not (run_dir / "version_1").exists()  # the refused run wrote nothing into the run directory
        assert first.wait(timeout=300) == 0, log_path.read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    entries = list_checkpoints(run_dir / "checkpoints")
    assert [e.step for e in entries] == [12]
    assert verify_checkpoint(entries[0].path) is None
    assert (run_dir / "checkpoints" / "last.ckpt").resolve() == entries[0].path.resolve()
    assert not lock_file.exists()  # released at the end of the run

    _write_lock(run_dir, socket.gethostname(), _dead_pid())  # e.g. a run killed by SIGKILL
    third = run_mula(_slow_run(run_dir, 14, 0.0), cwd=tmp_path, timeout=300)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "Broke the stale lock" in third.stderr and "no longer exists on this host" in third.stderr
    assert [e.step for e in list_checkpoints(run_dir / "checkpoints")][0] == 14
    assert not lock_file.exists()


def test_two_ranks_started_by_a_launcher_both_stop_when_rank_zero_is_refused(tmp_path):
    """Ranks started by torchrun/srun/mpiexec already run when rank 0 finds the run directory locked
    (in FaultTolerantCheckpoint.setup): rank 1 learns it from rank 0 and stops too, instead of waiting
    for rank 0 in a collective; nothing is removed from the checkpoint directory."""
    run_dir = tmp_path / "run"
    in_progress = run_dir / "checkpoints" / ".tmp-step=000000008.ckpt"
    in_progress.parent.mkdir(parents=True)
    in_progress.write_bytes(b"partial")
    _write_lock(run_dir, "node-a17", 31337, job="5150")
    config = _config(run_dir, devices=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):  # what torchrun exports to each worker
        env = {**_env(), "TORCHELASTIC_RUN_ID": "lock-test", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
               "GROUP_RANK": "0"}  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "ft_app.py"), "fit", "--config", str(config)],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode != 0, f"rank {rank}: {out[-3000:]}"
        assert "is in use by another run (host node-a17, pid 31337, job 5150" in out, (
            f"rank {rank}: {out[-3000:]}"
        )
    assert in_progress.read_bytes() == b"partial"
    assert not (run_dir / "record-rank0.jsonl").exists()  # no training step ran
