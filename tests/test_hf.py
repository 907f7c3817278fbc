"""Mula vs transformers' OLMoE/OLMo on the same weights: logits, router loss, import/export files."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, OlmoConfig, OlmoeConfig, OlmoeForCausalLM, OlmoForCausalLM
from transformers.models.olmoe.modeling_olmoe import load_balancing_loss_func

from mula import Mula, MulaConfig
from mula.checkpoint import load_weights, save_weights
from mula.hf import export_hf, from_hf, import_hf, to_hf

COMMON = {
    "vocab_size": 128,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}

CASES = {
    "moe-top1-e4": (
        OlmoeForCausalLM,
        OlmoeConfig(**COMMON, intermediate_size=24, num_experts=4, num_experts_per_tok=1),
    ),
    "moe-top2-e6-gqa": (
        OlmoeForCausalLM,
        OlmoeConfig(
            **COMMON,
            intermediate_size=16,
            num_experts=6,
            num_experts_per_tok=2,
            num_key_value_heads=2,
            rope_theta=500.0,
        ),
    ),
    "moe-top3-e6-normtopk-tied": (
        OlmoeForCausalLM,
        OlmoeConfig(
            **COMMON,
            intermediate_size=16,
            num_experts=6,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
        ),
    ),
    "dense": (OlmoForCausalLM, OlmoConfig(**COMMON, intermediate_size=48)),
    "dense-gqa": (OlmoForCausalLM, OlmoConfig(**COMMON, intermediate_size=40, num_key_value_heads=1)),
}


def randomize(model: torch.nn.Module, std: float = 0.15) -> torch.nn.Module:
    """Every parameter of `model` random: norm weights around 1 (not exactly 1), the rest normal(0, std)."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, std)
    return model


def random_hf(name: str):
    """A transformers model with every parameter random (norm weights around 1, not exactly 1)."""
    torch.manual_seed(sum(map(ord, name)))
    cls, cfg = CASES[name]
    return randomize(cls(cfg).eval())


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", list(CASES))
@torch.no_grad()
def test_logits_match_transformers_both_ways(name):
    hf = random_hf(name)
    x = ids()
    ref = hf(x).logits
    assert ref.abs().max() > 1  # the weights are large enough for a mismatch to show
    mula = from_hf(hf).eval()
    assert isinstance(mula, Mula) and mula.config.is_moe == name.startswith("moe")
    assert max_diff(mula(x).logits, ref) < 1e-4
    back = to_hf(mula)
    assert type(back) is type(hf)
    assert max_diff(back(x).logits, ref) < 1e-4
    # conversion copies: changing the Mula model leaves the transformers model alone
    mula.embed.weight.add_(1)
    assert max_diff(hf(x).logits, ref) == 0


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("moe")])
@torch.no_grad()
def test_router_aux_loss_matches_transformers(name):
    hf = random_hf(name)
    x = ids(1)
    out = hf(x, output_router_logits=True)
    k, e = hf.config.num_experts_per_tok, hf.config.num_experts
    per_layer = [load_balancing_loss_func((logits,), e, k) for logits in out.router_logits]
    ours = from_hf(hf)(x)
    torch.testing.assert_close(ours.aux_loss, torch.stack(per_layer).mean(), atol=1e-6, rtol=1e-6)
    # the same counts transformers derives from its router logits
    counts = torch.stack(
        [torch.bincount(lg.topk(k, -1).indices.flatten(), minlength=e) for lg in out.router_logits]
    )
    assert torch.equal(ours.tokens_per_expert, counts)


@pytest.mark.parametrize("name", ["moe-top2-e6-gqa", "moe-top3-e6-normtopk-tied", "dense"])
@torch.no_grad()
def test_export_then_transformers_from_pretrained(tmp_path, name):
    hf = random_hf(name)
    x = ids(2)
    ref = hf(x).logits
    save_weights(from_hf(hf), tmp_path / "mula.pt")
    shard = 20_000 if name == "moe-top2-e6-gqa" else 5 * 1024**3  # force several shards once
    export_hf(tmp_path / "mula.pt", tmp_path / "hf", max_shard_bytes=shard)
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "config.json" in files and not list(tmp_path.glob(".tmp-*"))  # the temporary is gone
    assert ("model.safetensors.index.json" in files) == (shard == 20_000)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    if config["model_type"] == "olmoe":  # explicit, OLMoE-correct fields (HF defaults differ)
        assert config["intermediate_size"] == hf.config.intermediate_size
        assert config["router_aux_loss_coef"] == 0.01 and config["norm_topk_prob"] == hf.config.norm_topk_prob
        from safetensors import safe_open

        names = set()
        for f in files:
            if f.endswith(".safetensors"):
                with safe_open(tmp_path / "hf" / f, "pt") as fh:
                    names |= set(fh.keys())
        assert "model.layers.1.mlp.experts.5.up_proj.weight" in names  # per-expert layout on disk
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded) is type(hf)
    assert max_diff(loaded(x).logits, ref) < 1e-4
    # and import of our own export gives back the same Mula weights
    again = import_hf(tmp_path / "hf", tmp_path / "again.pt")
    assert max_diff(again(x).logits, ref) < 1e-4


@pytest.mark.parametrize("name", ["moe-top1-e4", "dense-gqa"])
@torch.no_grad()
def test_import_of_transformers_save_pretrained(tmp_path, name):
    hf = random_hf(name)
    hf.save_pretrained(tmp_path / "hf")
    x = ids(3)
    model = import_hf(tmp_path / "hf", tmp_path / "m.pt")
    assert max_diff(model(x).logits, hf(x).logits) < 1e-4
    assert max_diff(load_weights(tmp_path / "m.pt")(x).logits, hf(x).logits) < 1e-4


def test_bad_inputs(tmp_path):
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
    )
    with pytest.raises(ValueError, match="Unsupported Hugging Face architecture 'LlamaForCausalLM'"):
        from_hf(llama)
    llama.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="Unsupported Hugging Face architecture 'LlamaForCausalLM'"):
        import_hf(tmp_path / "llama", tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        import_hf(tmp_path / "nope", tmp_path / "out.pt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        import_hf(tmp_path / "empty", tmp_path / "out.pt")

    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_hf(tmp_path / "missing.pt", tmp_path / "x")
    (tmp_path / "junk.ckpt").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="is not a Mula checkpoint"):
        export_hf(tmp_path / "junk.ckpt", tmp_path / "x")
    assert not (tmp_path / "x").exists()

    model = Mula(
        MulaConfig(
            vocab_size=64,
            hidden_size=16,
            num_layers=1,
            num_heads=2,
            num_experts=2,
            top_k=1,
            expert_intermediate_size=8,
        )
    )
    save_weights(model, tmp_path / "m.pt")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("precious")
    with pytest.raises(ValueError, match="already exists"):
        export_hf(tmp_path / "m.pt", tmp_path / "taken")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "precious"
    with pytest.raises(ValueError, match="already exists"):
        import_hf(tmp_path / "llama", tmp_path / "m.pt")

    # configs transformers cannot express
    with pytest.raises(ValueError, match="OLMoE"):
        to_hf(Mula(MulaConfig.from_name("mula-tiny-moe", qk_norm=False, num_layers=1)))
    with pytest.raises(ValueError, match="OLMo"):
        to_hf(Mula(MulaConfig.from_name("mula-tiny-dense", norm="rmsnorm", num_layers=1)))
    dense_first = MulaConfig.from_name(
        "mula-tiny-moe", num_layers=2, num_dense_layers=1, intermediate_size=64
    )
    with pytest.raises(
        ValueError, match=r"first 1 block\(s\) are dense \(num_dense_layers\) cannot be exported"
    ):
        to_hf(Mula(dense_first))
    save_weights(Mula(dense_first), tmp_path / "dense_first.pt")
    with pytest.raises(ValueError, match="num_dense_layers"):
        export_hf(tmp_path / "dense_first.pt", tmp_path / "dense_first")
    assert not (tmp_path / "dense_first").exists()
    clipped = OlmoForCausalLM(OlmoConfig(**COMMON, intermediate_size=48, clip_qkv=8.0))
    with pytest.raises(ValueError, match="clip_qkv"):
        from_hf(clipped)
