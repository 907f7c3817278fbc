"""Downstream evaluation: `mula eval` against lm-eval's Hugging Face model class, `--run`, bad input, and
`callbacks.DownstreamEval` during a `mula fit` that is SIGKILLed and resumed.

Everything is offline: the tasks are local JSONL files in lm-eval's custom-task YAML format, the model is
the tiny MoE trained here on the standard library (tests/test_fault_tolerance.py's fast settings), and
HF_DATASETS_OFFLINE / HF_HUB_OFFLINE are set for every process.
"""

from __future__ import annotations

import csv
import dataclasses
import inspect
import json
import json.decoder
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from mula.checkpoint import list_checkpoints, verify_checkpoint
from mula.hf import export_hf

REPO = Path(__file__).resolve().parents[1]
TINY_MOE = REPO / "recipes" / "mula-tiny-moe.yaml"
STEPS = 6
FAST = [  # as tests/test_fault_tolerance.py: few stdlib files, short sequences, 2 micro-batches per step
    "--data.seq_len=64",
    "--data.global_batch_size=4",
    "--data.micro_batch_size=2",
    "--data.val_samples=8",
    '--data.prepare.sources=[{name: stdlib, paths: ["{stdlib}/[a-c]*.py"], format: text}]',
    "--data.prepare.train_tokenizer.max_documents=100",
]
QUESTIONS = [  # (context, choices, index of the answer)
    ("def add(a, b):\n    return", [" a + b", " a - b", " None", " print(a)"], 0),
    ("import os\npath = os.path.", ["join(a, b)", "banana", "xyzzy()"], 0),
    ("for i in range(10):\n    ", ["print(i)", "return i", "class"], 0),
    ("class Foo:\n    def __init__(self", ["):", ", x):", " lambda"], 1),
    ("if x is None:\n    raise", [" ValueError", " 42", " import"], 0),
    ("try:\n    pass\nexcept", [" Exception:", " True", " +"], 0),
    ("with open(path) as", [" f:", " 3", " ]"], 0),
    ("", ["import sys", "))))", "9 9 9"], 0),  # empty context: scored after the prefix token
]


def _env(tmp: Path) -> dict:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp / "hf-datasets"),
    )
    return env


def _write_tasks(directory: Path) -> tuple[Path, Path]:
    """A multiple-choice task and a rolling log-likelihood (perplexity) task, as local JSONL + YAML."""
    directory.mkdir(parents=True, exist_ok=True)
    mc = directory / "tiny_mc.jsonl"
    mc.write_text("".join(json.dumps({"q": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (directory / "tiny_mc.yaml").write_text(
        "task: tiny_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {mc}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{q}}"\ndoc_to_target: "{{answer}}"\ndoc_to_choice: "{{choices}}"\n'
        "metric_list:\n"
        "  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
        "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n"
    )
    # one document longer than the model's 1024 positions, so that it is scored in several windows
    texts = [inspect.getsource(json.decoder), "x = 1\nprint(x)\n"]
    ppl = directory / "tiny_ppl.jsonl"
    ppl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (directory / "tiny_ppl.yaml").write_text(
        "task: tiny_ppl\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {ppl}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n"
        "  - {metric: word_perplexity}\n  - {metric: bits_per_byte}\n"
    )
    return directory / "tiny_mc.yaml", directory / "tiny_ppl.yaml"


def _fit_command(workdir: Path, run: str, callbacks: list[dict]) -> list[str]:
    run_dir = workdir / run
    trainer = {
        "default_root_dir": str(run_dir),
        "max_steps": STEPS,
        "limit_val_batches": 0,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": {"class_path": "mula.training.csv_logger.CSVLogger", "init_args": {"name": ""}},
        "callbacks": [
            {
                "class_path": "callbacks.FaultTolerantCheckpoint",
                "init_args": {"every_n_steps": 2, "keep_last": 3},
            },
            *callbacks,
            {"class_path": "ft_app.StepRecorder"},
            {"class_path": "ft_app.RngRecorder"},  # after DownstreamEval: sees what it leaves behind
        ],
    }
    config = workdir / f"{run}.yaml"
    config.write_text(json.dumps({"trainer": trainer}))
    return [sys.executable, "-m", "mula.cli", "fit", "-c", str(TINY_MOE), "-c", str(config), *FAST]


def _start(command: list[str], workdir: Path) -> subprocess.Popen:
    log = open(workdir / f"log.{time.monotonic_ns()}.txt", "w+")  # noqa: SIM115 (read back in _finish)
    proc = subprocess.Popen(command, cwd=workdir, env=_env(workdir), stdout=log, stderr=subprocess.STDOUT)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    proc.log.seek(0)  # type: ignore[attr-defined]
    text = proc.log.read()  # type: ignore[attr-defined]
    proc.log.close()  # type: ignore[attr-defined]
    return rc, text


def _mula(workdir: Path, *args: str) -> tuple[int, str]:
    return _finish(_start([sys.executable, "-m", "mula.cli", *args], workdir))


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _by_process(rows: list[dict]) -> list[list[dict]]:
    groups: list[list[dict]] = []
    for row in rows:
        if not groups or groups[-1][0]["pid"] != row["pid"]:
            groups.append([])
        groups[-1].append(row)
    return groups


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The module's working directory: tasks, prepared data (data/stdlib) and every run."""
    path = tmp_path_factory.mktemp("downstream")
    _write_tasks(path / "tasks")
    return path


@pytest.fixture(scope="module")
def reference_run(workdir) -> Path:
    """The tiny MoE trained for 6 steps without downstream evaluation; checkpoints at steps 2, 4, 6."""
    rc, log = _finish(_start(_fit_command(workdir, "reference", []), workdir))
    assert rc == 0, log[-3000:]
    assert [r["step"] for r in _jsonl(workdir / "reference" / "record-rank0.jsonl")] == list(
        range(1, STEPS + 1)
    )
    return workdir / "reference"


def _checkpoint(run_dir: Path, step: int) -> Path:
    return next(e.path for e in list_checkpoints(run_dir / "checkpoints") if e.step == step)


def _hf_reference(hf_dir: Path, tasks: list[Path], monkeypatch, tmp_path) -> dict:
    """lm-eval's own Hugging Face model class on the exported directory: results with per-example samples."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=str(hf_dir), device="cpu", dtype="float32", batch_size=1)
    manager = TaskManager(include_defaults=False)
    return simple_evaluate(
        model=lm, tasks=[str(t) for t in tasks], task_manager=manager, bootstrap_iters=0, log_samples=True
    )


def test_mula_eval_matches_lm_eval_hf_model_on_exported_checkpoint(
    workdir, reference_run, monkeypatch, tmp_path
):
    """`mula eval --ckpt` (MulaLM on the Mula model) == lm-eval's HFLM on `mula export-hf` output: the same
    accuracy and per-example log-likelihoods within 1e-4, for multiple choice and rolling log-likelihood."""
    mc, ppl = workdir / "tasks" / "tiny_mc.yaml", workdir / "tasks" / "tiny_ppl.yaml"
    ckpt = _checkpoint(reference_run, 4)
    rc, log = _mula(workdir, "eval", "--ckpt", str(ckpt), "--tasks", f"{mc},{ppl}", "--batch_size", "3")
    assert rc == 0, log[-3000:]
    assert "tiny_mc" in log and "acc" in log  # the printed table
    record = json.loads(ckpt.with_name(ckpt.name + ".eval.json").read_text())
    assert record["step"] == 4 and record["tokens_seen"] == 4 * 4 * 64  # steps x global batch x seq_len

    hf_dir = tmp_path / "hf"
    assert export_hf(ckpt, hf_dir) is None  # exported with the run's tokenizer
    reference = _hf_reference(hf_dir, [mc, ppl], monkeypatch, tmp_path)

    for task in ("tiny_mc", "tiny_ppl"):
        ours = record["tasks"][task]
        theirs = reference["samples"][task]
        assert len(ours["samples"]) == len(theirs) == (len(QUESTIONS) if task == "tiny_mc" else 2)
        for mine, ref in zip(sorted(ours["samples"], key=lambda s: s["doc_id"]), theirs):
            expected = [r[0] if isinstance(r, (list, tuple)) else r for r in ref["filtered_resps"]]
            assert mine["loglikelihoods"] == pytest.approx(expected, abs=1e-4, rel=0)
        for name, value in ours["metrics"].items():
            assert value == pytest.approx(reference["results"][task][f"{name},none"], rel=1e-4), (task, name)
    assert set(record["tasks"]["tiny_mc"]["metrics"]) == {"acc", "acc_norm"}
    # the documents really were scored differently (not all equal, and the long one in several windows)
    assert (
        len({round(ll, 3) for s in record["tasks"]["tiny_mc"]["samples"] for ll in s["loglikelihoods"]}) > 10
    )


def test_mula_eval_run_evaluates_each_kept_checkpoint_once_logs_and_plots(workdir, reference_run):
    """`mula eval --run`: one result per kept checkpoint, logged to the run's CSV logger against the step,
    and the accuracy plot; a second `--run` evaluates nothing new (no new file, no new logger version)."""
    mc = workdir / "tasks" / "tiny_mc.yaml"
    kept = [
        e.path for e in list_checkpoints(reference_run / "checkpoints") if verify_checkpoint(e.path) is None
    ]
    assert sorted(int(p.name[5:14]) for p in kept) == [2, 4, 6]
    versions_before = set(reference_run.glob("version_*"))
    results = {p: p.with_name(p.name + ".eval.json") for p in kept}
    # the --ckpt test may have evaluated step 4 already: that checkpoint is skipped here
    newly = sorted(int(c.name[5:14]) for c, path in results.items() if not path.exists())

    rc, log = _mula(workdir, "eval", "--run", str(reference_run), "--tasks", str(mc))
    assert rc == 0, log[-3000:]
    for ckpt, path in results.items():
        record = json.loads(path.read_text())
        assert (
            record["step"] == int(ckpt.name[5:14]) and 0 <= record["tasks"]["tiny_mc"]["metrics"]["acc"] <= 1
        )
    plot = reference_run / "downstream_eval.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000
    new_versions = set(reference_run.glob("version_*")) - versions_before
    assert len(new_versions) == 1  # the run's CSV logger, a new version as for a restart
    with open(next(iter(new_versions)) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(int(r["step"]) for r in rows) == newly and newly
    for row in rows:
        record = json.loads(results[_checkpoint(reference_run, int(row["step"]))].read_text())
        assert float(row["eval/tiny_mc/acc"]) == pytest.approx(record["tasks"]["tiny_mc"]["metrics"]["acc"])
        assert float(row["eval/tokens_seen"]) == record["tokens_seen"]

    stamps = {p: p.stat().st_mtime_ns for p in results.values()}
    rc, log = _mula(workdir, "eval", "--run", str(reference_run), "--tasks", str(mc))
    assert rc == 0, log[-3000:]
    metric_lines = [line for line in log.splitlines() if line.startswith("  ")]
    assert len(metric_lines) >= 2 * len(kept) and all(
        line.endswith("(recorded earlier)") for line in metric_lines
    )
    assert "Running loglikelihood" not in log
    assert {p: p.stat().st_mtime_ns for p in results.values()} == stamps
    assert set(reference_run.glob("version_*")) - versions_before == new_versions


def test_mula_eval_bad_input_is_one_sentence_and_exit_2(
    workdir, reference_run, tmp_path, capsys, monkeypatch
):
    """Unknown task, missing checkpoint or task file, a tokenizer larger than the model's vocabulary, a bad
    dtype or device, --ckpt and --run both."""
    from mula import Mula, MulaConfig
    from mula.checkpoint import save_weights
    from mula.cli import main

    monkeypatch.setattr("sys.argv", ["mula"])  # main() gets its arguments, not pytest's
    mc = workdir / "tasks" / "tiny_mc.yaml"
    ckpt = _checkpoint(reference_run, 2)
    save_weights(
        Mula(dataclasses.replace(MulaConfig.from_name("mula-tiny-moe"), vocab_size=256)),
        tmp_path / "small.pt",
    )
    tokenizer = workdir / "data" / "stdlib-tokenizer.json"

    cases = {
        "unknown task": (["--ckpt", str(ckpt), "--tasks", "arc_eesy"], "unknown task 'arc_eesy'"),
        "missing checkpoint": (["--ckpt", str(tmp_path / "nope.ckpt"), "--tasks", str(mc)], "does not exist"),
        "missing task file": (["--ckpt", str(ckpt), "--tasks", str(tmp_path / "no.yaml")], "does not exist"),
        "vocabulary": (
            ["--ckpt", str(tmp_path / "small.pt"), "--tasks", str(mc), "--tokenizer", str(tokenizer)],
            "has 4096 tokens but the model's vocab_size is 256",
        ),
        "dtype": (["--ckpt", str(ckpt), "--tasks", str(mc), "--dtype", "float8"], "dtype must be auto"),
        "device": (["--ckpt", str(ckpt), "--tasks", str(mc), "--device", "gpu0"], "is not a torch device"),
        "both": (["--ckpt", str(ckpt), "--run", str(reference_run), "--tasks", str(mc)], "exactly one of"),
    }
    for name, (args, expected) in cases.items():  # in-process: the errors come before any evaluation
        with pytest.raises(SystemExit) as exit_info:
            main(["eval", *args])
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("mula: error:")]
        assert exit_info.value.code == 2 and len(errors) == 1 and expected in errors[0], (name, err[-2000:])
        if name == "unknown task":
            assert "did you mean arc_easy" in errors[0]
    assert not (tmp_path / "small.pt.eval.json").exists()


def _evaluate_checkpoint(
    rank: int, world_size: int, ckpt: Path, tokenizer: Path, tasks: list[str], env: dict
) -> dict:
    """MulaLM on `ckpt` with the documents split over the process group's ranks (run_distributed worker)."""
    os.environ.update(env)  # before `datasets` is imported: offline, and this module's cache
    from mula.checkpoint import load_weights
    from mula.data.tokenizer import load_tokenizer
    from mula.downstream.evaluate import evaluate
    from mula.downstream.lm import MulaLM
    from mula.downstream.tasks import resolve_tasks

    lm = MulaLM(load_weights(ckpt), load_tokenizer(tokenizer), batch_size=3, data_parallel=world_size > 1)
    assert (lm.rank, lm.world_size) == (rank, world_size)
    return evaluate(lm, resolve_tasks(tasks))


def test_mula_lm_splits_documents_over_data_parallel_ranks(workdir, reference_run):
    """Two gloo ranks, each scoring its share of the documents (as DownstreamEval does under DDP): rank 0
    gathers the same per-example log-likelihoods and metrics as one process scoring them all."""
    from dist_helpers import run_distributed

    tasks = [str(workdir / "tasks" / "tiny_mc.yaml"), str(workdir / "tasks" / "tiny_ppl.yaml")]
    args = (_checkpoint(reference_run, 2), workdir / "data" / "stdlib-tokenizer.json", tasks, _env(workdir))
    (single,) = run_distributed(_evaluate_checkpoint, 1, *args)
    rank0, rank1 = run_distributed(_evaluate_checkpoint, 2, *args)
    assert rank1 == {}
    for task in ("tiny_mc", "tiny_ppl"):
        ours = sorted(rank0[task]["samples"], key=lambda s: s["doc_id"])
        assert [s["doc_id"] for s in ours] == [s["doc_id"] for s in single[task]["samples"]]
        for mine, ref in zip(ours, single[task]["samples"]):
            assert mine["loglikelihoods"] == pytest.approx(ref["loglikelihoods"], abs=1e-4, rel=0)
        assert rank0[task]["metrics"] == pytest.approx(single[task]["metrics"], rel=1e-5)


def test_downstream_eval_callback_logs_and_sigkill_resume_is_exact(workdir, reference_run):
    """`callbacks.DownstreamEval` logs eval/tiny_mc/acc every 2 steps of `mula fit`; killed after the step-4
    checkpoint and re-run, the run matches the uninterrupted reference without the callback: losses, weights,
    batches, and every RNG state after each step (evaluation restores them)."""
    mc = workdir / "tasks" / "tiny_mc.yaml"
    callbacks = [
        {"class_path": "callbacks.DownstreamEval", "init_args": {"tasks": [str(mc)], "every_n_steps": 2}},
        {
            "class_path": "ft_app.FaultInjector",
            "init_args": {"module_path": "model.lm_head", "step_sleep_s": 0.3},
        },
    ]
    command = _fit_command(workdir, "evaluated", callbacks)
    run_dir = workdir / "evaluated"
    proc = _start(command, workdir)
    deadline = time.monotonic() + 300
    while not any(r["step"] >= 5 for r in _jsonl(run_dir / "record-rank0.jsonl")):
        assert proc.poll() is None and time.monotonic() < deadline, _finish(proc)[1][-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert _finish(proc)[0] == -signal.SIGKILL
    rc, log = _finish(_start(command, workdir))
    assert rc == 0, log[-3000:]
    assert "Auto-resuming from" in log

    for name, keys in (("record", ("loss", "params", "batch")), ("rng", ("rng",))):
        reference = {r["step"]: r for r in _jsonl(reference_run / f"{name}-rank0.jsonl")}
        first, resumed = _by_process(_jsonl(run_dir / f"{name}-rank0.jsonl"))
        assert resumed[0]["step"] == 5 and resumed[-1]["step"] == STEPS and first[0]["step"] == 1
        for row in first + resumed:
            assert {k: row[k] for k in keys} == {k: reference[row["step"]][k] for k in keys}, (
                name,
                row["step"],
            )

    rows = []
    for path in sorted(run_dir.glob("version_*/metrics.csv")):
        with open(path) as f:
            rows += [r for r in csv.DictReader(f) if r.get("eval/tiny_mc/acc")]
    assert sorted(int(r["step"]) for r in rows) == [2, 4, 6]
    assert all(0 <= float(r["eval/tiny_mc/acc"]) <= 1 and r["eval/tiny_mc/acc_norm"] for r in rows)
    assert [float(r["eval/tokens_seen"]) for r in sorted(rows, key=lambda r: int(r["step"]))] == [
        512,
        1024,
        1536,
    ]


def test_a_task_with_fewer_documents_than_ranks_is_refused_before_evaluating(tmp_path):
    """lm-eval skips a rank without requests, which would leave the other ranks' collectives: refused."""
    from mula.downstream.tasks import check_documents_per_rank, documents_per_task, resolve_tasks

    mc, ppl = _write_tasks(tmp_path)
    tasks = resolve_tasks([str(mc), str(ppl)])
    assert documents_per_task(tasks) == {"tiny_mc": len(QUESTIONS), "tiny_ppl": 2}
    assert documents_per_task(tasks, limit=0.5)["tiny_mc"] == -(-len(QUESTIONS) // 2)
    check_documents_per_rank(tasks, 2)  # two ranks: one perplexity document each
    with pytest.raises(ValueError, match="'tiny_ppl' has 2 document\\(s\\) to evaluate, fewer than the 3"):
        check_documents_per_rank(tasks, 3)
    with pytest.raises(ValueError, match="has 1 document"):
        check_documents_per_rank(tasks, 2, limit=1)
