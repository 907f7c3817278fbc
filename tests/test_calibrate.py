"""`mula calibrate` (mula/calibrate/) and the planner's use of a calibrated machine file (mula/plan/calibrated.py)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_helpers import run_distributed

from mula.calibrate.command import QUICK_SEQ_LEN
from mula.calibrate.estimate import Probe, announcement, duration, phase_seconds
from mula.calibrate.fit import fit_curve
from mula.calibrate.job import cpu_threads_per_rank
from mula.calibrate.measure import busy_times
from mula.calibrate.settings import Settings
from mula.model.config import MulaConfig
from mula.plan import Layout
from mula.plan.grad_reduction import overhead_per_byte
from mula.plan.machines import load_machine
from mula.plan.split_compute import split_factor
from mula.plan.step_time import comm_volumes, step_time

ROOT = Path(__file__).resolve().parents[1]
# docs/scaling.md's command, run here as written (tests/test_docs_commands.py defers to this test for it)
DOCUMENTED = (
    "mula calibrate --devices 2 --output recipes/machines/this-host.yaml --model mula-tiny-moe --quick true"
)
SIZES = [1 << e for e in range(10, 27, 2)]


def test_fit_recovers_latency_and_bandwidth():
    alpha, beta = 2e-5, 1 / 12e9  # 20 us, 12 GB/s
    curve = fit_curve([(n, alpha + beta * n) for n in SIZES])
    assert curve.alpha_s == pytest.approx(alpha, rel=1e-9) and curve.beta_s_per_byte == pytest.approx(
        beta, rel=1e-9
    )
    assert curve.max_error == pytest.approx(0, abs=1e-12) and curve.bandwidth_gbps == pytest.approx(12)
    # noisy points: the claimed band is the largest relative residual, whichever point it is
    noisy = [(n, (alpha + beta * n) * (1.1 if i == 2 else 1.0)) for i, n in enumerate(SIZES)]
    fitted = fit_curve(noisy)
    assert fitted.max_error == pytest.approx(max(abs(fitted.seconds(n) - t) / t for n, t in noisy))
    assert 0.05 < fitted.max_error < 0.1
    # latency-only points (a flat time) give beta 0, bandwidth-only ones alpha 0
    assert fit_curve([(n, 1e-4) for n in SIZES]).beta_s_per_byte == 0
    assert fit_curve([(n, n / 1e9) for n in SIZES]).alpha_s == pytest.approx(0, abs=1e-15)


def _calibration(alpha: float, beta: float) -> dict:
    curve = {"alpha_s": alpha, "beta_s_per_byte": beta, "max_error": 0.03}
    kinds = ("all_to_all", "reduce_scatter", "all_gather", "all_reduce", "send_recv")
    return {
        "measured_at": "2026-11-25T00:00:00+00:00", "host": "h", "world_size": 4, "backend": "gloo",
        "model_tflops": {"float32": 0.05, "bfloat16": 0.1}, "error_band": 0.03,
        "collectives": {"intra": {k: {2: curve, 4: curve} for k in kinds}},
    }  # fmt: skip


def test_step_time_prices_each_collective_by_its_calls_and_bytes():
    plain = load_machine("aurora")
    calibrated = dataclasses.replace(plain, tiles_per_node=4, calibration=_calibration(1e-4, 1e-9))
    config = MulaConfig.from_name("mula-tiny-moe")
    layout = Layout(
        world_size=4, ep_size=2, pp_size=2, micro_batch=2, seq_len=256, micro_batches=4, device_type="cpu"
    )
    (v0, v1) = comm_volumes(config, layout)
    t = step_time(config, layout, calibrated, 32)
    busiest_a2a = max((v0.all_to_all, v0.all_to_all_calls), (v1.all_to_all, v1.all_to_all_calls))
    assert t.all_to_all_s == pytest.approx(
        max(v0.all_to_all_calls, v1.all_to_all_calls) * 1e-4 + 1e-9 * busiest_a2a[0]
    )
    assert t.param_gather_s == pytest.approx(
        max(v0.param_gather_calls, v1.param_gather_calls) * 1e-4
        + 1e-9 * max(v0.param_gather, v1.param_gather)
    )
    # compute at the measured fp32 rate of the model's shapes, not peak x compute_mfu
    uncalibrated = step_time(config, layout, dataclasses.replace(plain, tiles_per_node=4), 32)
    assert t.compute_s * 0.05e12 == pytest.approx(
        uncalibrated.compute_s * plain.peak_bf16_tflops * 1e12 * plain.compute_mfu
    )
    # latency matters: the same bytes in more calls take longer
    slower = dataclasses.replace(calibrated, calibration=_calibration(1e-3, 1e-9))
    assert step_time(config, layout, slower, 32).step_time_s > t.step_time_s


def _mula(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "mula", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_calibrate_writes_a_machine_file_the_planner_uses(tmp_path):
    """The documented command (`DOCUMENTED`, from a directory holding recipes/machines/) says how long it
    takes before it measures, writes a machine file with every measurement, and the planner prices with it."""
    args = DOCUMENTED.split()[1:]
    out = tmp_path / args[args.index("--output") + 1]
    out.parent.mkdir(parents=True)
    done = _mula(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "mula: calibrating 2 ranks takes about " in done.stdout  # said before it measures
    text = out.read_text()
    assert text.startswith("# Measured by `mula calibrate` on ")  # how and when, in the file
    machine = load_machine(str(out))
    cal = machine.calibration
    assert cal["world_size"] == 2 and cal["nodes"] == 1 and cal["backend"] == "gloo"
    assert cal["threads_per_rank"] == 1  # OMP_NUM_THREADS=1 in the environment is kept
    for kind in ("all_to_all", "reduce_scatter", "all_gather", "all_reduce", "send_recv"):
        entry = cal["collectives"]["intra"][kind][2]
        assert entry["alpha_s"] >= 0 and entry["beta_s_per_byte"] >= 0 and len(entry["points"]) >= 5
        assert all(seconds > 0 for _, seconds in entry["points"])
    assert machine.tiles_per_node == 2 and machine.peak_bf16_tflops > 0 and 0 < machine.compute_mfu <= 1
    assert set(cal["model_tflops"]) == {"float32", "bfloat16"}
    # the rates of a block and of the rest, the update's bandwidth, the training loop's fixed seconds
    for rates in cal["training_tflops"].values():
        assert set(rates) == {"step", "forward", "head_step", "head_forward"} and min(rates.values()) > 0
    assert cal["elementwise_gbps"] > 0 and set(cal["loop_s"]) == {"step", "batch"}
    assert min(cal["loop_s"].values()) >= 0 and cal["loop_s"]["step"] + cal["loop_s"]["batch"] > 0
    assert set(cal["functional_call_s"]) == {2} and cal["functional_call_s"][2] >= 0  # the TP/CP call price
    # the small model whole and split as the strategy splits it, per dtype, kind and group size
    for dtype in ("float32", "bfloat16"):
        splits = cal["split_training_s"][dtype]
        assert set(splits) == {"tp", "tp_sp", "cp", "ep"}
        for kind, sized in splits.items():
            assert sized[2]["whole"] > 0 and sized[2]["split"] > 0 and sized[2]["seq_len"] == QUICK_SEQ_LEN
            assert split_factor(machine, kind, 2, 4 if dtype == "float32" else 2) >= 1.0
        # the small model's step without a reducer and with the strategy's sharded AdamW at each ZeRO stage
        stages = cal["grad_reduction_s"][dtype]
        assert set(stages) == {1, 2}
        for stage, sized in stages.items():
            measured = sized[2]
            assert measured["plain"] > 0 and measured["reduced"] > 0 and measured["micro_batches"] == 2
            assert measured["bucket_bytes"] > 0 and measured["seq_len"] == QUICK_SEQ_LEN
            assert overhead_per_byte(machine, measured, stage, 2, dtype) >= 0.0
    plan = _mula("plan", "-c", str(ROOT / "recipes/mula-tiny-moe.yaml"), "--trainer.devices=2",
                 "--trainer.strategy=strategies.XPUMoEStrategy", "--trainer.strategy.init_args.expert_parallel_size=2",
                 f"--machine={out}", cwd=ROOT)  # fmt: skip
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert (
        "priced with the calibration measured" in plan.stdout
        and "curves fit their points within +-" in plan.stdout
    )


@pytest.mark.parametrize(
    "args, said",
    [
        (["--devices", "1"], "needs at least 2 ranks"),
        (["--devices", "2", "--backend", "mpi"], "unknown backend 'mpi'"),
        (["--devices", "2", "--output", "/nonexistent/dir/m.yaml"], "is not a writable directory"),
        (["--devices", "2", "--output", "m.txt"], "must be a .yaml file"),
        (["--devices", "2", "--model", "no-such-model"], "no-such-model"),
        (
            ["--devices", "2", "--seq_len", "2048"],
            "--seq_len 2048 does not fit mula-tiny-moe, whose max_position_embeddings is 1024",
        ),
        (["--devices", "2", "--seq_len", "0"], "give a sequence length from 1 to 1024"),
        (["--devices", "2", "--strategy", "strategies.NoSuchStrategy"], "names no class"),
        (
            ["--devices", "2", "--strategy", "lightning.pytorch.strategies.DDPStrategy"],
            "DDPStrategy has no calibration()",
        ),
    ],
)
def test_bad_input_stops_before_measuring(tmp_path, args, said, capsys, monkeypatch):
    from mula.commands.entry import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        main(["calibrate", "--output", str(tmp_path / "m.yaml"), *args])
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], lines
    assert not (tmp_path / "m.yaml").exists()


def _settings(quick: bool) -> Settings:
    return Settings(
        output="m.yaml", name="m", model="mula-tiny-moe", overrides={}, seq_len=256, micro_batch=1,
        backend="gloo", quick=quick, peak_bf16_tflops=None, memory_per_tile_gb=None, progress=True,
        command="mula calibrate",
    )  # fmt: skip


def test_the_estimate_prices_each_phase_the_job_runs():
    config = MulaConfig.from_name("mula-tiny-moe")
    # a host whose bf16 pass of the small model takes twice its fp32 one
    units = Probe({"float32": 0.1, "bfloat16": 0.2}, {"float32": 1e11, "bfloat16": 1e11}, 1e-4, 1e-9)
    groups, kinds = {"intra": [2, 4], "inter": [2]}, {2: ["tp", "ep"], 4: ["ep"]}
    quick = phase_seconds(_settings(True), config, groups, kinds, units)
    # the phases the job reports done, in its order: compute, the loop, then group by group
    assert list(quick)[:8] == [
        "compute float32", "compute bfloat16", "loop", "intra 2 all_to_all", "intra 2 reduce_scatter",
        "intra 2 all_gather", "intra 2 all_reduce", "intra 2 send_recv",
    ]  # fmt: skip
    assert list(quick)[8:13] == [
        "intra 2 functional", "intra 2 float32 tp", "intra 2 float32 ep", "intra 2 float32 reduction",
        "intra 2 bfloat16 tp",
    ]  # fmt: skip
    assert "inter 2 send_recv" in quick and "inter 2 functional" not in quick  # TP/CP stay in a node
    assert "intra 4 float32 ep" in quick and "intra 4 float32 tp" not in quick  # only the kinds it splits
    assert quick["intra 2 bfloat16 tp"] == pytest.approx(2 * quick["intra 2 float32 tp"])
    # the full calibration: more message sizes and repetitions, every phase but the loop's longer
    full = phase_seconds(_settings(False), config, groups, kinds, units)
    assert full.keys() == quick.keys()
    assert all(full[p] > quick[p] for p in quick if p != "loop")
    line = announcement(_settings(True), units, quick, 2)
    assert line.startswith(f"mula: calibrating 2 ranks takes about {duration(sum(quick.values()))} here")
    assert (duration(40), duration(210)) == ("40 s", "3.5 min")


def test_matmul_shapes_follow_the_attention_and_expert_kinds():
    from mula.calibrate.measure import matmul_shapes

    mla = matmul_shapes(MulaConfig.from_name("deepseek-v3-tiny"), 64)
    assert {"q_a", "q_b", "kv_a", "kv_b", "shared_up", "mlp_up"} <= set(mla) and "qkv" not in mla
    assert {"qkv", "expert_up"} <= set(matmul_shapes(MulaConfig.from_name("mula-tiny-moe"), 64))
    assert "expert_up" not in matmul_shapes(MulaConfig.from_name("mula-tiny-dense"), 64)


def _busy_in_a_subgroup(rank: int, world: int) -> dict[str, float] | None:
    import time

    import torch.distributed as dist

    group = dist.new_group([0, 1])  # every rank creates it; only its ranks time
    out = None
    if rank in (0, 1):
        # rank 0 is the slow one: each repetition counts at its time on both ranks
        out = busy_times(
            {"nap": lambda: time.sleep(0.02 if rank == 0 else 0.0)}, torch.device("cpu"), 3, group
        )
    dist.barrier()  # the ranks outside the group meet the others here, not inside busy_times
    return out


def test_busy_times_runs_in_a_group_of_the_job_and_counts_the_slowest_rank():
    results = run_distributed(_busy_in_a_subgroup, 4)
    assert results[2] is None and results[3] is None
    assert results[0]["nap"] >= 0.02 and results[1]["nap"] >= 0.02


def test_cpu_ranks_share_the_host_cores_as_lightning_sets_them(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert cpu_threads_per_rank(4) == 4 and cpu_threads_per_rank(32) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's setting wins
    assert cpu_threads_per_rank(4) is None
