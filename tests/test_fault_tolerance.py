"""End-to-end fault tolerance with real processes and real signals (tests/ft_app.py is the trainer).

Nothing here mocks a mechanism: processes are SIGKILLed and SIGTERMed from outside, faults are
injected into the model's output (NaN, spikes) or as a sleep (stall, straggler), and the
callbacks in ``callbacks/`` must detect and handle them. Runs are shared between assertions to
keep the file around a minute on 2 cores.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mula.checkpoint import list_checkpoints, read_manifest, verify_checkpoint

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "tests" / "ft_app.py"
MAX_STEPS = 14


# Sharded: the EP strategy (expert_parallel_size 1 for this expert-less model) with its sharded optimizer
# writes torch.distributed.checkpoint directories, loads them in place, and wraps its own optimizer.
SHARDED = {
    "class_path": "strategies.XPUMoEStrategy",
    "init_args": {"expert_parallel_size": 1},
}


def _config(
    run_dir: Path,
    devices: int = 1,
    injector: dict | None = None,
    watchdog: dict | None = None,
    anomaly: dict | None = None,
    strategy: dict | str = "ddp",
    checkpoint: dict | None = None,
) -> Path:
    """The one training configuration every run here shares (injector and watchdog aside)."""
    callbacks = [
        {"class_path": "callbacks.PreemptionHandler"},
        {
            "class_path": "callbacks.AnomalyGuard",
            "init_args": {
                "min_history": 3,
                "window": 20,
                "max_consecutive": 3,
                "max_rollbacks": 1,
                **(anomaly or {}),
            },
        },
        {"class_path": "callbacks.HangWatchdog", "init_args": watchdog or {"timeout_s": 300}},
        {"class_path": "callbacks.StragglerDetector", "init_args": {"every_n_steps": 5, "threshold": 1.5}},
        {
            "class_path": "callbacks.FaultTolerantCheckpoint",
            "init_args": {"every_n_steps": 4, "keep_last": 3, **(checkpoint or {})},
        },
        {"class_path": "ft_app.StepRecorder"},
    ]
    if injector:
        callbacks.append({"class_path": "ft_app.FaultInjector", "init_args": injector})
    trainer = {
        "accelerator": "cpu",
        "devices": devices,
        "max_steps": MAX_STEPS,
        "default_root_dir": str(run_dir),
        "logger": {
            "class_path": "mula.training.csv_logger.CSVLogger",
            "init_args": {"save_dir": str(run_dir)},
        },
        "log_every_n_steps": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "val_check_interval": 5,
        "check_val_every_n_epoch": None,
        "num_sanity_val_steps": 1,
        "use_distributed_sampler": False,
        "callbacks": callbacks,
    }
    if devices > 1:
        trainer["strategy"] = strategy
    path = run_dir.with_suffix(".yaml")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"trainer": trainer}))  # JSON is YAML
    return path


def _env() -> dict:
    env = dict(os.environ)
    env.update(PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _start(config: Path) -> subprocess.Popen:
    log_path = config.with_suffix(f".{time.monotonic_ns()}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(APP), "fit", "--config", str(config)],
            cwd=REPO,
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    proc.log_path = log_path  # type: ignore[attr-defined]
    return proc


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return rc, proc.log_path.read_text()  # type: ignore[attr-defined]


def _run(config: Path, timeout: float = 240) -> tuple[int, str]:
    return _finish(_start(config), timeout)


def _rows(run_dir: Path, rank: int = 0) -> list[dict]:
    path = run_dir / f"record-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _runs(run_dir: Path, rank: int = 0) -> list[list[dict]]:
    """Rows grouped by process, in order."""
    groups: list[list[dict]] = []
    for row in _rows(run_dir, rank):
        if not groups or groups[-1][0]["pid"] != row["pid"]:
            groups.append([])
        groups[-1].append(row)
    return groups


def _wait_for_step(
    run_dir: Path, step: int, proc: subprocess.Popen, rank: int = 0, timeout: float = 180
) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = _rows(run_dir, rank)
        if rows and rows[-1]["step"] >= step:
            return rows[-1]
        assert proc.poll() is None, f"training exited early with code {proc.returncode}"
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def _assert_same_as(rows: list[dict], reference: list[dict], keys=("loss", "params", "batch")) -> None:
    ref = {r["step"]: r for r in reference}
    assert rows, "no steps recorded"
    for row in rows:
        expected = ref[row["step"]]
        assert {k: row[k] for k in keys} == {k: expected[k] for k in keys}, f"step {row['step']} differs"


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _metrics(run_dir: Path) -> list[dict]:
    rows: list[dict] = []
    for path in sorted(run_dir.glob("lightning_logs/version_*/metrics.csv")):
        with open(path) as f:
            rows += list(csv.DictReader(f))
    return rows


# Injections of the two-rank reference run (sharded strategy): a NaN at step 3 and a spike at step 7, both
# on rank 1 only; rank 1 is also made slow so that the straggler detector has something to find.
ANOMALIES = {"nan_steps": [3], "spike_steps": [7], "ranks": [1], "slow_rank": 1, "slow_s": 0.15}


@pytest.fixture(scope="module")
def single_reference(tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("ref1") / "run"
    rc, log = _run(_config(run_dir))
    assert rc == 0, log[-3000:]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
    return rows


@pytest.fixture(scope="module")
def two_rank_reference(tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("ref2") / "run"
    rc, log = _run(_config(run_dir, devices=2, injector=ANOMALIES, strategy=SHARDED))
    assert rc == 0, log[-3000:]
    assert read_manifest(list_checkpoints(run_dir / "checkpoints")[0].path).kind == "dir"
    return run_dir, log


def test_sigkill_then_same_command_resumes_exactly_also_past_a_corrupted_checkpoint(
    single_reference, tmp_path
):
    run_dir = tmp_path / "run"
    config = _config(run_dir, injector={"step_sleep_s": 0.1})
    proc = _start(config)
    _wait_for_step(run_dir, 9, proc)  # checkpoints at steps 4 and 8 exist
    proc.send_signal(signal.SIGKILL)
    rc, _ = _finish(proc)
    assert rc == -signal.SIGKILL
    valid = [e for e in list_checkpoints(run_dir / "checkpoints") if verify_checkpoint(e.path) is None]
    assert len(valid) >= 2
    newest, previous = valid[0], valid[1]
    twin = tmp_path / "twin"
    shutil.copytree(run_dir, twin)

    assert (run_dir / "mula.lock").exists()  # the killed run could not release its run-directory lock
    rc, log = _run(config)  # the same command, no flag
    assert rc == 0, log[-3000:]
    assert f"Auto-resuming from {newest.path}" in log
    assert "Broke the stale lock" in log and "no longer exists on this host" in log
    resumed = _runs(run_dir)[-1]
    assert resumed[0]["step"] == newest.step + 1 and resumed[-1]["step"] == MAX_STEPS
    _assert_same_as(resumed, single_reference)

    # An explicit --ckpt_path (step 8 here) wins over the newest checkpoint (now step 14).
    proc = subprocess.run(
        [sys.executable, str(APP), "fit", "--config", str(config), f"--ckpt_path={newest.path}"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Auto-resuming" not in proc.stdout + proc.stderr
    resumed = _runs(run_dir)[-1]
    assert resumed[0]["step"] == newest.step + 1 and resumed[-1]["step"] == MAX_STEPS
    _assert_same_as(resumed, single_reference)

    # The newest checkpoint damaged after the fact: detected through its manifest, the previous one is used.
    twin_config = _config(twin, injector={"step_sleep_s": 0.1})
    _flip_byte(twin / "checkpoints" / newest.path.name)
    rc, log = _run(twin_config)
    assert rc == 0, log[-3000:]
    assert "corrupted" in log and f"Auto-resuming from {twin / 'checkpoints' / previous.path.name}" in log
    resumed = _runs(twin)[-1]
    assert resumed[0]["step"] == previous.step + 1 and resumed[-1]["step"] == MAX_STEPS
    _assert_same_as(resumed, single_reference)


def test_nan_and_spike_are_skipped_on_every_rank_and_counted(two_rank_reference):
    run_dir, log = two_rank_reference
    per_rank = [_rows(run_dir, rank) for rank in (0, 1)]
    for rows in per_rank:
        params = {r["step"]: r["params"] for r in rows}
        assert params[3] == params[2] and params[7] == params[6]  # the update was skipped
        assert params[4] != params[3] and params[8] != params[7] and params[2] != params[1]
        assert [r["skipped"] for r in rows] == [0, 0] + [1] * 4 + [2] * 8
    assert [r["params"] for r in per_rank[0]] == [r["params"] for r in per_rank[1]]  # ranks stayed in sync
    assert "Skipping optimizer step 3 on all ranks: non-finite loss or gradient" in log
    assert "Skipping optimizer step 7 on all ranks: loss spike" in log
    logged = [float(r["ft/skipped_steps"]) for r in _metrics(run_dir) if r.get("ft/skipped_steps")]
    assert logged and logged[-1] == 2.0

    # Straggler detection on the same run: rank 1 sleeps 0.15 s per step.
    report = per_rank[0][-1]["straggler"]
    assert report["slowest_rank"] == 1 and report["ratio"] > 1.5
    assert f"rank 1 on host {report['host']}" in log
    assert any(r.get("ft/straggler_ratio") for r in _metrics(run_dir))


def test_sigterm_on_one_rank_checkpoints_every_rank_exits_75_and_resumes_exactly(
    two_rank_reference, tmp_path
):
    """Sharded strategy: the preemption checkpoint is a DCP directory; resume reloads it in place."""
    reference_dir, _ = two_rank_reference
    run_dir = tmp_path / "run"
    config = _config(run_dir, devices=2, injector={**ANOMALIES, "step_sleep_s": 0.1}, strategy=SHARDED)
    proc = _start(config)
    row = _wait_for_step(run_dir, 8, proc, rank=1)
    os.kill(row["pid"], signal.SIGTERM)  # only rank 1 (a child process) is told
    rc, log = _finish(proc)
    assert rc == 75, log[-3000:]
    assert not (run_dir / "mula.lock").exists()  # released on the preemption exit
    newest = list_checkpoints(run_dir / "checkpoints")[0]
    manifest = read_manifest(newest.path)
    assert (
        manifest.reason == "preemption" and manifest.kind == "dir" and verify_checkpoint(newest.path) is None
    )
    assert "(on another rank): checkpointing step" in log  # rank 0 learnt it through the agreement
    assert [int(r["step"]) for r in _metrics(run_dir) if r.get("train/loss")] == list(range(manifest.step))
    for rank in (0, 1):
        assert _rows(run_dir, rank)[-1]["step"] == manifest.step - 1  # both stopped at the same boundary

    rc, log = _run(config)
    assert rc == 0, log[-3000:]
    for rank in (0, 1):
        resumed = _runs(run_dir, rank)[-1]
        assert resumed[0]["step"] == manifest.step + 1 and resumed[-1]["step"] == MAX_STEPS
        _assert_same_as(resumed, _rows(reference_dir, rank), keys=("loss", "params", "batch", "skipped"))


def test_preemption_exit_75_keeps_the_last_step_in_metrics_csv(tmp_path):
    """The step checkpointed on preemption is logged too: its metrics reach metrics.csv before exit 75."""
    run_dir = tmp_path / "run"
    proc = _start(_config(run_dir, injector={"step_sleep_s": 0.1}))
    _wait_for_step(run_dir, 5, proc)
    proc.send_signal(signal.SIGTERM)
    rc, log = _finish(proc)
    assert rc == 75, log[-3000:]
    manifest = read_manifest(list_checkpoints(run_dir / "checkpoints")[0].path)
    assert manifest.reason == "preemption"
    # Lightning logs optimizer step n (1-based global_step) as metrics step n - 1.
    logged = [int(r["step"]) for r in _metrics(run_dir) if r.get("train/loss")]
    assert logged == list(range(manifest.step)), f"checkpointed step {manifest.step}, logged {logged}"


def test_consecutive_anomalies_roll_back_then_stop_with_exit_65(tmp_path):
    run_dir = tmp_path / "run"
    # Three NaN steps in a row -> rollback to the step-4 checkpoint; three more -> rollbacks used up -> stop.
    injector = {"nan_steps": [6, 7, 8, 10, 11, 12], "ranks": [0]}
    rc, log = _run(_config(run_dir, devices=2, injector=injector))
    assert rc == 65, log[-3000:]
    assert "rolled back model, optimizer, LR scheduler and RNG to" in log and "step=000000004.ckpt" in log
    assert "allowed rollbacks are used up" in log
    for rank in (0, 1):
        rows = {r["step"]: r for r in _rows(run_dir, rank)}
        assert rows[8]["params"] == rows[4]["params"] != rows[7]["params"]  # back to the checkpoint
        assert rows[8]["rollbacks"] == 1 and rows[9]["params"] != rows[8]["params"]
        assert rows[9]["batch"] != rows[5]["batch"]  # training moved on past the offending batches
        assert max(rows) == 11  # stopped at step 12's boundary


def _saved_steps(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"Saved checkpoint \S*step=(\d+)\.ckpt", log)]


def test_a_streak_longer_than_keep_last_rolls_back_to_the_checkpoint_from_before_it(tmp_path):
    """keep_last=2, a checkpoint every 3 steps, NaNs on rank 0 at steps 6-9: the saves due at 6 and 9 would
    prune step 3 and every rollback would land inside the streak. None is taken inside it, step 3 is kept
    (the run never becomes healthy here) and the rollback goes there."""
    run_dir = tmp_path / "run"
    config = _config(
        run_dir,
        devices=2,
        injector={"nan_steps": [6, 7, 8, 9], "ranks": [0]},
        anomaly={"zscore_threshold": None, "max_consecutive": 4, "healthy_steps": 100},
        checkpoint={"every_n_steps": 3, "keep_last": 2},
    )
    rc, log = _run(config)
    assert rc == 0, log[-3000:]
    assert "rolled back model, optimizer, LR scheduler and RNG to" in log and "step=000000003.ckpt" in log
    for rank in (0, 1):
        rows = {r["step"]: r for r in _rows(run_dir, rank)}
        assert rows[9]["params"] == rows[3]["params"] != rows[8]["params"]  # back to before the streak
        assert rows[9]["rollbacks"] == 1 and max(rows) == MAX_STEPS
    assert _saved_steps(log) == [3, 10, 12, 14]  # the save due at 9 waited for the first accepted step
    assert [e.step for e in list_checkpoints(run_dir / "checkpoints")] == [14, 12, 3]


def test_a_save_failing_on_one_rank_is_skipped_by_every_rank_and_cleaned_up(tmp_path):
    """Sharded: rank 1's write of step 8 fails with ENOSPC after rank 0 wrote its shards. Every rank learns it
    (none waits forever for the others), the partial directory goes, training continues."""
    run_dir = tmp_path / "run"
    config = _config(run_dir, devices=2, injector={"save_error_steps": [8], "ranks": [1]}, strategy=SHARDED)
    rc, log = _run(config)
    assert rc == 0, log[-3000:]
    assert "Checkpoint of step 8 not saved: rank 1: OSError: [Errno 28] No space left on device" in log
    assert "Training continues" in log
    for rank in (0, 1):
        assert _rows(run_dir, rank)[-1]["step"] == MAX_STEPS
    checkpoints = run_dir / "checkpoints"
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".tmp-")]
    assert [e.step for e in list_checkpoints(checkpoints)] == [14, 12, 4]
    assert all(verify_checkpoint(e.path) is None for e in list_checkpoints(checkpoints))


def test_a_stalled_rank_triggers_the_watchdog(tmp_path):
    run_dir = tmp_path / "run"
    timeout = 4.0
    config = _config(
        run_dir,
        devices=2,
        injector={"stall_step": 3, "stall_rank": 1},
        watchdog={"timeout_s": timeout, "first_step_timeout_s": 120},
    )
    proc = _start(config)
    rc, log = _finish(proc)
    exited = time.time()
    marker = run_dir / "stalled-rank1"
    assert marker.exists(), log[-3000:]
    assert rc == 124, log[-3000:]
    # Both ranks fire: rank 1 is stalled, rank 0 waits for it inside the gradient all-reduce.
    deadline = time.monotonic() + 30
    while len(list((run_dir / "watchdog").glob("hang-rank*.txt"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    dumps = {p.name.split("-")[1]: p.read_text() for p in (run_dir / "watchdog").glob("hang-rank*.txt")}
    assert set(dumps) == {"rank00000", "rank00001"}
    for text in dumps.values():
        assert text.startswith("Mula hang watchdog: no training progress") and "last step 2" in text
        assert "most recent call first" in text
    assert "in on_train_batch_start" in dumps["rank00001"] and "ft_app.py" in dumps["rank00001"]
    assert "in backward" in dumps["rank00000"]
    stalled_at = marker.stat().st_mtime
    assert exited - stalled_at < timeout + 15  # fired within the timeout (plus polling and process exit)
    stalled_pid = int(marker.read_text())
    deadline = time.monotonic() + 30
    while _alive(stalled_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(stalled_pid)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped by its new parent counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


# ---------------------------------------------------------------------------------------------------
# The real pipeline: `mula fit -c recipes/mula-tiny-moe.yaml`, auto-resume through the CLI.

TINY_MOE = REPO / "recipes" / "mula-tiny-moe.yaml"
TINY_STEPS = 6
FAST = [  # a faster demo: fewer stdlib files, short sequences; 2 micro-batches per step (accumulation)
    "--data.seq_len=64",
    "--data.global_batch_size=4",
    "--data.micro_batch_size=2",
    "--data.val_samples=8",
    '--data.prepare.sources=[{name: stdlib, paths: ["{stdlib}/[a-c]*.py"], format: text}]',
    "--data.prepare.train_tokenizer.max_documents=100",
]


def _tiny_moe_command(workdir: Path, run: str, injector: dict | None = None) -> list[str]:
    run_dir = workdir / run
    callbacks = [
        {"class_path": "callbacks.PreemptionHandler"},
        {"class_path": "callbacks.AnomalyGuard"},
        {"class_path": "callbacks.HangWatchdog", "init_args": {"timeout_s": 300}},
        {
            "class_path": "callbacks.FaultTolerantCheckpoint",
            "init_args": {"every_n_steps": 2, "keep_last": 3},
        },
        {"class_path": "ft_app.StepRecorder"},
    ]
    if injector:
        callbacks.append(
            {"class_path": "ft_app.FaultInjector", "init_args": {"module_path": "model.lm_head", **injector}}
        )
    trainer = {
        "default_root_dir": str(run_dir),
        "max_steps": TINY_STEPS,
        "limit_val_batches": 0,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": {
            "class_path": "mula.training.csv_logger.CSVLogger",
            "init_args": {"save_dir": str(run_dir)},
        },
        "callbacks": callbacks,
    }
    config = workdir / f"{run}.yaml"
    config.write_text(json.dumps({"trainer": trainer}))
    return [sys.executable, "-m", "mula.cli", "fit", "-c", str(TINY_MOE), "-c", str(config), *FAST]


def test_bf16_weights_expert_parallel_mula_fit_killed_and_rerun_resumes_exactly(tmp_path):
    """bf16 weights with fp32 masters (precision bf16-true, the sharded optimizer) on 2 ranks with E=2:
    both ranks SIGKILLed together after a checkpoint (a node lost); the same command resumes exactly:
    losses, every rank's bf16 weights and the batches equal the uninterrupted run's. (The real recipe's
    `mula fit`, data prepared on first use; a corrupted newest checkpoint is skipped on resume in
    test_sigkill_then_same_command_resumes_exactly_also_past_a_corrupted_checkpoint.)"""
    layout = [
        "-c", str(REPO / "recipes" / "strategies" / "xpu-moe.yaml"),
        "--trainer.devices=2", "--trainer.accelerator=cpu", "--trainer.precision=bf16-true",
        "--trainer.strategy.init_args.expert_parallel_size=2",
    ]  # fmt: skip

    def start(run: str, injector: dict | None = None) -> subprocess.Popen:
        command = _tiny_moe_command(tmp_path, run, injector) + layout
        env = {**_env(), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
        log_path = tmp_path / f"{run}.{time.monotonic_ns()}.log"
        with open(log_path, "w") as log:  # its own session: the kill takes every rank, as a lost node
            proc = subprocess.Popen(
                command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        proc.log_path = log_path  # type: ignore[attr-defined]
        return proc

    rc, log = _finish(start("reference"), timeout=420)
    assert rc == 0, log[-3000:]
    reference = {rank: _rows(tmp_path / "reference", rank) for rank in (0, 1)}
    assert [r["step"] for r in reference[1]] == list(range(1, TINY_STEPS + 1))

    proc = start("run", injector={"step_sleep_s": 0.2})
    _wait_for_step(tmp_path / "run", 5, proc, timeout=300)  # checkpoints at steps 2 and 4 exist
    os.killpg(proc.pid, signal.SIGKILL)
    assert _finish(proc)[0] == -signal.SIGKILL
    valid = [
        e for e in list_checkpoints(tmp_path / "run" / "checkpoints") if verify_checkpoint(e.path) is None
    ]
    assert valid and read_manifest(valid[0].path).kind == "dir"  # a sharded checkpoint

    rc, log = _finish(start("run", injector={"step_sleep_s": 0.2}), timeout=420)
    assert rc == 0, log[-3000:]
    assert f"Auto-resuming from {valid[0].path}" in " ".join(log.split())
    for rank in (0, 1):
        resumed = _runs(tmp_path / "run", rank)[-1]
        assert resumed[0]["step"] == valid[0].step + 1 and resumed[-1]["step"] == TINY_STEPS
        _assert_same_as(resumed, reference[rank])
