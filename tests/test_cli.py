"""The `mula` command: an end-to-end tiny-MoE run, the tool subcommands, and one-line errors."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mula.cli import main
from mula.hf import from_hf
from mula.model.config import MulaConfig
from mula.training.module import MulaLightningModule
from mula.units import format_count

ROOT = Path(__file__).resolve().parents[1]
TINY_MOE = ROOT / "recipes" / "mula-tiny-moe.yaml"
MULA = [sys.executable, "-m", "mula.cli"]
LOGGED = ["train/loss", "train/ce_loss", "train/aux_loss", "train/z_loss", "train/tokens_per_sec", "train/lr",
          "moe/load_imbalance", "val/loss", "val/ppl", "val/bpb"]  # fmt: skip
# A smaller, faster version of the demo: fewer stdlib files, shorter sequences, fewer steps.
FAST = [
    "--trainer.max_steps=30", "--trainer.val_check_interval=15", "--trainer.limit_val_batches=2",
    "--trainer.log_every_n_steps=2", "--trainer.enable_progress_bar=false", "--data.seq_len=64",
    "--data.global_batch_size=8", "--data.micro_batch_size=8", "--data.val_samples=16", "--model.warmup_steps=5",
    '--data.prepare.sources=[{name: stdlib, paths: ["{stdlib}/[a-h]*.py"], format: text}]',
    "--data.prepare.train_tokenizer.max_documents=200",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _cli_env(monkeypatch):
    monkeypatch.setattr("sys.argv", ["mula"])
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MULA_TRACEBACK", raising=False)


def run_mula(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("MULA_TRACEBACK", None)
    return subprocess.run(
        MULA + args, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def read_metrics(path: Path) -> list[dict[str, str]]:
    with open(path) as fh:
        return list(csv.DictReader(fh))


def test_fit_tiny_moe_end_to_end(tmp_path):
    """`mula fit` of the demo recipe: data + tokenizer prepared on first use, loss falls, every logger writes."""
    proc = run_mula(["fit", "-c", str(TINY_MOE), *FAST], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "data" / "stdlib-tokenizer.json").is_file()
    assert (tmp_path / "data" / "stdlib" / "summary.json").is_file()

    run = tmp_path / "runs" / "mula-tiny-moe" / "version_0"
    rows = read_metrics(run / "metrics.csv")
    logged = {k for r in rows for k, v in r.items() if v}
    assert set(LOGGED) <= logged
    losses = [float(r["train/ce_loss"]) for r in rows if r.get("train/ce_loss")]
    assert losses[0] > 7.5  # ~ln(4096) = 8.3 at the start
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0, losses

    config = (run / "config.yaml").read_text()  # the full resolved config of the run
    assert "mula-tiny-moe" in config and "max_steps: 30" in config
    ckpt = tmp_path / "runs" / "mula-tiny-moe" / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()

    wandb_runs = list((tmp_path / "runs" / "mula-tiny-moe" / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1
    records = b"".join(p.read_bytes() for p in wandb_runs[0].glob("*.wandb"))
    missing = [k for k in LOGGED if k.encode() not in records]
    assert not missing, f"keys missing from the W&B offline run: {missing}"
    assert (wandb_runs[0] / "files" / "config.yaml").exists()

    # the checkpoint leaves through the same entry point
    main(["export-hf", "--ckpt", str(ckpt), "--output", str(tmp_path / "hf")])
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["model_type"] == "olmoe" and hf_config["num_experts"] == 16
    assert torch.load(ckpt, weights_only=True)["mula_config"]["name"] == "mula-tiny-moe"


def test_run_files_follow_the_run_directory(tmp_path):
    """--trainer.default_root_dir moves everything a run writes (metrics, config.yaml, W&B run,
    checkpoints), and the run's config.yaml runs again under another run directory."""
    short = [
        "--trainer.max_steps=2",
        "--trainer.log_every_n_steps=1",
        "--trainer.val_check_interval=2",
        *FAST[4:],
    ]
    other = tmp_path / "other"
    proc = run_mula(["fit", "-c", str(TINY_MOE), *short, f"--trainer.default_root_dir={other}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_metrics(other / "version_0" / "metrics.csv")
    config = other / "version_0" / "config.yaml"
    assert config.is_file()
    assert len(list((other / "wandb").glob("offline-run-*"))) == 1
    assert (other / "checkpoints" / "last.ckpt").is_file()
    assert not (tmp_path / "runs").exists()  # nothing in the recipe's own run directory

    again = tmp_path / "again"
    proc = run_mula(
        ["fit", "-c", str(config), "--trainer.max_steps=1", f"--trainer.default_root_dir={again}"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (again / "version_0" / "metrics.csv").is_file() and (again / "version_0" / "config.yaml").is_file()
    assert len(list((again / "wandb").glob("offline-run-*"))) == 1
    assert not (other / "version_1").exists()


def expect_error(capsys, args: list[str], pattern: str) -> str:
    """`mula <args>` exits non-zero with exactly one stderr line `mula: error: ...` matching `pattern`."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mula: error:")]
    assert len(err_lines) == 1, err_lines
    import re

    assert re.search(pattern, err_lines[0]), err_lines[0]
    return err_lines[0]


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_unknown_preset(capsys, sandbox):
    expect_error(
        capsys, ["fit", "-c", str(TINY_MOE), "--model.config=mula-3b"], r"Unknown Mula preset 'mula-3b'"
    )


def test_missing_data_dir(capsys, sandbox):
    recipe = ROOT / "recipes" / "mula-1b.yaml"  # points at data/olmoe-mix-0924, not prepared here
    expect_error(capsys, ["fit", "-c", str(recipe)], r"data directory .*olmoe-mix-0924 does not exist")
    assert not (sandbox / "runs").exists()  # failed before any run directory was created


def test_tokenizer_larger_than_model_vocab(capsys, sandbox):
    expect_error(
        capsys, ["fit", "-c", str(TINY_MOE), "--model.overrides.vocab_size=1024"],
        r"tokenizer has 4096 tokens but the model's vocab_size is 1024",
    )  # fmt: skip
    assert not (sandbox / "data").exists()  # checked before preparing the data or training a tokenizer


def test_unknown_expert_backend(capsys, sandbox):
    expect_error(
        capsys,
        ["fit", "-c", str(TINY_MOE), "--model.overrides.expert_backend=cutlass"],
        r"Unknown expert backend 'cutlass'; choose one of auto, triton, torch, loop",
    )


def test_expert_backend_that_cannot_run_on_the_device(capsys, sandbox, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    expect_error(
        capsys,
        ["fit", "-c", str(TINY_MOE), "--model.overrides.expert_backend=triton"],
        r"Expert backend 'triton' cannot run on cpu",
    )
    assert not (sandbox / "data").exists()  # checked before preparing the data


def test_bf16_weights_without_fp32_masters(capsys, sandbox):
    expect_error(
        capsys,
        ["fit", "-c", str(TINY_MOE), "--trainer.precision=bf16-true"],
        r"trainer.precision=bf16-true .* SingleDeviceStrategy keeps no fp32 masters",
    )
    assert not (sandbox / "data").exists()  # checked before preparing the data


def test_seq_len_beyond_model_positions(capsys, sandbox):
    expect_error(
        capsys,
        ["fit", "-c", str(TINY_MOE), "--data.seq_len=4096"],
        r"seq_len 4096 exceeds .*max_position_embeddings 1024",
    )


def test_export_hf_rejects_a_file_that_is_not_a_checkpoint(capsys, sandbox):
    bad = sandbox / "notes.ckpt"
    bad.write_text("not a checkpoint")
    expect_error(capsys, ["export-hf", "--ckpt", str(bad), "--output", "hf"], r"is not a Mula checkpoint")
    expect_error(
        capsys, ["export-hf", "--ckpt", "missing.ckpt", "--output", "hf"], r"missing.ckpt does not exist"
    )
    assert not (sandbox / "hf").exists()


def test_import_hf_rejects_an_unsupported_architecture(capsys, sandbox):
    hf_dir = sandbox / "llama"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    expect_error(
        capsys, ["import-hf", "--hf_dir", str(hf_dir), "--output", "w.pt"], r"Unsupported .*LlamaForCausalLM"
    )
    assert not (sandbox / "w.pt").exists()


def test_import_hf_writes_any_output_name_that_training_starts_from(capsys, sandbox):
    """`--output` without an extension (its temporary sibling is a hidden file without one), the count
    printed with its unit, and the file is what `mula fit --model.init_weights` starts from."""
    pytest.importorskip("transformers")
    from test_hf import randomize

    from mula.hf import to_hf
    from mula.model.transformer import Mula

    torch.manual_seed(0)
    hf = randomize(to_hf(Mula(MulaConfig.from_name("mula-tiny-moe"))))
    hf.save_pretrained(sandbox / "olmoe")
    main(["import-hf", "--hf_dir", str(sandbox / "olmoe"), "--output", "olmoe-weights"])
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    count = MulaConfig.from_name("mula-tiny-moe").num_params()
    assert 1e6 < count < 1e9 and printed.endswith(f" {format_count(count)} parameters)"), printed
    assert "M parameters" in printed and not list(sandbox.glob(".tmp-*")), printed
    module = MulaLightningModule("mula-tiny-moe", init_weights="olmoe-weights")  # --model.init_weights
    module.configure_model()
    want = from_hf(hf).state_dict()
    assert all(torch.equal(value, want[name]) for name, value in module.model.state_dict().items())


def test_a_wandb_logger_without_wandb_installed_is_one_sentence(capsys, sandbox, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a)
    )
    expect_error(capsys, ["fit", "-c", str(TINY_MOE)], r"wandb is not installed: pip install 'mula\[wandb\]'")
    assert not (sandbox / "runs").exists()


def test_prepare_missing_inputs(capsys, sandbox):
    expect_error(
        capsys,
        [
            "prepare",
            "--sources=[{name: web, paths: [nowhere/*.jsonl]}]",
            "--tokenizer_path=t.json",
            "--output_dir=out",
        ],
        r"does not exist|no files match",
    )


def test_console_script_exit_code_and_single_line(tmp_path):
    """The installed entry point itself: one `mula: error:` line on stderr, exit status 2."""
    proc = run_mula(["fit", "-c", str(TINY_MOE), "--model.config=mula-3b"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("mula: error: Unknown Mula preset 'mula-3b'")


def test_tools_share_the_entry_point_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for sub in ("fit", "validate", "test", "prepare", "train-tokenizer", "import-hf", "export-hf"):
        assert f"    {sub}" in out, sub


def test_train_tokenizer_subcommand(sandbox):
    (sandbox / "a.txt").write_text("def hello():\n    return 'world'\n" * 50)
    main(
        [
            "train-tokenizer",
            "--inputs=[a.txt]",
            "--output_path=tok.json",
            "--vocab_size=300",
            "--show_progress=false",
        ]
    )
    from tokenizers import Tokenizer

    assert Tokenizer.from_file("tok.json").get_vocab_size() <= 300


def test_error_after_training_started_is_a_crash_not_bad_input(sandbox, monkeypatch):
    """A ValueError after the first step must not look like bad input (exit 2 is never restarted)."""
    from mula.training.module import MulaLightningModule

    original = MulaLightningModule.training_step

    def failing_step(self, batch, batch_idx):
        if self.global_step >= 1:
            raise ValueError("corrupt batch")
        return original(self, batch, batch_idx)

    monkeypatch.setattr(MulaLightningModule, "training_step", failing_step)
    with pytest.raises(RuntimeError, match="training failed at step 1: corrupt batch"):
        main(["fit", "-c", str(TINY_MOE), *FAST, "--trainer.max_steps=3", "--trainer.logger=false"])


def test_a_disabled_wandb_run_saves_the_config_in_the_run_directory_only(tmp_path):
    """`WANDB_MODE=disabled` (W&B's own switch) gives a run without a files directory: the config is saved
    beside metrics.csv and nothing is staged for W&B (it failed the run with "No such file")."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import WandbLogger

    from mula.commands.lightning_cli import MulaSaveConfig

    # the run's mode as an argument, not WANDB_MODE: wandb reads its environment once per process, and a
    # later test's offline run in this worker would be disabled too
    logger = WandbLogger(save_dir=str(tmp_path), mode="disabled")
    assert not os.path.isdir(logger.experiment.dir)  # what W&B's disabled run says it has
    (tmp_path / "config.yaml").write_text("model: {}\n")
    callback = MulaSaveConfig.__new__(MulaSaveConfig)  # save_config reads only these two
    callback._log_dir, callback.config_filename = str(tmp_path), "config.yaml"
    callback.save_config(SimpleNamespace(loggers=[logger]), None, "fit")
    assert not os.path.exists(logger.experiment.dir)
    logger.experiment.finish()  # a run left open here was reused by a later test's logger in this worker


def test_fit_ends_the_wandb_run_it_started_and_only_that(sandbox):
    """Lightning's WandbLogger leaves its run open after training. `mula fit` ends the run it started, so
    a second fit in the same process (a notebook, a sweep) logs to a run of its own, not into the first
    one's directory; a run the caller started, which the logger reuses, is left to the caller."""
    import wandb

    one_step = ["fit", "-c", str(TINY_MOE), *FAST, "--trainer.max_steps=1", "--trainer.val_check_interval=1"]
    main([*one_step, f"--trainer.default_root_dir={sandbox / 'first'}"])
    assert wandb.run is None
    assert len(list((sandbox / "first" / "wandb").glob("offline-run-*"))) == 1

    callers = wandb.init(mode="offline", dir=str(sandbox), project="callers")
    try:
        main([*one_step, f"--trainer.default_root_dir={sandbox / 'second'}"])
        assert wandb.run is callers  # still open: the caller's to finish
    finally:
        callers.finish()
    assert not (sandbox / "second" / "wandb").exists()  # it logged into the caller's run
