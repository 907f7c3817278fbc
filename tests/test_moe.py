"""MoE pieces against naive per-token references: router, dispatcher, grouped experts, layer."""

import pytest
import torch
import torch.nn.functional as F

from mula import MulaConfig
from mula.model.moe import (
    GroupedExperts,
    LocalDispatcher,
    MoELayer,
    Router,
    load_balancing_loss,
    router_z_loss,
)


def tiny(**kw) -> MulaConfig:
    base = {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_layers": 1,
        "num_heads": 4,
        "num_experts": 6,
        "top_k": 2,
        "expert_intermediate_size": 24,
        "max_position_embeddings": 64,
    }
    return MulaConfig(**{**base, **kw})


def naive_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Token by token, slot by slot: y_n = sum_k w_nk * SwiGLU_{e_nk}(x_n)."""
    x = x.reshape(-1, x.shape[-1])
    probs = F.linear(x, layer.router.weight).float().softmax(-1)
    w, idx = probs.topk(layer.router.top_k, dim=-1)
    if layer.router.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    gate_up, down = layer.experts.gate_up, layer.experts.down
    i = layer.experts.intermediate_size
    rows = []
    for n in range(x.shape[0]):
        y = torch.zeros_like(x[n])
        for k in range(idx.shape[1]):
            e = idx[n, k]
            h = gate_up[e] @ x[n]
            y = y + w[n, k] * (down[e] @ (F.silu(h[:i]) * h[i:]))
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize(
    "top_k,num_experts,norm_topk", [(1, 4, False), (2, 6, False), (3, 6, True), (6, 6, False)]
)
def test_layer_matches_naive_loop_forward_and_backward(top_k, num_experts, norm_topk):
    torch.manual_seed(0)
    layer = MoELayer(tiny(top_k=top_k, num_experts=num_experts, norm_topk_prob=norm_topk))
    with torch.no_grad():  # larger weights so every path matters numerically
        for p in layer.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(3, 5, 32, requires_grad=True)
    y, stats = layer(x)
    x2 = x.detach().clone().requires_grad_(True)
    ref = naive_moe(layer, x2).view_as(y)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)

    g = torch.randn_like(y)
    ours = torch.autograd.grad(y, [x, *layer.parameters()], g)
    theirs = torch.autograd.grad(ref, [x2, *layer.parameters()], g)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    assert stats.tokens_per_expert.shape == (num_experts,)
    assert stats.tokens_per_expert.dtype == torch.long
    assert int(stats.tokens_per_expert.sum()) == 15 * top_k


@pytest.mark.parametrize("backend", ["auto", "loop"])
def test_layer_under_bf16_autocast_close_to_fp32(backend):
    # bf16 mixed precision: the experts run in bf16 (the CPU path with the combine weights folded
    # into the experts, and the loop reference), everything stays within bf16 rounding of fp32
    torch.manual_seed(0)
    layer = MoELayer(tiny(top_k=2, num_experts=6, expert_backend=backend))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(4, 8, 32)
    g = torch.randn(4, 8, 32)
    ref = torch.autograd.grad(layer(x)[0], list(layer.parameters()), g)
    y_ref = layer(x)[0].detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = layer(x)
    assert y.dtype == torch.bfloat16
    got = torch.autograd.grad(y, list(layer.parameters()), g.to(y.dtype))

    def rel(a, b):
        return ((a.float() - b).abs().max() / b.abs().max()).item()

    assert rel(y, y_ref) < 3e-2
    for a, b in zip(got, ref):
        assert a.dtype == torch.float32 and rel(a, b) < 5e-2


def test_router_topk_and_weights():
    torch.manual_seed(0)
    router = Router(16, 5, 2, norm_topk_prob=False)
    x = torch.randn(7, 16)
    out = router(x)
    probs = (x @ router.weight.t()).softmax(-1)
    torch.testing.assert_close(out.probs, probs)
    assert torch.equal(out.topk_idx, probs.topk(2, -1).indices)
    torch.testing.assert_close(out.topk_weight, probs.topk(2, -1).values)  # not renormalised
    router.norm_topk_prob = True
    torch.testing.assert_close(router(x).topk_weight.sum(-1), torch.ones(7))


def test_router_losses():
    # uniform router: f sums to top_k, P_i = 1/E -> aux = top_k; z = log(E)^2
    logits = torch.zeros(10, 4)
    probs = logits.softmax(-1)
    counts = torch.tensor([5, 5, 5, 5])  # top-2 over 10 tokens
    assert load_balancing_loss(probs, counts).item() == pytest.approx(2.0)
    assert router_z_loss(logits).item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2)
    # all tokens to expert 0 with P_0 = 1: aux = E * 1 * 1 = E (top-1)
    probs = torch.zeros(10, 4)
    probs[:, 0] = 1
    assert load_balancing_loss(probs, torch.tensor([10, 0, 0, 0])).item() == pytest.approx(4.0)


@pytest.mark.parametrize("backend", ["loop", "auto"])
def test_dispatcher_groups_by_expert_and_combines(backend):
    # loop: rows sorted by expert with plain counts; auto on CPU: the bucketed padded layout
    torch.manual_seed(0)
    n, k, e, h = 9, 3, 5, 4
    x = torch.randn(n, h)
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    w = torch.rand(n, k)
    disp = LocalDispatcher(e, backend)
    x_sorted, plan, state = disp.dispatch(x, idx, w)
    layout = plan.layout
    padded = layout is not None
    assert padded == (backend == "auto")
    counts = plan.counts
    assert counts.tolist() == torch.bincount(idx.flatten(), minlength=e).tolist()
    # rows of expert j are exactly the tokens routed to j, in token order (then zero padding rows)
    start = 0
    for j in range(e):
        if padded:
            start = int(layout.expert_row[j])
        tokens = [t for t in range(n) if j in idx[t].tolist()]
        torch.testing.assert_close(x_sorted[start : start + counts[j]], x[tokens])
        start += int(counts[j])
    assert x_sorted.abs().sum() == pytest.approx((x.abs().sum(-1) * k).sum().item(), rel=1e-5)
    # identity experts: combine = x * sum of weights (on the padded layout the experts apply the
    # combine weights themselves, from plan.row_weight, and combine sums)
    y_sorted = x_sorted * plan.row_weight.unsqueeze(1) if padded else x_sorted
    torch.testing.assert_close(disp.combine(y_sorted, state), x * w.sum(-1, keepdim=True))


def test_grouped_experts_with_empty_experts():
    torch.manual_seed(0)
    experts = GroupedExperts(4, 8, 6)
    x = torch.randn(5, 8)
    counts = torch.tensor([0, 5, 0, 0])
    h = x @ experts.gate_up[1].t()
    ref = (F.silu(h[:, :6]) * h[:, 6:]) @ experts.down[1].t()
    torch.testing.assert_close(experts(x, counts), ref)
    assert experts.gate_up.shape == (4, 12, 8) and experts.down.shape == (4, 8, 6)


def test_contract_finds_layers_and_expert_params():
    from mula import Mula
    from mula.model.moe import is_expert_param, iter_moe_layers, num_global_experts

    model = Mula(tiny(num_layers=2))
    names = [n for n, _ in iter_moe_layers(model)]
    assert names == ["layers.0.mlp", "layers.1.mlp"]
    assert num_global_experts(model) == 6
    experts = sorted(n for n, _ in model.named_parameters() if is_expert_param(n))
    assert experts == [f"layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("down", "gate_up")]
    # prefixes added by Lightning / torch.compile / optimizer-state keys keep the answer
    assert is_expert_param("model._orig_mod.layers.0.mlp.experts.gate_up")
    assert is_expert_param("optimizer_0.state.layers.0.mlp.experts.down.exp_avg")
    # a parameter merely named like the module is not an expert tensor, nor is the router
    assert not is_expert_param("layers.0.mlp.router.weight")
    assert not is_expert_param("experts")
    assert num_global_experts(Mula(tiny(num_experts=0, top_k=0))) is None


def test_dispatchers_follow_the_protocol_and_stay_out_of_the_module_tree():
    from mula.model.moe import Dispatcher
    from strategies.experts.all_to_all import AllToAllDispatcher

    layer = MoELayer(tiny())
    keys, modules = list(layer.state_dict()), [n for n, _ in layer.named_modules()]
    for dispatcher in (LocalDispatcher(6), AllToAllDispatcher(6, ep_size=1, ep_rank=0)):
        assert isinstance(dispatcher, Dispatcher)
        assert not isinstance(dispatcher, torch.nn.Module)
        layer.dispatcher = dispatcher
        # swapping the dispatcher changes no state-dict key and no submodule; printing names it
        assert list(layer.state_dict()) == keys == ["router.weight", "experts.gate_up", "experts.down"]
        assert [n for n, _ in layer.named_modules()] == modules == ["", "router", "experts"]
        assert type(dispatcher).__name__ in repr(layer)
    assert not isinstance(object(), Dispatcher)
