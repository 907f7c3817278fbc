"""val/bpb (mula/training/bits_per_byte.py): bits per UTF-8 byte of the validation targets.

A tiny run validates on data `mula prepare` wrote with a byte-level BPE Mula trained; its val/bpb equals an
independent computation: the cross-entropy of every target from the model's logits, summed in float64,
over the UTF-8 bytes of the targets' text decoded by the tokenizer (EOS left out), times ln 2. The
documents are ASCII, so any window of tokens decodes to exactly its own bytes (the exactness of partial
characters is tests/test_token_bytes.py's). The module sums in float32 (as val/loss does): each batch's
mean over 64 targets and 4 batch sums are a few hundred float32 roundings, below 64 x 2^-24 ~ 4e-6 relative
at worst, hence rel=1e-5. Planted bugs -- one byte per token, EOS counted as its 13 characters -- fail
the comparison; val/loss is the same float32 mean as before. Without a tokenizer (plain dataloaders) no
val/bpb is logged. The sums keep float32 / int64 under a bf16 cast of the module (planted: torchmetrics'
own cast makes the nats bf16).

On 4 gloo ranks with XPUMoEStrategy the same data and weights give the one-process val/loss and val/bpb
(the suite's LOSS_RTOL) under data parallelism (DP=4), context parallelism (C=2 x DP=2), tensor
parallelism (T=2 x DP=2) and pipeline stages with context parallelism (P=2 x C=2: the last stage
counts); counting a context-parallel slice's bytes once instead of C times (planted) breaks it.
"""

from __future__ import annotations

import json
import math
import random

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from dist_helpers import cpu_trainer, lightning_env, run_distributed
from equality import LOSS_RTOL
from torch.utils.data import DataLoader

import mula.data.tokenizer as tokenizer_module
import mula.training.module as module_module
from mula.checkpoint import save_weights
from mula.data import MulaDataModule
from mula.data.prepare import SourceSpec, prepare
from mula.data.tokenizer import load_tokenizer, train_tokenizer
from mula.model.config import resolve_config
from mula.model.transformer import Mula
from mula.training.bits_per_byte import BitsPerByte, target_bytes
from mula.training.lightning_compat import FullPrecisionMean
from mula.training.module import MulaLightningModule
from strategies import XPUMoEStrategy

WORDS = ["alpha", "beta", "gamma", "token", "def", "return", "mixture", "of", "experts", "(x)", "42", "\n"]
SEQ, MICRO, VAL = 32, 2, 8
DENSE = dict(vocab_size=320, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=64,
             max_position_embeddings=64)  # fmt: skip
RTOL = 1e-5  # float32 sums of a few hundred terms (module docstring)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """ASCII documents prepared with a 300-token byte-level BPE, and tiny dense weights for every run."""
    d = tmp_path_factory.mktemp("bpb")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) for _ in range(80)]
    (d / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    tok = train_tokenizer([str(d / "a.jsonl")], str(d / "tok.json"), vocab_size=300, show_progress=False)
    prepare([SourceSpec("a", [str(d / "a.jsonl")])], tok, str(d / "prepared"), num_workers=0, progress=False)
    torch.manual_seed(0)
    save_weights(Mula(resolve_config("mula-tiny-dense", DENSE)), d / "w.pt")
    return {"dir": str(d / "prepared"), "tokenizer": tok, "weights": str(d / "w.pt")}


def datamodule(data: dict) -> MulaDataModule:
    return MulaDataModule(data["dir"], seq_len=SEQ, global_batch_size=8, micro_batch_size=MICRO, val_samples=VAL,
                          num_workers=0)  # fmt: skip


def module(data: dict) -> MulaLightningModule:
    return MulaLightningModule("mula-tiny-dense", overrides=DENSE, init_weights=data["weights"])


def validate_one_process(data: dict) -> dict[str, float]:
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.validate(module(data), datamodule=datamodule(data), verbose=False)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def independent(data: dict) -> dict[str, float]:
    """val/loss and val/bpb computed here: float64 cross-entropy of the model's logits, bytes by decoding."""
    dm = datamodule(data)
    dm.setup("validate")
    model = module(data)
    model.configure_model()
    tok = load_tokenizer(data["tokenizer"])
    nats, num_bytes, tokens = 0.0, 0, 0
    with torch.no_grad():
        for batch in dm.val_dataloader():
            logits = model.model(batch[:, :-1]).logits.double()
            nats += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
            for row in batch[:, 1:].tolist():
                num_bytes += len(tok.decode([i for i in row if i != tok.eos_id]).encode("utf-8"))
                tokens += len(row)
    assert tokens == VAL * SEQ
    return {"val/loss": nats / tokens, "val/bpb": nats / (math.log(2) * num_bytes)}


def test_val_bpb_of_a_tiny_run_equals_an_independent_computation(data):
    got, want = validate_one_process(data), independent(data)
    assert got["val/bpb"] == pytest.approx(want["val/bpb"], rel=RTOL)
    assert got["val/loss"] == pytest.approx(want["val/loss"], rel=RTOL)  # unchanged: the same mean
    assert got["val/ppl"] == pytest.approx(math.exp(got["val/loss"]), rel=RTOL)
    assert 1.0 < got["val/bpb"] < got["val/loss"] / math.log(2)  # several bytes per token


@pytest.mark.parametrize("bug", ["one byte per token", "EOS counted"])
def test_a_planted_byte_count_fails_the_comparison(data, monkeypatch, bug):
    lengths = tokenizer_module.token_byte_lengths
    eos = load_tokenizer(data["tokenizer"]).eos_id

    def planted(tok):
        table = lengths(tok)
        if bug == "one byte per token":
            table[:] = 1
        else:
            table[eos] = len("<|endoftext|>")
        return table

    monkeypatch.setattr(tokenizer_module, "token_byte_lengths", planted)
    got, want = validate_one_process(data), independent(data)
    assert got["val/bpb"] != pytest.approx(want["val/bpb"], rel=RTOL)
    assert got["val/loss"] == pytest.approx(want["val/loss"], rel=RTOL)


def test_no_tokenizer_no_val_bpb(data):
    dm = datamodule(data)
    dm.setup("validate")
    batches = list(dm.val_dataloader())
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.validate(module(data), DataLoader(batches, batch_size=None), verbose=False)
    assert "val/loss" in trainer.callback_metrics and "val/bpb" not in trainer.callback_metrics


def test_the_sums_keep_their_dtypes_under_a_bf16_cast(monkeypatch):
    holder = torch.nn.Module()
    holder.bpb = BitsPerByte()
    holder.to(dtype=torch.bfloat16)
    holder.bpb.update(torch.tensor(1000.0 + 1 / 3), torch.tensor(2**40 + 1))
    assert (holder.bpb.nats.dtype, holder.bpb.bytes.dtype) == (torch.float32, torch.long)
    assert int(holder.bpb.bytes) == 2**40 + 1 and float(holder.bpb.nats) == pytest.approx(
        1000 + 1 / 3, rel=1e-7
    )
    # val/loss's mean too, also after a reset (its reset values keep float32)
    holder.loss = FullPrecisionMean()
    holder.to(dtype=torch.bfloat16)
    holder.loss.update(torch.tensor(1 / 3), weight=1000)
    holder.loss.reset()
    holder.loss.update(torch.tensor(1 / 3), weight=1000)
    assert holder.loss.mean_value.dtype == holder.loss.weight.dtype == torch.float32
    assert float(holder.loss.compute()) == pytest.approx(1 / 3, rel=1e-7)
    # planted: torchmetrics' own cast rounds the sums to bf16
    from torchmetrics import MeanMetric, Metric

    monkeypatch.setattr(BitsPerByte, "_apply", Metric._apply)
    holder.bpb = BitsPerByte()
    holder.loss = MeanMetric()
    holder.to(dtype=torch.bfloat16)
    assert holder.bpb.nats.dtype == holder.loss.mean_value.dtype == torch.bfloat16


def test_a_context_parallel_slice_counts_its_bytes_as_often_as_its_loss():
    table = torch.tensor([0, 1, 2, 3, 4])
    targets = torch.tensor([[1, 2, 3, 4], [4, 3, 0, 1]])
    halves = [targets[:, :2], targets[:, 2:]]
    assert sum(target_bytes(table, h, targets.numel()) for h in halves) == 2 * table[targets].sum()
    with pytest.raises(ValueError, match="8 weighted tokens are not a multiple of the 3 targets scored"):
        target_bytes(table, targets.flatten()[:3], 8)


# (name, strategy settings, data-parallel size) on 4 ranks
LAYOUTS = [
    ("dp4", {}, 4),
    ("cp2", {"context_parallel_size": 2}, 2),
    ("tp2", {"tensor_parallel_size": 2}, 2),
    ("pp2cp2", {"pipeline_parallel_size": 2, "context_parallel_size": 2}, 1),
]


def _validate_layouts(rank: int, world: int, data: dict) -> dict:
    lightning_env(rank, world)
    out = {}
    for name, settings, dp in [*LAYOUTS, ("cp2 planted", {"context_parallel_size": 2}, 2)]:
        if name.endswith("planted"):  # a slice's bytes counted once, its nats C times
            module_module.target_bytes = lambda table, targets, tokens: table[targets].sum()
        strategy = XPUMoEStrategy(**settings)
        trainer = cpu_trainer(world, strategy, max_steps=1, accumulate_grad_batches=1, callbacks=[])
        trainer.validate(module(data), datamodule=datamodule(data), verbose=False)
        assert strategy.data_parallel_size == dp
        out[name] = {k: float(trainer.callback_metrics[k]) for k in ("val/loss", "val/bpb")}
    return out


def test_every_layout_gives_the_one_process_val_bpb(data):
    ref = validate_one_process(data)
    out = run_distributed(_validate_layouts, 4, data)
    for rank, runs in enumerate(out):
        for name, _, _ in LAYOUTS:
            for key in ("val/loss", "val/bpb"):
                assert runs[name][key] == pytest.approx(ref[key], rel=LOSS_RTOL), (rank, name, key)
        planted = runs["cp2 planted"]
        assert planted["val/loss"] == pytest.approx(ref["val/loss"], rel=LOSS_RTOL)
        assert planted["val/bpb"] == pytest.approx(2 * ref["val/bpb"], rel=LOSS_RTOL), rank
