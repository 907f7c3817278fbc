"""MulaLightningModule: loss, optimizer groups, schedule, checkpoint contents, throughput callback."""

from __future__ import annotations

import copy
import csv
import dataclasses
import math

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from callbacks.throughput import PEAK_BF16_FLOPS, Throughput, peak_bf16_flops
from mula import Mula, MulaConfig
from mula.training.module import MulaLightningModule, load_imbalance, warmup_cosine

TINY = {"num_layers": 2, "hidden_size": 32, "num_heads": 2, "vocab_size": 64, "num_experts": 4, "top_k": 2,
        "expert_intermediate_size": 32, "max_position_embeddings": 64}  # fmt: skip


def tiny_module(**kwargs) -> MulaLightningModule:
    torch.manual_seed(0)
    module = MulaLightningModule("mula-tiny-moe", overrides={**TINY, **kwargs.pop("overrides", {})}, **kwargs)
    module.configure_model()
    return module


def random_batch(b: int = 2, t: int = 16, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t + 1), generator=torch.Generator().manual_seed(1))


def test_unknown_preset_and_field_raise_value_error():
    with pytest.raises(ValueError, match="Unknown Mula preset"):
        MulaLightningModule("mula-3b")
    with pytest.raises(ValueError, match="Unknown MulaConfig field"):
        MulaLightningModule("mula-tiny-moe", overrides={"num_layer": 2})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MulaLightningModule("mula-tiny-moe", init_weights="/nonexistent/weights.pt")


def test_config_object_and_overrides_resolve():
    cfg = MulaConfig.from_name("mula-tiny-dense")
    module = MulaLightningModule(cfg, overrides={"num_layers": 1})
    assert module.config == dataclasses.replace(cfg, num_layers=1)
    assert module.hparams["config"] == dataclasses.asdict(cfg)  # plain data, not a dataclass


def test_loss_is_ce_plus_weighted_router_losses():
    module = tiny_module(overrides={"router_aux_loss_coef": 0.5, "router_z_loss_coef": 0.25})
    batch = random_batch()
    loss, ce, _ = module._losses(batch)
    ref = module.model(batch[:, :-1])
    ref_ce = F.cross_entropy(ref.logits.reshape(-1, 64), batch[:, 1:].reshape(-1))
    torch.testing.assert_close(ce, ref_ce)
    torch.testing.assert_close(loss, ref_ce + 0.5 * ref.aux_loss + 0.25 * ref.z_loss)
    assert ref.aux_loss > 0 and ref.z_loss > 0  # the router terms are really there


def test_flops_per_batch_from_config():
    module = tiny_module()
    assert module.flops_per_batch is None
    module._losses(random_batch(b=3, t=16))
    assert module.tokens_per_batch == 48
    assert module.flops_per_batch == module.config.flops_per_token(16) * 48


def test_warmup_cosine_schedule_values():
    kw = {"lr": 4e-4, "min_lr": 4e-5, "warmup_steps": 100, "decay_steps": 1100}
    assert warmup_cosine(0, **kw) == pytest.approx(4e-5)  # linear from the minimum
    assert warmup_cosine(50, **kw) == pytest.approx(4e-5 + 0.5 * 3.6e-4)
    assert warmup_cosine(100, **kw) == pytest.approx(4e-4)
    assert warmup_cosine(600, **kw) == pytest.approx(4e-5 + 3.6e-4 * 0.5)  # half-way down the cosine
    assert warmup_cosine(350, **kw) == pytest.approx(4e-5 + 3.6e-4 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert warmup_cosine(1100, **kw) == pytest.approx(4e-5)
    assert warmup_cosine(5000, **kw) == pytest.approx(4e-5)


def test_optimizer_matches_reference_adamw_with_embedding_excluded_from_decay():
    module = tiny_module(lr=1e-2, min_lr=1e-3, warmup_steps=2, decay_steps=6, weight_decay=0.1, betas=(0.8, 0.9),
                         eps=1e-6)  # fmt: skip
    reference = copy.deepcopy(module.model)
    module.trainer = None  # decay_steps is explicit: no Trainer needed
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    names = {id(p): n for n, p in module.model.named_parameters()}
    no_decay = [names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0.0 for p in g["params"]]
    assert no_decay == ["embed.weight"]

    decay = [p for n, p in reference.named_parameters() if n != "embed.weight"]
    ref_opt = torch.optim.AdamW(
        [{"params": decay}, {"params": [reference.embed.weight], "weight_decay": 0.0}],
        lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1,
    )  # fmt: skip
    for step in range(4):
        batch = random_batch()
        expected_lr = warmup_cosine(step, lr=1e-2, min_lr=1e-3, warmup_steps=2, decay_steps=6)
        assert opt.param_groups[0]["lr"] == pytest.approx(expected_lr)
        for g in ref_opt.param_groups:
            g["lr"] = expected_lr
        for model, optimizer in ((module.model, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            out = model(batch[:, :-1])
            F.cross_entropy(out.logits.reshape(-1, 64), batch[:, 1:].reshape(-1)).backward()
            optimizer.step()
        sched.step()
    for (name, p), q in zip(module.model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_load_imbalance():
    counts = torch.tensor([[4, 4, 4, 4], [8, 0, 0, 8]])
    torch.testing.assert_close(load_imbalance(counts), torch.tensor((1.0 + 2.0) / 2))


def test_init_weights_loads_and_checks_architecture(tmp_path):
    from mula.checkpoint import save_weights

    source = Mula(MulaConfig.from_name("mula-tiny-moe", **TINY))
    save_weights(source, tmp_path / "w.pt")
    module = tiny_module(init_weights=str(tmp_path / "w.pt"))
    for (name, p), q in zip(module.model.state_dict().items(), source.state_dict().values()):
        torch.testing.assert_close(p, q, msg=name)
    wrong = MulaLightningModule(
        "mula-tiny-moe", overrides={**TINY, "num_layers": 3}, init_weights=str(tmp_path / "w.pt")
    )
    with pytest.raises(ValueError, match="different architecture .*num_layers: 2 vs 3"):
        wrong.configure_model()


def test_init_weights_ignores_training_settings(tmp_path):
    """Only the architecture must match: other loss weights, init or kernels load; another width does not."""
    from mula.checkpoint import save_weights

    save_weights(Mula(MulaConfig.from_name("mula-tiny-moe", **TINY)), tmp_path / "w.pt")
    training = {
        "router_z_loss_coef": 0.05,
        "router_aux_loss_coef": 0.0,
        "init_std": 0.1,
        "expert_backend": "torch",
    }
    tiny_module(overrides=training, init_weights=str(tmp_path / "w.pt"))  # loads
    wider = MulaLightningModule(
        "mula-tiny-moe", overrides={**TINY, "hidden_size": 64}, init_weights=str(tmp_path / "w.pt")
    )
    with pytest.raises(ValueError, match=r"different architecture than the model .*hidden_size: 32 vs 64"):
        wider.configure_model()


def test_fit_logs_metrics_checkpoint_has_config_and_loss_falls(tmp_path):
    """A few steps on one repeated batch through the real Trainer: metrics, checkpoint, falling loss."""
    data = random_batch(b=4, t=16).repeat(8, 1)
    loader = DataLoader(
        TensorDataset(data), batch_size=4, collate_fn=lambda rows: torch.stack([r[0] for r in rows])
    )
    module = MulaLightningModule("mula-tiny-moe", overrides=TINY, lr=1e-2, min_lr=1e-3, warmup_steps=2)
    trainer = L.Trainer(
        max_steps=16, accelerator="cpu", logger=CSVLogger(tmp_path, name="run"), callbacks=[Throughput(window=4)],
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, default_root_dir=tmp_path,
        limit_val_batches=2, val_check_interval=8, gradient_clip_val=1.0,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    metrics = trainer.logger.log_dir + "/metrics.csv"
    with open(metrics) as fh:
        rows = list(csv.DictReader(fh))
    keys = {k for r in rows for k, v in r.items() if v}
    assert {"train/loss", "train/ce_loss", "train/aux_loss", "train/z_loss", "train/lr", "moe/load_imbalance",
            "train/tokens_per_sec", "val/loss", "val/ppl"} <= keys  # fmt: skip
    assert "train/mfu" not in keys  # CPU: no peak FLOP/s, no MFU
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert losses[-1] < losses[0] - 0.5
    val = [(float(r["val/loss"]), float(r["val/ppl"])) for r in rows if r.get("val/loss")]
    assert val and all(ppl == pytest.approx(math.exp(v), rel=1e-4) for v, ppl in val)

    ckpt_path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt_path)
    ckpt = torch.load(ckpt_path, weights_only=True)  # hyperparameters are plain data
    assert ckpt["mula_config"] == dataclasses.asdict(module.config)
    assert all(k.startswith(("model.", "val_loss")) for k in ckpt["state_dict"])
    from mula.checkpoint import load_weights

    reloaded = load_weights(ckpt_path)
    for (name, p), q in zip(reloaded.state_dict().items(), module.model.state_dict().values()):
        torch.testing.assert_close(p, q, msg=name)


def test_peak_flops_table(monkeypatch):
    assert peak_bf16_flops(torch.device("cpu")) is None
    cases = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H200": 989e12,
             "AMD Instinct MI250X": 191.5e12, "Intel(R) Data Center GPU Max 1550": 419.4e12, "Tesla T4": None}  # fmt: skip
    for name, flops in cases.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_bf16_flops(torch.device("cuda", 0)) == flops, name
    assert all(v > 1e14 for v in PEAK_BF16_FLOPS.values())


def test_throughput_mfu_arithmetic(monkeypatch):
    """tokens/s and MFU from a fake clock: 2 batches of 1000 tokens and 1e12 FLOPs each in 2 s."""
    cb = Throughput(window=2, peak_flops=1e12)
    clock = iter([0.0, 1.0, 2.0])
    monkeypatch.setattr("callbacks.throughput.time.perf_counter", lambda: next(clock))
    logged = {}

    class FakeModule:
        device = torch.device("cpu")
        tokens_per_batch = 1000
        flops_per_batch = 1e12

        def log(self, key, value, **kwargs):
            logged[key] = value

    class FakeTrainer:
        world_size = 2
        strategy = None

    trainer, module = FakeTrainer(), FakeModule()
    cb.on_train_batch_start(trainer, module, None, 0)
    cb.on_train_batch_end(trainer, module, None, None, 0)
    cb.on_train_batch_start(trainer, module, None, 1)
    cb.on_train_batch_end(trainer, module, None, None, 1)
    assert logged["train/tokens_per_sec"] == pytest.approx(2 * 1000 * 2 / 2.0)
    assert logged["train/mfu"] == pytest.approx(2 * 1e12 * 2 / 2.0 / (1e12 * 2))
