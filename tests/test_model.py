"""The Mula model: shapes, causality, GQA, router losses, meta-device build."""

import pytest
import torch
import torch.nn.functional as F

from mula import Mula, MulaConfig
from mula.model.moe import MoELayer


def tiny(**kw) -> MulaConfig:
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


DENSE = {"num_experts": 0, "norm": "layernorm", "qk_norm": False}


@pytest.mark.parametrize("kw", [{}, DENSE, {"num_kv_heads": 2}, {"head_dim": 16}, {"tie_embeddings": True}])
def test_shapes_and_outputs(kw):
    torch.manual_seed(0)
    cfg = tiny(**kw)
    model = Mula(cfg)
    out = model(torch.randint(0, 96, (3, 10)))
    assert out.logits.shape == (3, 10, 96)
    assert out.aux_loss.shape == () and out.z_loss.shape == ()
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    if cfg.is_moe:
        assert out.tokens_per_expert.shape == (2, 6)
        assert out.tokens_per_expert.sum(1).tolist() == [3 * 10 * 2] * 2
        assert out.aux_loss > 0 and out.z_loss > 0
        assert isinstance(model.layers[0].mlp, MoELayer)
    else:
        assert out.tokens_per_expert is None
        assert out.aux_loss.item() == 0 and out.z_loss.item() == 0


@pytest.mark.parametrize("kw", [{}, DENSE, {"num_kv_heads": 1}])
def test_causal(kw):
    torch.manual_seed(0)
    model = Mula(tiny(**kw)).eval()
    x = torch.randint(0, 96, (2, 12))
    y = x.clone()
    y[:, 7] = (y[:, 7] + 1) % 96
    a, b = model(x).logits, model(y).logits
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-4  # and the change does propagate forward


def test_gqa_equals_mha_with_repeated_kv_heads():
    """A GQA model is an MHA model whose k/v heads (and k_norm weights) are repeated per group."""
    torch.manual_seed(0)
    gqa = Mula(tiny(num_kv_heads=2)).eval()
    with torch.no_grad():  # non-trivial norm weights so the k_norm mapping is exercised
        for name, p in gqa.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))

    def repeat(w):  # [2 kv heads * 8, ...] -> [4 heads * 8, ...]
        return w.view(2, 8, *w.shape[1:]).repeat_interleave(2, dim=0).reshape(-1, *w.shape[1:])

    kv_keys = ("k_proj", "v_proj", "k_norm")
    sd = {k: repeat(v) if any(s in k for s in kv_keys) else v for k, v in gqa.state_dict().items()}
    mha = Mula(tiny()).eval()
    mha.load_state_dict(sd)
    x = torch.randint(0, 96, (2, 9))
    torch.testing.assert_close(gqa(x).logits, mha(x).logits, atol=1e-5, rtol=1e-5)


def test_aux_and_z_loss_are_layer_means():
    torch.manual_seed(0)
    model = Mula(tiny())
    with torch.no_grad():
        model.layers[0].mlp.router.weight.zero_()  # uniform router: aux = top_k, z = log(E)^2
    x = torch.randint(0, 96, (2, 8))
    per_layer = []
    h = model.embed(x)
    from mula.model.transformer import rope_cos_sin

    cos, sin = rope_cos_sin(model.config, 8, h.device)
    for block in model.layers:
        h, stats = block(h, cos, sin)
        per_layer.append(stats)
    assert per_layer[0].aux_loss.item() == pytest.approx(2.0)
    assert per_layer[0].z_loss.item() == pytest.approx(torch.log(torch.tensor(6.0)).item() ** 2)
    out = model(x)
    assert out.aux_loss.item() == pytest.approx((per_layer[0].aux_loss + per_layer[1].aux_loss).item() / 2)
    assert out.z_loss.item() == pytest.approx((per_layer[0].z_loss + per_layer[1].z_loss).item() / 2)


def test_dense_first_blocks_and_router_losses_over_the_moe_blocks_only():
    """num_dense_layers=1: block 0 has the dense SwiGLU, the others an MoE layer; the router losses are
    the means over the MoE blocks (not over every block) and the counts have one row per MoE block."""
    from mula.model.transformer import MLP, rope_cos_sin

    torch.manual_seed(0)
    cfg = tiny(num_layers=3, num_dense_layers=1)
    model = Mula(cfg)
    assert isinstance(model.layers[0].mlp, MLP) and model.layers[0].mlp.up_proj.out_features == 48
    assert all(isinstance(b.mlp, MoELayer) for b in list(model.layers)[1:])
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    x = torch.randint(0, 96, (2, 8))
    h = model.embed(x)
    cos, sin = rope_cos_sin(cfg, 8, h.device)
    per_layer = []
    for block in model.layers:
        h, stats = block(h, cos, sin)
        per_layer.append(stats)
    assert per_layer[0] is None
    out = model(x)
    torch.testing.assert_close(out.logits, model.lm_head(model.norm(h)))
    aux = (per_layer[1].aux_loss + per_layer[2].aux_loss) / 2
    z = (per_layer[1].z_loss + per_layer[2].z_loss) / 2
    torch.testing.assert_close(out.aux_loss, aux, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.z_loss, z, rtol=1e-6, atol=0)
    assert out.tokens_per_expert.tolist() == [s.tokens_per_expert.tolist() for s in per_layer[1:]]


@pytest.mark.parametrize("kw", [{}, {"num_layers": 3, "num_dense_layers": 1}])
def test_backward_reaches_every_parameter(kw):
    torch.manual_seed(0)
    model = Mula(tiny(**kw))
    x = torch.randint(0, 96, (2, 8))
    out = model(x)
    loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, 96), x[:, 1:].reshape(-1)) + 0.01 * out.aux_loss
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_meta_build_and_materialise():
    with torch.device("meta"):
        big = Mula(MulaConfig.from_name("mula-220b-a10b"))
    assert big.lm_head.weight.is_meta
    for kw in ({}, {"tie_embeddings": True}):
        cfg = tiny(**kw)
        with torch.device("meta"):
            model = Mula(cfg)
        model.to_empty(device="cpu")
        model.reset_parameters()
        assert (model.lm_head.weight is model.embed.weight) == cfg.tie_embeddings
        w = model.layers[0].mlp.experts.gate_up
        assert torch.isfinite(w).all() and abs(w.std().item() - 0.02) < 0.003 and w.abs().max() <= 0.06 + 1e-6
        assert torch.equal(model.layers[0].attn_norm.weight, torch.ones(32))
        assert torch.isfinite(model(torch.randint(0, 96, (1, 4))).logits).all()


def test_too_long_sequence():
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Mula(tiny())(torch.zeros(1, 33, dtype=torch.long))
