"""Memory accounting: saved-for-backward bytes per activation-checkpointing setting, bounded from the
shapes; exact parameter and gradient bytes; `MemoryMetrics` in a real fit (logged steps only, numerics
unchanged)."""

from __future__ import annotations

import csv

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from callbacks import MemoryMetrics
from mula import Mula, MulaConfig
from mula.training.memory_meter import SavedTensorMeter, grad_bytes, param_bytes
from mula.training.module import MulaLightningModule

B, T = 2, 16
CONFIG = MulaConfig.from_name(
    "mula-tiny-moe", vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, num_experts=8, top_k=2,
    expert_intermediate_size=32, max_position_embeddings=64,
)  # fmt: skip
F32 = 4
ACT = B * T * CONFIG.hidden_size * F32  # one [B, T, H] fp32 activation
N, K, L_ = B * T, CONFIG.top_k, CONFIG.num_layers


def _saved_bytes(setting) -> int:
    torch.manual_seed(0)
    model = Mula(CONFIG)
    model.set_activation_checkpointing(setting)
    ids = torch.randint(0, CONFIG.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(1))
    with SavedTensorMeter(exclude=model.parameters()) as meter:
        out = model(ids[:, :-1])
        F.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten())
    return meter.bytes


@pytest.fixture(scope="module")
def saved() -> dict[str, int]:
    return {str(s): _saved_bytes(s) for s in ("none", "full", ["moe"], ["attention"], ["norms"])}


def test_full_keeps_one_block_input_per_layer(saved) -> None:
    logits = B * T * CONFIG.vocab_size * F32  # cross-entropy's log-softmax
    # head: final norm input, its normalised output and lm_head's input; small: the ids, targets,
    # the norm's rstd and the RoPE tables (checkpoint inputs shared by every block)
    small = 2 * B * (T + 1) * 8 + B * T * F32 + 2 * T * CONFIG.head_size * F32
    assert L_ * ACT + logits <= saved["full"] <= L_ * ACT + 3 * ACT + logits + small + 64
    assert saved["full"] < saved["none"] / 4


def test_moe_drops_the_expert_activations(saved) -> None:
    # per layer, the experts alone save their input rows, gate and up outputs and the SwiGLU product
    experts = N * K * (CONFIG.hidden_size + 3 * CONFIG.expert_intermediate_size) * F32
    assert saved["none"] - saved["['moe']"] >= L_ * experts


def test_attention_drops_its_internals(saved) -> None:
    # per layer, SDPA's q, k, v and the output projection's input (the block input is saved anyway)
    assert saved["none"] - saved["['attention']"] >= L_ * 4 * ACT


def test_norms_drop_their_normalised_outputs(saved) -> None:
    # per layer and norm, the normalised activation multiplied by the weight
    assert saved["none"] - saved["['norms']"] >= L_ * 2 * ACT


def test_meter_reports_the_peak_of_bytes_held() -> None:
    """A saved storage counts while autograd holds it: its backward, or its graph being freed, ends it.
    So micro-batches run one after the other peak at one's bytes, overlapping ones (a pipeline
    schedule's) at their sum; views of one storage count once."""
    x = torch.randn(1000, requires_grad=True)  # excluded, as the parameters are
    one = 1000 * F32  # exp saves its output
    with SavedTensorMeter(exclude=[x]) as meter:
        for _ in range(3):
            x.exp().sum().backward()
        assert meter.bytes == one
        a, b = x.exp(), x.exp()
        assert meter.bytes == 2 * one
        del a, b  # freed without a backward
        c = x.exp()
        c[:500].sin().sum().backward()  # sin saves a view of c's storage: no new bytes
        assert meter.bytes == 2 * one
        held = [x.exp() for _ in range(3)]
        assert meter.bytes == 3 * one
    assert x.grad is not None and len(held) == 3
    with SavedTensorMeter(exclude=[x]) as again:  # a new window
        x.exp()
    assert again.bytes == one


def test_param_and_grad_bytes_are_exact_sums() -> None:
    config = MulaConfig.from_name("mula-tiny-dense", vocab_size=64, hidden_size=16, num_layers=1, num_heads=2,
                                  intermediate_size=32, tie_embeddings=True)  # fmt: skip
    model = Mula(config)
    expected = sum(p.numel() * 4 for p in model.parameters())  # tied embedding counted once
    assert param_bytes(model) == expected
    assert grad_bytes(model) == 0
    model(torch.randint(0, 64, (1, 8))).logits.sum().backward()
    assert grad_bytes(model) == expected
    model.half()
    assert param_bytes(model) == expected // 2

    class Sharded:  # an optimizer that counts its bytes (`OptimizerBytes`)
        def param_bytes(self) -> int:
            return 0

        def grad_buffer_bytes(self) -> int:
            return 123

        def state_bytes(self) -> int:
            return 0

    assert grad_bytes(model, Sharded()) == 123


def _fit(tmp_path, callbacks: list, log_every: int = 2) -> tuple[list[dict], MulaLightningModule]:
    ids = torch.randint(0, CONFIG.vocab_size, (8, T + 1), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(
        TensorDataset(ids), batch_size=2, collate_fn=lambda rows: torch.stack([r[0] for r in rows])
    )
    torch.manual_seed(0)
    module = MulaLightningModule(CONFIG, warmup_steps=1, activation_checkpointing=["moe"])
    trainer = L.Trainer(
        max_steps=4, accelerator="cpu", logger=CSVLogger(tmp_path, name="run"), callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        log_every_n_steps=log_every, accumulate_grad_batches=2, default_root_dir=tmp_path, max_epochs=-1,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)
    with open(trainer.logger.log_dir + "/metrics.csv") as f:
        return list(csv.DictReader(f)), module


def test_callback_logs_on_logged_steps_only_and_keeps_numerics(tmp_path, monkeypatch) -> None:
    entered = []
    original = SavedTensorMeter.__enter__
    monkeypatch.setattr(SavedTensorMeter, "__enter__", lambda self: entered.append(1) or original(self))
    rows, module = _fit(tmp_path / "a", [MemoryMetrics()])
    plain_rows, plain = _fit(tmp_path / "b", [])
    assert len(entered) == 2 * 2  # 2 logged steps (of 4) x 2 micro-batches
    logged = [r for r in rows if r.get("mem/param_bytes")]
    assert [int(r["step"]) for r in logged] == [1, 3]
    for row in logged:
        assert float(row["mem/param_bytes"]) == param_bytes(module)
        assert float(row["mem/grad_bytes"]) == param_bytes(module)  # every parameter has an fp32 grad
        assert float(row["mem/activation_bytes"]) > 0
        assert "mem/peak_allocated_bytes" not in row  # CPU: no allocator peak
    losses = [r["train/loss"] for r in rows if r.get("train/loss")]
    assert losses == [r["train/loss"] for r in plain_rows if r.get("train/loss")]
    for (name, p), q in zip(module.model.named_parameters(), plain.model.parameters()):
        assert torch.equal(p, q), name
