"""`mula bench` on CPU: the tiny recipes on one rank and on 2 ranks under expert parallelism, and
Mula-1B shrunk to one block. Its memory per rank agrees with `mula plan` within the planner's stated
tolerance (parameters, gradients and optimizer state exactly, activations within 10 %: docs/scaling.md),
its collectives' bytes are the plan's by kind, its rates follow from its own step times, and bad options
are one sentence.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mula.bench.report import format_text
from mula.commands.entry import main

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
SMALL = ["--data.seq_len=64", "--data.global_batch_size=8", "--data.micro_batch_size=4"]


def _bench(args: list[str], capsys) -> dict:
    main(["bench", *args, "--format", "json"])
    out = capsys.readouterr().out
    return json.loads(out[out.index("{") :])


def _check(result: dict, steps: int) -> None:
    """The rates are the step times' and the memory is the plan's (exactly, activations within 10 %)."""
    assert len(result["step_times_s"]) == steps and min(result["step_times_s"]) > 0
    median = result["step_time_s"]["median"]
    assert result["step_time_s"]["min"] <= median <= result["step_time_s"]["max"]
    per_device = result["tokens_per_step"] / median / result["world_size"]
    assert result["tokens_per_s_per_device"] == pytest.approx(per_device)
    memory, planned = result["memory"], result["planned"]
    for key in ("params", "grads", "optimizer"):
        assert memory[key] == planned[key], (key, memory[key], planned[key])
    assert abs(memory["activations"] / planned["activations"] - 1) <= 0.10, (memory, planned)


@pytest.mark.parametrize("recipe", ["mula-tiny-moe", "mula-tiny-dense"])
def test_bench_of_a_tiny_recipe_on_one_rank(recipe, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)  # no data directory: random tokens
    result = _bench(["-c", str(RECIPES / f"{recipe}.yaml"), "--steps", "2", "--warmup", "1", *SMALL], capsys)
    _check(result, 2)
    assert result["world_size"] == 1 and result["layout"]["micro_batches"] == 2
    assert result["mfu"] is None and result["peak_bf16_tflops"] is None  # no peak for a CPU
    if recipe == "mula-tiny-moe":
        assert 0 < result["moe_share"] < 1
    else:
        assert result["moe_share"] is None
    # Lightning's one-device step reads nothing on the host outside logging steps (every 5th here); the
    # CPU expert kernel's planning, counted apart: two reads per MoE layer and micro-batch
    syncs = result["host_syncs"]
    assert result["host_syncs_per_step"] == 0 and syncs["steps"] == [4, 7], syncs
    assert syncs["ops"] == syncs["reads"] == {} and syncs["logging_steps_excluded"]
    assert syncs["excluded"] == ({"cpu expert kernel": 2 * 4 * 2} if recipe == "mula-tiny-moe" else {})
    assert "| host syncs per step |" in format_text(result) and "steps 4 and 7" in format_text(result)
    assert not list(tmp_path.iterdir()), "a benchmark writes nothing where it runs"


def test_bench_prices_mfu_against_the_machine_files_peak(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    result = _bench(["-c", str(RECIPES / "mula-tiny-moe.yaml"), "--steps", "1", "--warmup", "0", "--machine",
                     "h200", "--layers", "2", *SMALL], capsys)  # fmt: skip
    assert result["peak_bf16_tflops"] == 989 and result["machine"] == "h200"
    assert result["mfu"] == pytest.approx(result["tflops_per_device"] / 989)
    assert result["tflops_per_device"] * 1e12 == pytest.approx(
        result["tokens_per_s_per_device"] * _flops_per_token("mula-tiny-moe", 64, num_layers=2)
    )


def _flops_per_token(preset: str, seq_len: int, **overrides) -> float:
    from mula import MulaConfig

    return MulaConfig.from_name(preset, **overrides).flops_per_token(seq_len)


def test_bench_of_mula_1b_shrunk_to_one_block(tmp_path, monkeypatch, capsys) -> None:
    """The paper recipe as written (bf16 weights, the sharded optimizer's fp32 masters) at one block of
    mula-1b's width; its 50,304-word embedding and head (200 M parameters to initialise, most of the
    test's time, and nothing this test checks) shrunk to 4,096 words."""
    monkeypatch.chdir(tmp_path)
    result = _bench(["-c", str(RECIPES / "mula-1b.yaml"), "--layers", "1", "--steps", "1", "--warmup", "0",
                     "--model.overrides.vocab_size=4096",
                     "--data.seq_len=32", "--data.global_batch_size=2", "--data.micro_batch_size=1"], capsys)  # fmt: skip
    _check(result, 1)
    assert result["model"] == "mula-1b" and result["precision"] == "bf16-true"
    assert result["layout"]["shard_optimizer"] and result["moe_share"] is None


def test_bench_on_two_ranks_under_expert_parallelism(tmp_path) -> None:
    """Lightning starts the second rank (the command runs again, as for `mula fit`); rank 0 prints."""
    args = ["-c", str(RECIPES / "mula-tiny-moe.yaml"), "-c", str(RECIPES / "strategies/xpu-moe.yaml"),
            "--trainer.devices=2", "--trainer.accelerator=cpu", "--trainer.strategy.init_args.expert_parallel_size=2",
            "--steps", "2", "--warmup", "1", "--format", "json", *SMALL]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "mula", "bench", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout[done.stdout.index("{") :])
    _check(result, 2)
    assert result["world_size"] == 2 and result["layout"]["ep_size"] == 2 and 0 < result["moe_share"] < 1
    # per step (one micro-batch per rank, dropless): the all-to-all's split sizes once per MoE layer (4) and
    # nothing else (tests/test_host_sync.py states the rule; with a capacity factor it is 0)
    syncs = result["host_syncs"]
    assert result["host_syncs_per_step"] == 4 and syncs["per_rank"] == [4, 4], syncs
    assert syncs["reads"] == {"expert all-to-all splits": 4} and syncs["ops"] == {}
    # the collectives of steady steps by kind, as `mula plan` plans them on both ranks; the all-to-all's
    # bytes follow the learned routing of random tokens (the plan's are balanced routing's:
    # tests/test_plan_volumes.py holds them equal under uniform routing), its calls do not
    largest = result["collective_bytes_per_step"]
    assert result["collectives"]["steps"] == [8, 9] and largest["measured"]["calls"]["reduce"] > 0
    for kind, ranks in largest["ranks_as_planned"].items():
        assert ranks == 2 or kind == "all_to_all", (kind, largest)
    assert largest["measured"]["calls"]["all_to_all"] == largest["planned"]["calls"]["all_to_all"] > 0
    assert "collective bytes per step (measured vs planned)" in format_text(result)


def test_bench_says_why_it_has_no_host_sync_figure() -> None:
    """Compiled models are not metered; with logs on every step or every other one, no window is clean."""
    from mula.bench.report import host_sync_line

    base = {"host_syncs_per_step": None, "host_syncs": {"compiled": False, "log_every_n_steps": 2}}
    assert host_sync_line(base) == (
        "host syncs per step: n/a (every step's window holds a logging step (log_every_n_steps=2))"
    )
    base["host_syncs"]["compiled"] = True
    assert host_sync_line(base) == "host syncs per step: n/a (not measured for compiled models)"
    from mula.bench.report import collective_lines

    unmeasured = {
        "collective_bytes_per_step": None,
        "collectives": {"not_measured": "not measured for compiled models"},
    }
    assert collective_lines(unmeasured) == [
        "collective bytes per step: n/a (not measured for compiled models)"
    ]


@pytest.mark.parametrize(
    "args, said",
    [
        (["--steps", "0"], "--steps must be at least 1, got 0."),
        (["--warmup", "-1"], "--warmup must be at least 0, got -1."),
        (["--layers", "0"], "--layers must be at least 1, got 0."),
        (["--format", "yaml"], "--format must be one of text, json, got 'yaml'."),
        (["--machine", "h300"], "Unknown machine 'h300'"),
    ],
)
def test_bench_bad_options_are_one_sentence(args, said, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        main(["bench", "-c", str(RECIPES / "mula-tiny-moe.yaml"), *SMALL, *args])
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], lines


def test_bench_leaves_no_process_group_behind(tmp_path, monkeypatch, capsys) -> None:
    """The strategy's process group is the benchmark's own: an in-process caller (this suite's later
    in-process dry runs) finds torch.distributed as it was."""
    import torch.distributed as dist

    monkeypatch.chdir(tmp_path)
    assert not dist.is_initialized()
    _bench(
        ["-c", str(RECIPES / "mula-tiny-moe.yaml"), "--steps", "1", "--warmup", "0", "--layers", "1", *SMALL],
        capsys,
    )
    assert not dist.is_initialized()
