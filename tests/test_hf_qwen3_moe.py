"""Mula vs transformers' Qwen3-MoE on the same weights: logits both ways, files both ways, config mapping,
and a `save_pretrained` directory imported with `mula import-hf`, trained and exported with `mula export-hf`."""

from __future__ import annotations

import json

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader

transformers = pytest.importorskip("transformers")

from test_hf import randomize  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from mula import Mula, MulaConfig  # noqa: E402
from mula.checkpoint import save_weights  # noqa: E402
from mula.cli import main  # noqa: E402
from mula.hf import config_from_hf, config_to_hf, export_hf, from_hf, import_hf, to_hf  # noqa: E402
from mula.training.module import MulaLightningModule  # noqa: E402

PRESET = "qwen3-moe-tiny"
VARIANTS = {  # the preset, and with a dense first block (mlp_only_layers=[0]), a tied head and no GQA
    "preset": {},
    "dense-first-tied": {"num_dense_layers": 1, "tie_embeddings": True, "num_kv_heads": None, "top_k": 2},
}


def random_mula(overrides: dict) -> Mula:
    """The tiny preset with every weight random (norm weights around 1, not exactly 1)."""
    torch.manual_seed(0)
    return randomize(Mula(MulaConfig.from_name(PRESET, **overrides)).eval(), std=0.1)


def ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 33), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.no_grad()
def test_logits_match_transformers_both_ways(variant):
    mula = random_mula(VARIANTS[variant])
    x = ids(mula.config.vocab_size)
    ours = mula(x).logits
    assert ours.abs().max() > 1  # the weights are large enough for a mismatch to show
    hf = to_hf(mula)
    assert type(hf) is Qwen3MoeForCausalLM
    assert hf.config.head_dim == 64 and hf.config.mlp_only_layers == list(range(mula.config.num_dense_layers))
    assert max_diff(hf(x).logits, ours) <= 1e-4
    back = from_hf(hf)
    assert back.config.architecture() == mula.config.architecture()
    assert max_diff(back(x).logits, ours) <= 1e-4


@torch.no_grad()
def test_from_a_transformers_model_and_its_aux_loss():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    cfg = Qwen3MoeConfig(
        vocab_size=256, hidden_size=48, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True, rope_theta=5000.0, mlp_only_layers=[0], rms_norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(1)
    hf = randomize(Qwen3MoeForCausalLM(cfg).eval())
    x = ids(256, 1)
    out = hf(x, output_router_logits=True)
    mula = from_hf(hf)
    assert (mula.config.num_dense_layers, mula.config.head_size, mula.config.rope_theta) == (1, 16, 5000.0)
    ours = mula(x)
    assert max_diff(ours.logits, out.logits) <= 1e-4
    # transformers' aux loss over the MoE layers' logits, per layer then averaged, is Mula's
    per_layer = [load_balancing_loss_func((lg,), 6, 2) for lg in out.router_logits if lg is not None]
    assert len(per_layer) == 2
    torch.testing.assert_close(ours.aux_loss, torch.stack(per_layer).mean(), atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_files_both_ways(tmp_path):
    """Mula weights -> `export_hf` (per-expert files) -> transformers' from_pretrained -> `import_hf`."""
    mula = random_mula(VARIANTS["dense-first-tied"])
    x = ids(mula.config.vocab_size, 2)
    ref = mula(x).logits
    save_weights(mula, tmp_path / "w.pt")
    export_hf(tmp_path / "w.pt", tmp_path / "hf", max_shard_bytes=2_000_000)  # several shards
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["moe_intermediate_size"] == 64
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded) is Qwen3MoeForCausalLM
    assert max_diff(loaded(x).logits, ref) <= 1e-4
    again = import_hf(tmp_path / "hf", tmp_path / "again.pt")
    assert max_diff(again(x).logits, ref) <= 1e-4


def test_save_pretrained_imports_trains_and_exports(tmp_path):
    """`mula import-hf` of a `save_pretrained` directory, a few training steps from it (`init_weights`),
    then `mula export-hf` of the trained checkpoint, which transformers loads with the trained logits."""
    torch.manual_seed(2)
    hf = to_hf(random_mula({}))
    hf.save_pretrained(tmp_path / "hf")
    main(["import-hf", "--hf_dir", str(tmp_path / "hf"), "--output", str(tmp_path / "w.pt")])
    vocab = hf.config.vocab_size
    batch = ids(vocab, 3)
    module = MulaLightningModule(
        PRESET, init_weights=str(tmp_path / "w.pt"), lr=3e-3, min_lr=3e-3, warmup_steps=0, decay_steps=10
    )
    module.configure_model()
    with torch.no_grad():  # the imported weights compute transformers' logits
        first = hf(batch[:, :-1]).logits
        assert max_diff(module.model(batch[:, :-1]).logits, first) <= 1e-4
    trainer = L.Trainer(
        accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer.callbacks.append(Record())
    trainer.fit(module, DataLoader([b for b in batch] * 4, batch_size=2))
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    trainer.save_checkpoint(tmp_path / "trained.ckpt")
    main(["export-hf", "--ckpt", str(tmp_path / "trained.ckpt"), "--output", str(tmp_path / "out")])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    module.model.eval()
    with torch.no_grad():
        assert max_diff(loaded(batch).logits, module.model(batch).logits) <= 1e-4


def test_config_mapping_and_refusals():
    d = config_to_hf(MulaConfig.from_name("qwen3-235b-a22b"))
    assert (d["hidden_size"], d["num_hidden_layers"], d["head_dim"], d["moe_intermediate_size"]) == (
        4096, 94, 128, 1536,
    )  # fmt: skip
    assert config_from_hf(d, name="qwen3-235b-a22b") == MulaConfig.from_name("qwen3-235b-a22b")
    base = {**d, "num_hidden_layers": 4}
    with pytest.raises(ValueError, match=r"make blocks \[0, 2\] dense.*cannot express"):
        config_from_hf({**base, "decoder_sparse_step": 2})
    with pytest.raises(ValueError, match=r"make blocks \[1\] dense"):
        config_from_hf({**base, "mlp_only_layers": [1]})
    assert config_from_hf({**base, "mlp_only_layers": [0, 1]}).num_dense_layers == 2
    with pytest.raises(ValueError, match="attention_bias=True is not supported"):
        config_from_hf({**base, "attention_bias": True})
    with pytest.raises(ValueError, match="use_sliding_window=True is not supported"):
        config_from_hf({**base, "use_sliding_window": True})
    with pytest.raises(ValueError, match="RoPE scaling type 'yarn'"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    qwen = MulaConfig.from_name(PRESET)
    with pytest.raises(ValueError, match="Qwen3-MoE routes by a softmax.*router_scoring='sigmoid'"):
        config_to_hf(MulaConfig.from_name(PRESET, router_scoring="sigmoid"))
    model = Mula(MulaConfig.from_name(PRESET, num_layers=1, router_bias_update_rate=1e-3))
    with torch.no_grad():
        model.layers[0].mlp.router.bias[0] = 0.5
    with pytest.raises(ValueError, match="transformers' Qwen3-MoE cannot express a router bias"):
        to_hf(model)
    assert qwen.architecture_differences(MulaConfig.from_name(PRESET, qk_norm_per_head=False)) == [
        "qk_norm_per_head: False vs True"
    ]
    with pytest.raises(ValueError, match="qk_norm_per_head=True needs qk_norm=True"):
        MulaConfig.from_name(PRESET, qk_norm=False)
