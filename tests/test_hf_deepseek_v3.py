"""Mula vs transformers' DeepSeek-V3 on the same random weights: logits both ways, files both ways, and a
`save_pretrained` directory that imports and trains."""

import json

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

transformers = pytest.importorskip("transformers")

from test_hf import randomize
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from mula import Mula, MulaConfig
from mula.checkpoint import save_weights
from mula.hf import config_from_hf, config_to_hf, export_hf, from_hf, import_hf, to_hf
from mula.training.module import MulaLightningModule

TINY = "deepseek-v3-tiny"
VARIANTS = {  # the tiny preset, and DeepSeek-V2-Lite / Moonlight's plain q projection without groups
    "tiny": {},
    "no-q-latent": {"q_lora_rank": None, "n_group": 1, "topk_group": 1, "num_shared_experts": 2},
}


def randomize_all(model: torch.nn.Module, seed: int) -> None:
    """test_hf's `randomize` (norms around 1, the rest normal), and the router biases random too."""
    torch.manual_seed(seed)
    randomize(model, std=0.1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith(("router.bias", "e_score_correction_bias")):
                b.copy_(0.05 * torch.randn_like(b))


def random_mula(variant: str) -> Mula:
    model = Mula(MulaConfig.from_name(TINY, **VARIANTS[variant])).eval()
    randomize_all(model, 0)
    return model


def random_hf(variant: str) -> DeepseekV3ForCausalLM:
    d = {
        k: v
        for k, v in config_to_hf(MulaConfig.from_name(TINY, **VARIANTS[variant])).items()
        if k != "torch_dtype"
    }
    model = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict(d)).eval()
    randomize_all(model, 1)
    return model


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 4096, (2, 33), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.no_grad()
def test_logits_match_transformers_both_ways(variant):
    x = ids()
    mula = random_mula(variant)
    ours = mula(x).logits
    assert ours.abs().max() > 1  # the weights are large enough for a mismatch to show
    hf = to_hf(mula)
    assert type(hf) is DeepseekV3ForCausalLM
    assert max_diff(hf(x).logits, ours) <= 1e-4
    # the other way: transformers' own random model into Mula
    hf = random_hf(variant)
    ref = hf(x).logits
    back = from_hf(hf).eval()
    assert back.config.architecture() == MulaConfig.from_name(TINY, **VARIANTS[variant]).architecture()
    assert max_diff(back(x).logits, ref) <= 1e-4
    assert max_diff(to_hf(back)(x).logits, ref) <= 1e-4


@torch.no_grad()
def test_export_then_transformers_from_pretrained_and_import_back(tmp_path):
    mula = random_mula("tiny")
    x = ids(2)
    ref = mula(x).logits
    save_weights(mula, tmp_path / "mula.pt")
    export_hf(tmp_path / "mula.pt", tmp_path / "hf", max_shard_bytes=2_000_000)  # several shards
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["num_nextn_predict_layers"] == 0
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded) is DeepseekV3ForCausalLM
    assert max_diff(loaded(x).logits, ref) <= 1e-4
    again = import_hf(tmp_path / "hf", tmp_path / "again.pt")
    assert max_diff(again(x).logits, ref) <= 1e-4
    assert torch.equal(again.layers[1].mlp.router.bias, mula.layers[1].mlp.router.bias)


def test_save_pretrained_imports_and_trains(tmp_path):
    hf = random_hf("tiny")
    hf.save_pretrained(tmp_path / "hf")
    # a multi-token prediction module's weights after the last block, as the published checkpoints carry
    # (model.layers.61.* there): not Mula's model, skipped on import
    from safetensors.torch import load_file, save_file

    path = tmp_path / "hf" / "model.safetensors"
    state = load_file(path)
    state["model.layers.4.eh_proj.weight"] = torch.zeros(128, 256)
    save_file(state, path, metadata={"format": "pt"})
    model = import_hf(tmp_path / "hf", tmp_path / "w.pt")
    x = ids(3)
    with torch.no_grad():
        assert max_diff(model(x).logits, hf(x).logits) <= 1e-4
    module = MulaLightningModule(
        model.config, init_weights=str(tmp_path / "w.pt"), lr=1e-3, warmup_steps=1, decay_steps=4
    )
    data = [torch.randint(0, 4096, (17,), generator=torch.Generator().manual_seed(i)) for i in range(8)]
    loader = DataLoader(data, batch_size=2, collate_fn=torch.stack)
    trainer = L.Trainer(
        max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)
    assert trainer.global_step == 4
    trained = dict(module.model.named_parameters())
    assert set(trained) == {name for name, _ in model.named_parameters()}
    for name, p in trained.items():
        assert torch.isfinite(p).all(), name
    assert max_diff(trained["layers.2.attn.kv_b_proj.weight"], model.layers[2].attn.kv_b_proj.weight) > 0


def test_refusals():
    base = config_to_hf(MulaConfig.from_name(TINY))
    for change, match in (
        ({"rope_scaling": {"rope_type": "yarn", "factor": 40.0}}, "RoPE scaling type 'yarn'"),
        ({"rope_interleave": False}, "rope_interleave=False"),
        ({"attention_bias": True}, "attention_bias"),
        ({"n_shared_experts": 0}, "n_shared_experts=0"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ):
        with pytest.raises(ValueError, match=match):
            config_from_hf({**base, **change})
    with pytest.raises(ValueError, match="router_scoring='sigmoid'"):
        config_to_hf(MulaConfig.from_name(TINY, router_scoring="softmax", n_group=1, topk_group=1))
    with pytest.raises(ValueError, match="no shared experts"):
        config_to_hf(MulaConfig.from_name("mula-tiny-moe", num_shared_experts=1))


def test_mtp_modules_export_and_import_exactly(tmp_path):
    """A model with DeepSeek-V3's multi-token prediction module exports it under the checkpoints' names
    (layer num_layers: its block, enorm, hnorm, eh_proj, shared_head.norm, and the copies of the embedding
    and head), transformers still loads the export (its model ignores the module), and the import brings
    back every weight exactly; copies that are not the model's are refused."""
    from safetensors.torch import load_file, save_file

    mula = Mula(MulaConfig.from_name(TINY, mtp_depth=1)).eval()
    randomize_all(mula, 4)
    save_weights(mula, tmp_path / "mula.pt")
    export_hf(tmp_path / "mula.pt", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    state = load_file(tmp_path / "hf" / "model.safetensors")
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "mlp.gate", "self_attn.kv_b_proj"):
        assert f"model.layers.4.{name}.weight" in state, name
    assert torch.equal(state["model.layers.4.embed_tokens.weight"], mula.embed.weight)
    assert torch.equal(state["model.layers.4.shared_head.head.weight"], mula.lm_head.weight)
    x = ids(5)
    with torch.no_grad():
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
        assert max_diff(loaded(x).logits, mula(x).logits) <= 1e-4
    again = import_hf(tmp_path / "hf", tmp_path / "again.pt")
    assert again.config.mtp_depth == 1
    ours, back = mula.state_dict(), again.state_dict()
    assert ours.keys() == back.keys() and all(torch.equal(ours[k], back[k]) for k in ours)
    # in memory: transformers' model holds no MTP module, so none comes back
    assert from_hf(to_hf(mula)).config.mtp_depth == 0
    # a module's head copy that is not the model's head
    state["model.layers.4.shared_head.head.weight"] = state["lm_head.weight"] + 1
    save_file(state, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="shared_head.head.weight is not the model's lm_head.weight"):
        import_hf(tmp_path / "hf", tmp_path / "bad.pt")


@torch.no_grad()
def test_mtp_logits_match_transformers_mtp_layer():
    """Mula's MTP module computes what transformers' own `MtpLayer` (its speculative-decoding MTP, built
    on the DeepSeek-V3 model) computes from the exported weights: the checkpoint names mean what Mula
    makes of them (enorm on the embedding, hnorm on the previous depth's normed state, shared_head.norm
    after the block)."""
    layers = pytest.importorskip("transformers.modeling_layers")
    if not hasattr(layers, "MtpModel"):
        pytest.skip("this transformers has no MtpModel")
    from mula.hf.weights import iter_hf_tensors
    from mula.model.mtp import shifted_ids

    mula = Mula(MulaConfig.from_name(TINY, mtp_depth=1)).eval()
    randomize_all(mula, 6)
    hf = to_hf(mula)
    mtp = layers.MtpModel(hf, 1).eval()
    prefix, own = f"model.layers.{mula.config.num_layers}.", ("enorm.", "hnorm.", "eh_proj.")
    state = {}
    for name, value in iter_hf_tensors(mula.config, mula.state_dict(), fused_experts=True):
        rest = name.removeprefix(prefix)
        if rest == name or rest.startswith(("embed_tokens.", "shared_head.head.")):
            continue  # the main model's, or the copies of the shared embedding and head
        if rest == "shared_head.norm.weight":
            state["layers.0.post_norm.weight"] = value
        else:
            state["layers.0." + (rest if rest.startswith(own) else "mtp_block." + rest)] = value
    missing, unexpected = mtp.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) == {"embed_tokens.weight", "shared_head.weight"}  # tied to hf's
    batch = ids(7)
    x, ahead = batch[:, :-1], shifted_ids(batch, 1)
    ours = mula(x, [ahead]).mtp_logits[0]
    positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
    theirs = mtp._project_to_logits(
        mtp.forward_layer(0, hf.model(x).last_hidden_state, positions, None, input_ids=ahead)
    )
    assert ours.abs().max() > 1
    assert max_diff(theirs, ours) <= 1e-4
