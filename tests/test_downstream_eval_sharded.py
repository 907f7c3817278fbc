"""Downstream evaluation under the training layout, on 4 gloo CPU ranks.

The tiny MoE is trained by `mula fit` at (W=4, E=2, P=2) for 4 steps with `callbacks.DownstreamEval`
and a sharded checkpoint every 2 steps. Against one process scoring each checkpoint (MulaLM on the whole
model, fp32): `mula eval --run --strategy ... --devices 4` at the same layout gives the same per-example
log-likelihoods (1e-5; 1e-7 relative for a ~3e4-nat document, below fp32's spacing there) and metrics,
and the accuracy DownstreamEval logged during the fit is the same. Tensor parallelism (T=2, sequence
parallel) on a dense weights file matches too, and context parallelism: the step-4 checkpoint at C=2 x
E=2, the dense weights file at C=2 x T=2 with sequence parallelism. A layout that cannot hold the model, or a bad strategy
entry, is one sentence before anything loads; a corrupted shard, one sentence on every rank before the
model is built. Tasks, data and model are local (tests/test_downstream_eval.py's).
"""

from __future__ import annotations

import csv
import functools
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from test_downstream_eval import (  # the same tasks, fast training settings and subprocess helpers
    FAST,
    QUESTIONS,
    TINY_MOE,
    _checkpoint,
    _env,
    _evaluate_checkpoint,
    _finish,
    _mula,
    _start,
    _write_tasks,
)

STEPS = 4
LAYOUT = {"expert_parallel_size": 2, "pipeline_parallel_size": 2, "pipeline_schedule": "gpipe"}
STRATEGY = {"class_path": "strategies.XPUMoEStrategy", "init_args": LAYOUT}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """Tasks and the run trained at (W=4, E=2, P=2), DownstreamEval logging eval/tiny_mc/acc at steps 2, 4."""
    path = tmp_path_factory.mktemp("downstream_sharded")
    _write_tasks(path / "tasks")
    trainer = {
        "default_root_dir": str(path / "run"),
        "max_steps": STEPS,
        "devices": 4,
        "accelerator": "cpu",
        "limit_val_batches": 0,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "strategy": STRATEGY,
        "logger": {"class_path": "mula.training.csv_logger.CSVLogger", "init_args": {"name": ""}},
        "callbacks": [
            {"class_path": "callbacks.FaultTolerantCheckpoint", "init_args": {"every_n_steps": 2}},
            {
                "class_path": "callbacks.DownstreamEval",
                "init_args": {"tasks": [str(path / "tasks" / "tiny_mc.yaml")], "every_n_steps": 2},
            },
        ],
    }
    config = path / "run.yaml"
    config.write_text(json.dumps({"trainer": trainer}))
    command = [sys.executable, "-m", "mula.cli", "fit", "-c", str(TINY_MOE), "-c", str(config), *FAST]
    rc, log = _finish(_start(command, path), timeout=900)
    assert rc == 0, log[-3000:]
    return path


def _one_process(workdir: Path, step: int, tasks: list[str]) -> dict:
    """The reference: one process, the whole model of the step's checkpoint, batches of 3, fp32 (evaluated
    once per module: several tests compare with the same step's)."""
    return _one_process_of(workdir, step, tuple(tasks))


@functools.cache
def _one_process_of(workdir: Path, step: int, tasks: tuple[str, ...]) -> dict:
    from dist_helpers import run_distributed

    ckpt = _checkpoint(workdir / "run", step)
    (single,) = run_distributed(
        _evaluate_checkpoint, 1, ckpt, workdir / "data" / "stdlib-tokenizer.json", list(tasks), _env(workdir)
    )
    return single


def test_mula_eval_at_training_layout_matches_one_device(workdir):
    """`mula eval --run --strategy (E=2, P=2) --devices 4` evaluates both checkpoints (steps 2 and 4) in one
    launch and == one process on each: every per-example log-likelihood within 1e-5 (multiple choice and
    rolling windows), the same metrics, printed and logged by rank 0 only; and DownstreamEval's
    eval/tiny_mc/acc (and acc_norm) logged during the (E=2, P=2) fit are the one-process values."""
    tasks = [str(workdir / "tasks" / "tiny_mc.yaml"), str(workdir / "tasks" / "tiny_ppl.yaml")]
    run = workdir / "run"
    rc, log = _mula(
        workdir, "eval", "--run", str(run), "--tasks", ",".join(tasks), "--batch_size", "3",
        "--device", "cpu", "--dtype", "float32", "--strategy", json.dumps(STRATEGY), "--devices", "4",
    )  # fmt: skip
    assert rc == 0, log[-3000:]
    metric_lines = [line for line in log.splitlines() if line.startswith("  tiny_")]
    assert len(metric_lines) == 2 * 4  # 2 checkpoints x (acc, acc_norm, word_perplexity, bits_per_byte)
    assert (run / "downstream_eval.png").exists() and len(list(run.glob("version_*"))) == 2

    with open(run / "version_0" / "metrics.csv") as f:  # the fit's logger
        logged = {int(r["step"]): r for r in csv.DictReader(f) if r.get("eval/tiny_mc/acc")}
    assert sorted(logged) == [2, STEPS]
    for step in (2, STEPS):
        ckpt = _checkpoint(run, step)
        record = json.loads(ckpt.with_name(ckpt.name + ".eval.json").read_text())
        assert record["step"] == step
        single = _one_process(workdir, step, tasks)
        for task in ("tiny_mc", "tiny_ppl"):
            ours = sorted(record["tasks"][task]["samples"], key=lambda s: s["doc_id"])
            theirs = single[task]["samples"]
            assert len(ours) == len(theirs) == (len(QUESTIONS) if task == "tiny_mc" else 2)
            for mine, ref in zip(ours, theirs):
                assert mine["doc_id"] == ref["doc_id"]
                # 1e-5, or 1e-7 of the value for the long document's ~3e4 nats, where fp32's spacing is 2e-3
                assert mine["loglikelihoods"] == pytest.approx(ref["loglikelihoods"], abs=1e-5, rel=1e-7)
            assert record["tasks"][task]["metrics"] == pytest.approx(single[task]["metrics"], rel=1e-6)
        for name in ("acc", "acc_norm"):
            expected = single["tiny_mc"]["metrics"][name]
            assert float(logged[step][f"eval/tiny_mc/{name}"]) == pytest.approx(expected, abs=1e-9), (
                step,
                name,
            )


def test_mula_eval_layout_errors_are_one_sentence_before_loading(workdir, capsys, monkeypatch):
    """A layout not dividing the world, experts not divisible by E, an unknown strategy class or argument,
    several processes without a strategy: one line, exit 2, no result written."""
    from mula.cli import main

    monkeypatch.setattr("sys.argv", ["mula"])
    ckpt = _checkpoint(workdir / "run", STEPS)
    mc = str(workdir / "tasks" / "tiny_mc.yaml")

    def strategy(**init_args) -> str:
        return json.dumps({"class_path": "strategies.XPUMoEStrategy", "init_args": init_args})

    cases = {
        "world": (
            ["--strategy", strategy(expert_parallel_size=2, pipeline_parallel_size=2), "--devices", "6"],
            "6",
        ),
        "experts": (["--strategy", strategy(expert_parallel_size=3), "--devices", "3"], "experts"),
        "class": (["--strategy", '{"class_path": "strategies.Nope"}', "--devices", "2"], "strategies.Nope"),
        "argument": (["--strategy", strategy(expert_size=2), "--devices", "2"], "expert_size"),
        "no strategy": (["--devices", "2"], "needs --strategy"),
    }
    before = set(ckpt.parent.iterdir())
    for name, (args, expected) in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            main(["eval", "--ckpt", str(ckpt), "--tasks", mc, "--device", "cpu", *args])
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("mula: error:")]
        assert exit_info.value.code == 2 and len(errors) == 1 and expected in errors[0], (name, err[-2000:])
    assert set(ckpt.parent.iterdir()) == before


def test_mula_eval_tensor_parallel_weights_file_matches_one_device(workdir, tmp_path):
    """A dense model's weights file (read whole by every rank, then split) evaluated at T=2 with sequence
    parallelism (batches padded to an even length) == one process, within 1e-5 (1e-7 relative)."""
    record, single = _dense_weights_at_layout(
        workdir, tmp_path, {"tensor_parallel_size": 2, "sequence_parallel": True}, devices=2
    )
    for task in ("tiny_mc", "tiny_ppl"):
        ours = sorted(record["tasks"][task]["samples"], key=lambda s: s["doc_id"])
        assert [s["doc_id"] for s in ours] == [s["doc_id"] for s in single[task]["samples"]]
        for mine, ref in zip(ours, single[task]["samples"]):
            assert mine["loglikelihoods"] == pytest.approx(ref["loglikelihoods"], abs=1e-5, rel=1e-7)


def _dense_weights_at_layout(workdir: Path, tmp_path: Path, layout: dict, devices: int) -> tuple[dict, dict]:
    """A tiny dense model's weights file evaluated by `mula eval` on `devices` ranks at XPUMoEStrategy
    `layout`, and in one process: (the run's .eval.json record, the one-process results by task)."""
    import torch
    from dist_helpers import run_distributed

    from mula import Mula, MulaConfig
    from mula.checkpoint import save_weights

    torch.manual_seed(0)
    weights = tmp_path / "dense.pt"
    save_weights(Mula(MulaConfig.from_name("mula-tiny-dense")), weights)
    tokenizer = workdir / "data" / "stdlib-tokenizer.json"
    tasks = [str(workdir / "tasks" / "tiny_mc.yaml"), str(workdir / "tasks" / "tiny_ppl.yaml")]
    rc, log = _mula(
        workdir, "eval", "--ckpt", str(weights), "--tasks", ",".join(tasks), "--tokenizer", str(tokenizer),
        "--batch_size", "3", "--device", "cpu", "--dtype", "float32", "--devices", str(devices),
        "--strategy", json.dumps({"class_path": "strategies.XPUMoEStrategy", "init_args": layout}),
    )  # fmt: skip
    assert rc == 0, log[-3000:]
    record = json.loads(weights.with_name(weights.name + ".eval.json").read_text())
    (single,) = run_distributed(_evaluate_checkpoint, 1, weights, tokenizer, tasks, _env(workdir))
    return record, single


def _copy_checkpoint(ckpt: Path, directory: Path) -> Path:
    """A copy of the sharded checkpoint `ckpt` (and its manifest) under `directory`/checkpoints: its
    `.eval.json` is then the copy's, not the one test_mula_eval_at_training_layout_matches_one_device reads."""
    import shutil

    from mula.checkpoint import manifest_path

    copy = directory / "checkpoints" / ckpt.name
    shutil.copytree(ckpt, copy)
    shutil.copy(manifest_path(ckpt), manifest_path(copy))
    return copy


def _assert_matches(record: dict, single: dict) -> None:
    """Per-example log-likelihoods within 1e-5 (1e-7 relative) and the same metrics as one process."""
    for task in ("tiny_mc", "tiny_ppl"):
        ours = sorted(record["tasks"][task]["samples"], key=lambda s: s["doc_id"])
        theirs = single[task]["samples"]
        assert [s["doc_id"] for s in ours] == [s["doc_id"] for s in theirs]
        assert len(ours) == (len(QUESTIONS) if task == "tiny_mc" else 2)
        for mine, ref in zip(ours, theirs):
            assert mine["loglikelihoods"] == pytest.approx(ref["loglikelihoods"], abs=1e-5, rel=1e-7)
        assert record["tasks"][task]["metrics"] == pytest.approx(single[task]["metrics"], rel=1e-6)


def test_mula_eval_context_parallel_with_data_parallel_matches_one_device(workdir, tmp_path):
    """The MoE's sharded step-4 checkpoint evaluated at C=2 x E=2 (4 ranks, 2 reading different documents,
    each with its CP peer: batches right-padded to an even length, each CP rank forwarding half of every
    sequence, the halves' logits gathered) == one process: per-example log-likelihoods within 1e-5
    (1e-7 relative) and the same metrics."""
    tasks = [str(workdir / "tasks" / "tiny_mc.yaml"), str(workdir / "tasks" / "tiny_ppl.yaml")]
    ckpt = _copy_checkpoint(_checkpoint(workdir / "run", STEPS), tmp_path)
    layout = {"expert_parallel_size": 2, "context_parallel_size": 2}
    rc, log = _mula(
        workdir, "eval", "--ckpt", str(ckpt), "--tasks", ",".join(tasks), "--batch_size", "3",
        "--device", "cpu", "--dtype", "float32", "--devices", "4",
        "--strategy", json.dumps({"class_path": "strategies.XPUMoEStrategy", "init_args": layout}),
    )  # fmt: skip
    assert rc == 0, log[-3000:]
    record = json.loads(ckpt.with_name(ckpt.name + ".eval.json").read_text())
    assert record["step"] == STEPS
    _assert_matches(record, _one_process(workdir, STEPS, tasks))


def test_mula_eval_context_and_tensor_parallel_weights_file_matches_one_device(workdir, tmp_path):
    """A dense model's weights file evaluated at C=2 x T=2 with sequence parallelism (4 ranks: batches
    right-padded to a multiple of 4, each CP rank's half split over its TP pair) == one process."""
    layout = {"tensor_parallel_size": 2, "sequence_parallel": True, "context_parallel_size": 2}
    _assert_matches(*_dense_weights_at_layout(workdir, tmp_path, layout, devices=4))


def test_mula_eval_at_layout_refuses_corrupted_checkpoint_on_every_rank(workdir, tmp_path):
    """A copy of the sharded checkpoint with one shard byte flipped: global rank 0 hashes it once the 4
    ranks are up and every rank stops with the verification's sentence before the model is built."""
    import shutil

    from mula.checkpoint import manifest_path, verify_checkpoint

    ckpt = _checkpoint(workdir / "run", STEPS)
    copy = tmp_path / "checkpoints" / ckpt.name
    shutil.copytree(ckpt, copy)
    shutil.copy(manifest_path(ckpt), manifest_path(copy))
    shard = next(p for p in sorted(copy.iterdir()) if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    expected = verify_checkpoint(copy)
    assert expected is not None

    rc, log = _mula(
        workdir, "eval", "--ckpt", str(copy), "--tasks", str(workdir / "tasks" / "tiny_mc.yaml"),
        "--device", "cpu", "--devices", "4", "--strategy", json.dumps(STRATEGY),
    )  # fmt: skip
    errors = [line for line in log.splitlines() if line.startswith("mula: error:")]
    assert rc == 2 and errors, log[-3000:]
    assert len(errors) <= 4 and all(expected.split(":")[0] in line for line in errors), log[-3000:]
    assert "Running loglikelihood" not in log and not list(copy.parent.glob("*.eval.json"))
