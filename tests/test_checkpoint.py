"""mula.checkpoint: the atomic write helper, manifests and verification, discovery, Mula weights
files and the sharded (DCP) directory format."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import pytest
import torch

from mula import Mula, MulaConfig
from mula.checkpoint import (
    CheckpointManifest,
    atomic_write,
    atomic_write_text,
    auto_resume_ckpt_path,
    build_manifest,
    checkpoint_name,
    consolidate_checkpoint,
    find_resume_checkpoint,
    is_sharded_checkpoint,
    list_checkpoints,
    load_weights,
    read_checkpoint,
    read_manifest,
    replace_path,
    save_weights,
    verify_checkpoint,
    write_manifest,
)
from mula.checkpoint.sharded import SHARDED_META_FILE, write_sharded_checkpoint

DENSE = {"num_experts": 0, "norm": "layernorm", "qk_norm": False}


def tiny(**kw) -> MulaConfig:
    """A two-layer MoE config small enough to save and load in milliseconds."""
    base = {
        "vocab_size": 96,
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "num_experts": 6,
        "top_k": 2,
        "expert_intermediate_size": 16,
        "intermediate_size": 48,
        "max_position_embeddings": 32,
    }
    return MulaConfig(**{**base, **kw})


# ------------------------------------------------------------------------------------------ atomic writes


@pytest.fixture
def fsyncs(monkeypatch) -> list[int]:
    """Record every os.fsync call (the real one still runs)."""
    calls: list[int] = []
    real = os.fsync

    def record(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return calls


def test_atomic_write_is_complete_after_the_call_and_fsyncs(tmp_path, fsyncs):
    target = tmp_path / "sub" / "out.pt"
    target.parent.mkdir()
    with atomic_write(target) as tmp:
        assert tmp.parent == target.parent and tmp != target
        torch.save({"x": torch.arange(1000)}, tmp)
        assert not target.exists()  # nothing visible under the final name until the body is done
    assert torch.equal(torch.load(target, weights_only=True)["x"], torch.arange(1000))
    assert len(fsyncs) >= 2  # the file's content and the directory entry
    assert os.listdir(target.parent) == ["out.pt"]

    fsyncs.clear()
    atomic_write_text(target, "new")
    assert target.read_text() == "new" and len(fsyncs) >= 2
    assert os.listdir(target.parent) == ["out.pt"]


def test_atomic_write_that_raises_keeps_the_old_content_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "summary.json"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="disk full"), atomic_write(target) as tmp:
        tmp.write_text("half of the ne")
        raise RuntimeError("disk full")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["summary.json"]

    # a temporary left by a crashed earlier write is not mistaken for content, and is cleaned up
    (tmp_path / ".tmp-summary.json").write_text("stale")
    atomic_write_text(target, "new")
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["summary.json"]


def test_atomic_write_of_a_directory_replaces_an_existing_one(tmp_path, fsyncs):
    target = tmp_path / "export"
    target.mkdir()
    (target / "old.bin").write_bytes(b"old")
    with atomic_write(target) as tmp:
        tmp.mkdir()
        (tmp / "new.bin").write_bytes(b"new")
    assert os.listdir(target) == ["new.bin"] and os.listdir(tmp_path) == ["export"]
    assert len(fsyncs) >= 3  # the file, the new directory, the parent

    partial = tmp_path / "export.partial"  # a finished directory built under another name
    partial.mkdir()
    (partial / "newer.bin").write_bytes(b"newer")
    replace_path(partial, target)
    assert os.listdir(target) == ["newer.bin"] and os.listdir(tmp_path) == ["export"]


def _file_ckpt(dirpath: Path, step: int, payload: bytes = b"x" * 1000, manifest: bool = True) -> Path:
    path = dirpath / checkpoint_name(step)
    path.write_bytes(payload)
    if manifest:
        write_manifest(path, build_manifest(path, step))
    return path


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------ manifests, discovery


def test_file_checkpoint_verification_detects_truncation_corruption_and_missing_manifest(tmp_path):
    path = _file_ckpt(tmp_path, 5, bytes(range(256)) * 40)
    manifest = read_manifest(path)
    assert manifest.step == 5 and manifest.kind == "file" and manifest.files[0].size == 10240
    assert verify_checkpoint(path, "checksum") is None and verify_checkpoint(path, "size") is None

    _flip_byte(path, 5000)  # same size, different content: only the checksum sees it
    assert verify_checkpoint(path, "size") is None
    assert "checksum" in verify_checkpoint(path, "checksum")

    path.write_bytes(bytes(range(256)) * 20)  # truncated
    assert "truncated" in verify_checkpoint(path, "size")

    path.with_name(path.name + ".manifest.json").write_text("{not json")
    assert "invalid" in verify_checkpoint(path)
    path.with_name(path.name + ".manifest.json").unlink()
    assert "did not complete" in verify_checkpoint(path)
    with pytest.raises(ValueError, match="Unknown verify mode"):
        verify_checkpoint(path, "bogus")


def test_directory_checkpoint_verification(tmp_path):
    ckpt = tmp_path / checkpoint_name(3)
    (ckpt / "sub").mkdir(parents=True)
    for name, size in [("a.distcp", 3000), ("sub/b.distcp", 10), (".metadata", 77)]:
        (ckpt / name).write_bytes(b"\1" * size)
    write_manifest(ckpt, build_manifest(ckpt, 3, checksum="crc32"))
    manifest = read_manifest(ckpt)
    assert manifest.kind == "dir" and manifest.checksum == "crc32"
    assert sorted(f.path for f in manifest.files) == [".metadata", "a.distcp", "sub/b.distcp"]
    assert verify_checkpoint(ckpt) is None
    _flip_byte(ckpt / "sub/b.distcp", 3)
    assert "sub/b.distcp" in verify_checkpoint(ckpt)
    (ckpt / "a.distcp").unlink()
    assert "missing" in verify_checkpoint(ckpt, "size")
    assert CheckpointManifest.from_json(manifest.to_json()) == manifest


def test_find_resume_checkpoint_skips_invalid_newer_ones_with_a_warning(tmp_path, caplog):
    assert find_resume_checkpoint(tmp_path / "nothing-here") is None
    _file_ckpt(tmp_path, 2)
    good = _file_ckpt(tmp_path, 4)
    _file_ckpt(tmp_path, 6, manifest=False)  # crashed between rename and manifest
    bad = _file_ckpt(tmp_path, 8)
    _flip_byte(bad, 10)  # damaged after the fact
    (tmp_path / ".tmp-step=000000010.ckpt").write_bytes(b"partial")  # crashed mid-write
    assert [e.step for e in list_checkpoints(tmp_path)] == [8, 6, 4, 2]
    with caplog.at_level(logging.WARNING, logger="mula.checkpoint.discovery"):
        assert find_resume_checkpoint(tmp_path) == good
    text = caplog.text
    assert "step=000000008.ckpt" in text and "corrupted" in text and "did not complete" in text
    assert "Resuming from" in text


def test_auto_resume_asks_callbacks_duck_typed(tmp_path):
    class NoResume:
        pass

    class Resume:
        def resume_checkpoint_path(self, trainer):
            return tmp_path / "x.ckpt"

    class FakeTrainer:
        callbacks = [NoResume(), Resume()]  # noqa: RUF012

    assert auto_resume_ckpt_path(FakeTrainer()) == str(tmp_path / "x.ckpt")
    FakeTrainer.callbacks = [NoResume()]
    assert auto_resume_ckpt_path(FakeTrainer()) is None


# ------------------------------------------------------------------------------------------ weights files


@pytest.mark.parametrize("kw", [{}, {"tie_embeddings": True, **DENSE}])
def test_weights_roundtrip(tmp_path, kw):
    torch.manual_seed(0)
    model = Mula(tiny(**kw)).eval()
    x = torch.randint(0, 96, (2, 8))
    save_weights(model, tmp_path / "w.pt")
    loaded = load_weights(tmp_path / "w.pt").eval()
    assert loaded.config == model.config
    torch.testing.assert_close(loaded(x).logits, model(x).logits, atol=0, rtol=0)
    assert (loaded.lm_head.weight is loaded.embed.weight) == model.config.tie_embeddings


def test_load_lightning_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = Mula(tiny()).eval()
    sd = {f"model.{k}": v for k, v in model.state_dict().items()}
    ckpt = {"state_dict": sd, "mula_config": dataclasses.asdict(model.config), "epoch": 0, "global_step": 3}
    torch.save(ckpt, tmp_path / "last.ckpt")
    x = torch.randint(0, 96, (2, 8))
    torch.testing.assert_close(
        load_weights(tmp_path / "last.ckpt")(x).logits, model(x).logits, atol=0, rtol=0
    )


def test_load_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_weights(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="is not a Mula checkpoint"):
        load_weights(tmp_path / "junk.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="is not a Mula checkpoint"):
        load_weights(tmp_path / "other.pt")
    model = Mula(tiny())
    sd = model.state_dict()
    sd.pop("lm_head.weight")
    torch.save(
        {"format": "mula", "config": dataclasses.asdict(model.config), "state_dict": sd}, tmp_path / "bad.pt"
    )
    with pytest.raises(ValueError, match="does not match its config"):
        load_weights(tmp_path / "bad.pt")


# ------------------------------------------------------------------------------------------ sharded directories


def test_sharded_directory_is_recognised_read_and_consolidated(tmp_path):
    torch.manual_seed(0)
    model = Mula(tiny()).eval()
    meta = {"mula_config": dataclasses.asdict(model.config), "global_step": 3, "loops": {"fit_loop": {}}}
    tensors = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}
    path = tmp_path / "step=3.ckpt"
    write_sharded_checkpoint(path, tensors, meta, is_global_zero=True)
    assert is_sharded_checkpoint(path) and not list(path.glob(".tmp-*"))
    write_manifest(path, build_manifest(path, step=3))  # a step=N.ckpt is complete with its manifest

    config, state = read_checkpoint(path)
    assert config == model.config
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    single = consolidate_checkpoint(path, tmp_path / "full.ckpt")
    reloaded = torch.load(single, weights_only=True)
    assert "loops" not in reloaded and reloaded["global_step"] == 3
    x = torch.randint(0, 96, (2, 8))
    torch.testing.assert_close(load_weights(single)(x).logits, model(x).logits, atol=0, rtol=0)

    (path / SHARDED_META_FILE).unlink()  # DCP shards alone are not a Mula checkpoint
    assert not is_sharded_checkpoint(path)
    with pytest.raises(ValueError, match="failed verification: .*meta.pt is missing"):
        load_weights(path)
    with pytest.raises(ValueError, match="not a sharded Mula checkpoint"):
        load_weights(path, verify=False)
