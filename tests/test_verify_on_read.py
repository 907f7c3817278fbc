"""Verification on every read: a checkpoint the user names (`mula export-hf --ckpt`, `--model.init_weights`,
`--ckpt_path`, `load_weights`) is checked against its manifest as resume does, and a corrupted one, or
something that is not a checkpoint at all, is one `mula: error:` line with exit 2 before any work.

One tiny `mula fit` (2 steps, a few seconds) provides the checkpoint every test here copies and damages.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import pytest
import torch
from test_cli import TINY_MOE, expect_error, run_mula
from test_export_tokenizer import TINY, TINY_RUN, tiny_weights
from test_fault_tolerance import _flip_byte

from mula.checkpoint import (
    build_manifest,
    check_ckpt_path,
    consolidate_checkpoint,
    load_weights,
    manifest_path,
    read_checkpoint,
    verify_checkpoint,
    write_manifest,
)
from mula.checkpoint.sharded import write_sharded_checkpoint
from mula.cli import main
from mula.model.config import MulaConfig
from mula.model.transformer import Mula
from mula.training.module import MulaLightningModule

RUN_CHECKPOINTS = Path("runs") / "mula-tiny-moe" / "checkpoints"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """The working directory of one tiny `mula fit`: its prepared data and its run's checkpoints."""
    root = tmp_path_factory.mktemp("run")
    proc = run_mula(["fit", "-c", str(TINY_MOE), *TINY_RUN], cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.fixture
def workdir(run, monkeypatch) -> Path:
    """The tiny run's directory as the working directory (its data is there), with a clean CLI environment."""
    monkeypatch.chdir(run)
    monkeypatch.setattr("sys.argv", ["mula"])
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MULA_TRACEBACK", raising=False)
    return run


def valid_last(run: Path) -> Path:
    """The run's `last.ckpt` symlink (to its step=N.ckpt, which has a manifest)."""
    last = run / RUN_CHECKPOINTS / "last.ckpt"
    assert last.is_symlink() and verify_checkpoint(last.resolve()) is None
    return last


def corrupted_copy(run: Path, dest: Path) -> Path:
    """A copy of the run's checkpoint directory with one byte of the checkpoint flipped; its last.ckpt."""
    shutil.copytree(run / RUN_CHECKPOINTS, dest, symlinks=True)
    last = dest / "last.ckpt"
    _flip_byte(last.resolve())
    return last


def test_export_hf_refuses_a_corrupted_checkpoint_and_exports_it_with_verify_false(workdir, tmp_path, capsys):
    bad = corrupted_copy(workdir, tmp_path / "checkpoints")
    out = tmp_path / "hf"
    expect_error(
        capsys,
        ["export-hf", "--ckpt", str(bad), "--output", str(out)],
        r"last.ckpt failed verification: .*step=\d+\.ckpt does not match its sha256 checksum \(corrupted\); "
        r"`--verify false`",
    )
    assert not out.exists()

    main(["export-hf", "--ckpt", str(bad), "--output", str(out), "--verify", "false"])  # forensics
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    main(["export-hf", "--ckpt", str(valid_last(workdir)), "--output", str(tmp_path / "good")])
    assert (tmp_path / "good" / "config.json").is_file()


def test_a_step_checkpoint_without_its_manifest_is_refused(workdir, tmp_path, capsys, caplog):
    """A step=N.ckpt is complete only with its manifest (the save wrote it last); a standalone copy is
    read with a warning that it cannot be verified."""
    step = valid_last(workdir).resolve()
    (tmp_path / "checkpoints").mkdir()
    shutil.copy(step, tmp_path / "checkpoints" / step.name)
    expect_error(
        capsys,
        ["export-hf", "--ckpt", str(tmp_path / "checkpoints" / step.name), "--output", str(tmp_path / "hf")],
        r"has no manifest step=\d+\.ckpt\.manifest\.json, so the save that wrote it did not complete",
    )
    assert not (tmp_path / "hf").exists()

    shutil.copy(step, tmp_path / "model.ckpt")
    main(["export-hf", "--ckpt", str(tmp_path / "model.ckpt"), "--output", str(tmp_path / "hf")])
    assert (tmp_path / "hf" / "config.json").is_file()
    assert "model.ckpt has no manifest: it cannot be verified" in caplog.text


def test_validate_refuses_a_corrupted_ckpt_path_and_init_weights(workdir, tmp_path, capsys):
    bad = str(corrupted_copy(workdir, tmp_path / "checkpoints"))
    validate = ["validate", "-c", str(TINY_MOE), *TINY_RUN, f"--trainer.default_root_dir={tmp_path / 'val'}"]
    expect_error(capsys, [*validate, "--ckpt_path", bad], r"failed verification")
    expect_error(
        capsys, ["fit", "-c", str(TINY_MOE), *TINY_RUN, "--model.init_weights", bad], r"failed verification"
    )
    main([*validate, "--ckpt_path", str(valid_last(workdir))])
    # --verify false reaches both readers: the damaged checkpoint is read as it is
    validate[-1] += "-forensics"
    main([*validate, "--ckpt_path", bad, "--model.init_weights", bad, "--verify=false"])


@pytest.mark.parametrize("kind", ["text file", "directory", "truncated checkpoint"])
def test_fit_ckpt_path_that_is_not_a_checkpoint_is_a_one_line_error(workdir, tmp_path, capsys, kind):
    path = tmp_path / "not-a-checkpoint"
    if kind == "text file":
        path.write_text("hello\n")
    elif kind == "directory":
        (path / "sub").mkdir(parents=True)
    else:
        path.write_bytes(valid_last(workdir).read_bytes()[:1000])
    expect_error(
        capsys,
        ["fit", "-c", str(TINY_MOE), *TINY_RUN, f"--ckpt_path={path}"],
        r"is not a checkpoint \(not a torch.save archive|is a directory but not a sharded checkpoint",
    )


def test_fit_ckpt_path_garbage_exits_2_without_a_traceback(run, tmp_path):
    """The installed entry point: exit 2 and a sentence, where a torch traceback and exit 1 used to be."""
    (tmp_path / "notes.txt").write_text("hello\n")
    proc = run_mula(["fit", "-c", str(TINY_MOE), *TINY_RUN, f"--ckpt_path={tmp_path / 'notes.txt'}"], cwd=run)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("mula: error: ckpt_path ")


def test_weights_files_carry_a_manifest_and_are_verified(tmp_path):
    """`save_weights` (`mula import-hf`) writes a manifest, so a damaged weights file is refused too."""
    path = Path(tiny_weights(tmp_path / "w.pt"))
    assert verify_checkpoint(path) is None
    _flip_byte(path)
    with pytest.raises(ValueError, match=r"w.pt failed verification: .*does not match its sha256 checksum"):
        load_weights(path)
    with pytest.raises(ValueError, match="failed verification"):
        MulaLightningModule("mula-tiny-moe", init_weights=str(path))
    MulaLightningModule("mula-tiny-moe", init_weights=str(path), verify_init_weights=False)  # no check


def test_a_weights_file_as_ckpt_path_is_a_one_line_error(workdir, tmp_path, capsys):
    """`mula import-hf` output is a starting point (--model.init_weights), not a training state to resume."""
    weights = tiny_weights(tmp_path / "w.pt")
    expect_error(
        capsys,
        ["fit", "-c", str(TINY_MOE), *TINY_RUN, f"--ckpt_path={weights}"],
        r"w.pt is a Mula weights file, not a training checkpoint; start from it with --model.init_weights",
    )


def test_a_standalone_checkpoint_without_a_manifest_is_read_with_a_warning(tmp_path, caplog):
    path = Path(tiny_weights(tmp_path / "w.pt"))
    manifest_path(path).unlink()
    with caplog.at_level(logging.WARNING, logger="mula.checkpoint.reading"):
        read_checkpoint(path)
    assert "has no manifest: it cannot be verified" in caplog.text


def test_a_corrupted_sharded_checkpoint_is_refused(tmp_path):
    torch.manual_seed(0)
    model = Mula(MulaConfig.from_name("mula-tiny-moe", **TINY))
    meta = {"mula_config": dataclasses.asdict(model.config), "global_step": 3}
    path = tmp_path / "step=3.ckpt"
    write_sharded_checkpoint(
        path, {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, meta, True
    )
    write_manifest(path, build_manifest(path, step=3))
    check_ckpt_path(path)
    shard = max((p for p in path.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    _flip_byte(shard)
    with pytest.raises(ValueError, match=r"\.distcp does not match its sha256 checksum"):
        check_ckpt_path(path)
    with pytest.raises(ValueError, match="failed verification"):
        read_checkpoint(path)
    with pytest.raises(ValueError, match="failed verification"):
        consolidate_checkpoint(path, tmp_path / "full.ckpt")
    check_ckpt_path(path, verify=False)


def test_lightning_ckpt_path_keywords_are_left_to_lightning(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for keyword in (None, "best", "last", "hpc", "registry", "registry:my-model", "s3://bucket/step.ckpt"):
        check_ckpt_path(keyword)
    (tmp_path / "registry-notes.ckpt").write_text("a local file, not a registry")
    with pytest.raises(ValueError, match="is not a checkpoint"):
        check_ckpt_path("registry-notes.ckpt")
