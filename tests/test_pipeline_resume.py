"""A pipelined `mula fit` (tiny MoE recipe, 2 stages on 2 gloo ranks) SIGKILLed after a checkpoint:
the same command resumes exactly. The killed run is its own reference: the steps it recorded after
its newest checkpoint (loss, parameter and batch digests on both ranks, from tests/ft_app.py's
StepRecorder) must come out bit for bit the same when the resumed run repeats them. Both ranks
record the same global loss (the loss is visible on every stage)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from test_fault_tolerance import (
    REPO,
    _assert_same_as,
    _env,
    _finish,
    _rows,
    _runs,
    _tiny_moe_command,
    _wait_for_step,
)

from mula.checkpoint import list_checkpoints, verify_checkpoint

PIPELINE = [
    "-c",
    str(REPO / "recipes" / "strategies" / "pipeline.yaml"),
    "--trainer.devices=2",
    "--trainer.accelerator=cpu",
    "--trainer.strategy.init_args.expert_parallel_size=1",
]


def _start(command: list[str], workdir: Path) -> subprocess.Popen:
    """`mula fit` in its own session, so that killing the session kills every rank (a node failure)."""
    env = {**_env(), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    log_path = workdir / f"mula.{time.monotonic_ns()}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    proc.log_path = log_path  # type: ignore[attr-defined]
    return proc


def kill_after_step_5(command: list[str], workdir: Path) -> tuple[dict[int, list[dict]], Any]:
    """Run `command` (2 ranks, run directory `workdir`/run) and SIGKILL all of it once step 5 is recorded
    (checkpoints at steps 2 and 4 exist): each rank's recorded steps and the newest valid checkpoint."""
    proc = _start(command, workdir)
    _wait_for_step(workdir / "run", 5, proc, timeout=300)
    os.killpg(proc.pid, signal.SIGKILL)
    assert _finish(proc)[0] == -signal.SIGKILL
    killed = {rank: _rows(workdir / "run", rank) for rank in (0, 1)}
    valid = [
        e for e in list_checkpoints(workdir / "run" / "checkpoints") if verify_checkpoint(e.path) is None
    ]
    newest = valid[0]
    assert [r for r in killed[0] if r["step"] > newest.step], "no step recorded after the newest checkpoint"
    return killed, newest


def assert_rerun_repeats_the_killed_steps(
    command: list[str], workdir: Path, killed: dict[int, list[dict]], newest: Any
) -> None:
    """The same `command` again auto-resumes from `newest` and repeats, bit for bit, every step each rank
    recorded after it before the kill."""
    rc, log = _finish(_start(command, workdir), timeout=420)
    assert rc == 0, log[-3000:]
    assert f"Auto-resuming from {newest.path}" in " ".join(log.split())
    for rank in (0, 1):
        resumed = _runs(workdir / "run", rank)[-1]
        assert resumed[0]["step"] == newest.step + 1
        # the steps this rank recorded before the kill: rank 1 may be a step behind rank 0, and then
        # have recorded none past the checkpoint (rank 0 has, asserted in kill_after_step_5)
        last = max(r["step"] for r in killed[rank])
        if rank == 0 or last > newest.step:
            _assert_same_as([r for r in resumed if r["step"] <= last], killed[rank])


def test_pipelined_mula_fit_killed_and_rerun_resumes_exactly(tmp_path):
    command = [
        *_tiny_moe_command(tmp_path, "run", injector={"step_sleep_s": 0.3, "module_path": "model"}),
        *PIPELINE,
    ]
    killed, newest = kill_after_step_5(command, tmp_path)
    assert_rerun_repeats_the_killed_steps(command, tmp_path, killed, newest)
    # every stage saw the same (global) loss at every step (a step recorded twice, before the kill and
    # after the resume, is the same step: compared by step)
    losses = [{r["step"]: r["loss"] for r in _rows(tmp_path / "run", rank)} for rank in (0, 1)]
    assert losses[0] == losses[1]
