"""Router scoring options (softmax | sigmoid, group-limited routing, scaling, renormalisation, the bias).

References: a per-token loop written from DeepSeek-V3's description (each token on its own, no
batching tricks), transformers' `DeepseekV3TopkRouter` / `DeepseekV3MoE` and `Qwen3MoeTopKRouter` on the
same weights. The defaults route exactly as before (OLMoE: softmax, no groups, factor 1).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mula import Mula, MulaConfig
from mula.model.moe import MoELayer, expert_counts, load_balancing_loss
from mula.model.moe.balancing import update_router_bias
from mula.model.moe.router import Router

H, E, K = 16, 16, 4


def reference_route(logits, bias, scoring, n_group, topk_group, top_k, norm, factor):
    """(chosen expert sets, weight by expert) per token, one token at a time."""
    chosen, weights = [], []
    for row in logits:
        scores = row.softmax(-1) if scoring == "softmax" else row.sigmoid()
        choice = scores + bias
        size = len(row) // n_group
        group_score = [sorted(choice[g * size : (g + 1) * size].tolist())[-2:] for g in range(n_group)]
        ranked = sorted(range(n_group), key=lambda g: -sum(group_score[g]))[:topk_group]
        allowed = [i for g in ranked for i in range(g * size, (g + 1) * size)]
        picked = sorted(allowed, key=lambda i: -float(choice[i].detach()))[:top_k]
        w = {i: float(scores[i]) for i in picked}
        total = sum(w.values())
        w = {i: (v / total if norm else v) * factor for i, v in w.items()}
        chosen.append(set(picked))
        weights.append(w)
    return chosen, weights


def _by_expert(route):
    return [dict(zip(i.tolist(), w.tolist())) for i, w in zip(route.topk_idx, route.topk_weight)]


CASES = [  # scoring, n_group, topk_group, norm, factor, bias
    ("softmax", 1, 1, False, 1.0, False),  # OLMoE
    ("softmax", 1, 1, True, 1.0, False),  # Qwen3-MoE
    ("sigmoid", 1, 1, True, 1.0, True),
    ("sigmoid", 4, 2, True, 2.5, True),  # DeepSeek-V3
    ("sigmoid", 8, 3, False, 1.5, False),
    ("softmax", 4, 1, True, 2.0, True),
]


@pytest.mark.parametrize("scoring, n_group, topk_group, norm, factor, bias", CASES)
def test_router_equals_a_per_token_reference(scoring, n_group, topk_group, norm, factor, bias):
    torch.manual_seed(0)
    router = Router(H, E, K, norm, use_bias=bias, scoring=scoring, n_group=n_group,
                    topk_group=topk_group, scaling_factor=factor)  # fmt: skip
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        if bias:
            router.bias.copy_(torch.randn(E) * 0.1)
    x = torch.randn(64, H)
    route = router(x)
    logits = x @ router.weight.t()
    torch.testing.assert_close(route.logits, logits)
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    torch.testing.assert_close(route.probs, scores / scores.sum(-1, keepdim=True))
    chosen, weights = reference_route(
        logits, router.bias if bias else torch.zeros(E), scoring, n_group, topk_group, K, norm, factor
    )
    assert [set(r.tolist()) for r in route.topk_idx] == chosen
    for got, want in zip(_by_expert(route), weights):
        assert got.keys() == want.keys()
        for i in want:
            assert got[i] == pytest.approx(want[i], rel=1e-5)
    if n_group > 1:  # the limit matters for this data: some token's unlimited top-k leaves its groups
        free = Router(H, E, K, norm, use_bias=bias, scoring=scoring, scaling_factor=factor)
        free.load_state_dict(router.state_dict())
        assert [set(r.tolist()) for r in free(x).topk_idx] != chosen


def test_weights_take_the_scores_gradient_and_the_choice_none():
    torch.manual_seed(0)
    router = Router(
        H, E, K, True, use_bias=True, scoring="sigmoid", n_group=4, topk_group=2, scaling_factor=2.5
    )
    x = torch.randn(8, H, requires_grad=True)
    route = router(x)
    g = torch.randn_like(route.topk_weight)
    (route.topk_weight * g).sum().backward()
    # the same weights, differentiated through a plain gather of the sigmoid at the chosen experts
    x2 = x.detach().clone().requires_grad_(True)
    w = (x2 @ router.weight.t()).sigmoid().gather(1, route.topk_idx)
    w = w / w.sum(-1, keepdim=True) * 2.5
    (w * g).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def _hf_deepseek_config(norm: bool, n_shared: int = 0):
    transformers = pytest.importorskip("transformers")
    return transformers.DeepseekV3Config(
        hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=norm, moe_intermediate_size=8, n_shared_experts=n_shared,
        hidden_act="silu",
    )  # fmt: skip


@pytest.mark.parametrize("norm", [True, False])
def test_sigmoid_router_equals_transformers_deepseek_v3(norm):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(1)
    hf = DeepseekV3TopkRouter(_hf_deepseek_config(norm))
    ours = Router(
        H, E, K, norm, use_bias=True, scoring="sigmoid", n_group=4, topk_group=2, scaling_factor=2.5
    )
    with torch.no_grad():
        hf.weight.normal_(0, 0.5)
        hf.e_score_correction_bias.copy_(torch.randn(E) * 0.1)
    # e_score_correction_bias is Mula's balancing bias buffer: the HF key maps onto `bias`
    ours.load_state_dict({"weight": hf.weight, "bias": hf.e_score_correction_bias})
    x = torch.randn(40, H)
    logits, weights, idx = hf(x)
    route = ours(x)
    torch.testing.assert_close(route.logits, logits)
    want = [dict(zip(i.tolist(), w.tolist())) for i, w in zip(idx, weights)]
    for got, ref in zip(_by_expert(route), want):
        assert got.keys() == ref.keys()
        for i in ref:
            assert got[i] == pytest.approx(ref[i], rel=1e-6)


def test_softmax_router_equals_transformers_qwen3_moe():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(2)
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=H, num_experts=E, num_experts_per_tok=K, norm_topk_prob=True
    )
    hf = Qwen3MoeTopKRouter(cfg)
    ours = Router(H, E, K, norm_topk_prob=True)
    with torch.no_grad():
        hf.weight.normal_(0, 0.5)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(40, H)
    _, weights, idx = hf(x)
    route = ours(x)
    assert torch.equal(route.topk_idx, idx)
    torch.testing.assert_close(route.topk_weight, weights)


def test_moe_layer_equals_transformers_deepseek_v3_moe():
    """Routed experts only (n_shared_experts=0): the whole layer, bias, groups and factor included."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(3)
    hf = DeepseekV3MoE(_hf_deepseek_config(True)).eval()
    config = MulaConfig.from_name(
        "mula-tiny-moe", hidden_size=H, num_experts=E, top_k=K, expert_intermediate_size=8, norm_topk_prob=True,
        router_scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5, router_bias=True,
        expert_backend="loop",
    )  # fmt: skip
    ours = MoELayer(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        hf.gate.e_score_correction_bias.copy_(torch.randn(E) * 0.1)
    ours.load_state_dict({
        "router.weight": hf.gate.weight, "router.bias": hf.gate.e_score_correction_bias,
        "experts.gate_up": hf.experts.gate_up_proj, "experts.down": hf.experts.down_proj,
    })  # fmt: skip
    x = torch.randn(2, 10, H)
    y, stats = ours(x)
    torch.testing.assert_close(y, hf(x), atol=1e-5, rtol=1e-5)
    assert int(stats.tokens_per_expert.sum()) == 20 * K


def test_sigmoid_aux_loss_is_top_k_when_uniform_and_z_loss_uses_the_logits():
    router = Router(H, E, K, scoring="sigmoid")
    with torch.no_grad():
        router.weight.zero_()  # every score 0.5: P_i = 1/E
    route = router(torch.randn(E, H))
    counts = torch.full((E,), K)  # a balanced assignment of E tokens
    assert load_balancing_loss(route.probs, counts).item() == pytest.approx(K)
    torch.testing.assert_close(route.probs.sum(-1), torch.ones(E))


def test_bias_balancing_with_sigmoid_scores():
    """The bias picks experts (and groups) but not the weights; the sign update evens a skewed load."""
    torch.manual_seed(4)
    router = Router(H, E, K, True, use_bias=True, scoring="sigmoid", n_group=4, topk_group=2)
    d = torch.nn.functional.normalize(torch.randn(H), dim=0)
    x = torch.randn(256, H) + 3 * d  # every token leans along d ...
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.weight[:4] += d  # ... which group 0's experts favour
    plain = router(x)
    before = expert_counts(plain.topk_idx, E)
    for _ in range(300):
        update_router_bias([router], expert_counts(router(x).topk_idx, E)[None], 1e-2)
    after = expert_counts(router(x).topk_idx, E)
    assert before.max() / before.float().mean() > 3.5
    assert after.max() / after.float().mean() < before.max() / before.float().mean() / 2
    route = router(x)
    w = route.logits.sigmoid().gather(1, route.topk_idx)
    torch.testing.assert_close(route.topk_weight, w / w.sum(-1, keepdim=True))


def test_defaults_route_as_before_and_the_bias_buffer_follows_router_bias():
    config = MulaConfig.from_name("mula-tiny-moe", num_layers=1)
    model = Mula(config)
    router = model.layers[0].mlp.router
    assert (router.scoring, router.n_group, router.scaling_factor, router.bias) == ("softmax", 1, 1.0, None)
    frozen = Mula(dataclasses.replace(config, router_bias=True))
    assert "layers.0.mlp.router.bias" in frozen.state_dict()
    assert config.architecture_differences(dataclasses.replace(config, router_scoring="sigmoid")) == [
        "router_scoring: sigmoid vs softmax"
    ]


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"router_scoring": "tanh"}, "router_scoring must be one of"),
        ({"routed_scaling_factor": 0.0}, "routed_scaling_factor must be positive"),
        ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor must be positive"),
        ({"n_group": 4, "topk_group": 5}, "1 <= topk_group <= n_group"),
        ({"n_group": 0}, "n_group >= 1"),
        ({"n_group": 3}, "must divide num_experts=16"),
        ({"n_group": 16, "topk_group": 1}, "groups of at least 2 experts"),
        ({"n_group": 8, "topk_group": 1}, "top_k=4 exceeds the 2 experts"),
    ],
)
def test_router_options_are_validated(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        MulaConfig.from_name("mula-tiny-moe", **overrides)


@pytest.mark.parametrize(
    "field, value", [("router_scoring", "sigmoid"), ("n_group", 4), ("routed_scaling_factor", 2.5)]
)
def test_olmoe_export_refuses_routing_it_cannot_express(field, value):
    pytest.importorskip("transformers")
    from mula.hf import config_to_hf

    config = MulaConfig.from_name("mula-tiny-moe", **{field: value})
    with pytest.raises(ValueError, match=f"transformers' OLMoE routes by a softmax.*{field}="):
        config_to_hf(config)
