"""Router balancing on one process: settings, uniform routing, bias balancing, the bias buffer, HF export.

The balancing test is a synthetic skewed router (two experts favoured by every token, fixed data):
with the sign-based bias update the per-step load imbalance falls below 1.2 within 200 steps, while
the auxiliary loss alone (same budget) leaves it above.
"""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader

from mula import Mula, MulaConfig
from mula.checkpoint import save_weights
from mula.hf import check_router_bias, export_hf, to_hf
from mula.model.moe import expert_counts, iter_moe_layers
from mula.model.moe.balancing import update_router_bias
from mula.model.moe.router import Router
from mula.training.module import MulaLightningModule

TINY = dict(num_layers=1, hidden_size=32, num_heads=2, vocab_size=64, num_experts=8, top_k=2,
            expert_intermediate_size=32, max_position_embeddings=64)  # fmt: skip


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("router_bias_update_rate", -0.1, "router_bias_update_rate must be >= 0"),
        ("router_bias_update_rate", float("nan"), "router_bias_update_rate must be >= 0"),
        ("aux_loss_scope", "batch", "aux_loss_scope must be one of"),
        ("routing_mode", "random", "routing_mode must be one of"),
    ],
)
def test_routing_settings_are_validated(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        MulaConfig.from_name("mula-tiny-moe", **{field: value})


def test_defaults_have_no_bias_buffer():
    model = Mula(MulaConfig.from_name("mula-tiny-moe", num_layers=1))
    assert not any(k.endswith("router.bias") for k in model.state_dict())


@pytest.mark.parametrize("tokens, top_k, experts", [(7, 2, 8), (64, 4, 16), (5, 3, 3), (1, 1, 4)])
def test_uniform_routing_gives_every_expert_the_same_count(tokens, top_k, experts):
    router = Router(16, experts, top_k, mode="uniform")
    with torch.no_grad():
        router.weight[0] += 10.0  # a router that would send everything to expert 0
    x = torch.randn(tokens, 16)
    route = router(x)
    counts = expert_counts(route.topk_idx, experts)
    assert int(counts.sum()) == tokens * top_k
    assert int(counts.max() - counts.min()) <= 1
    for row in route.topk_idx:  # a token's K experts are distinct
        assert len(set(row.tolist())) == top_k
    torch.testing.assert_close(route.topk_weight, route.probs.gather(1, route.topk_idx))
    (route.topk_weight * torch.randn_like(route.topk_weight)).sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_bias_picks_experts_but_combine_weights_stay_unbiased():
    router = Router(8, 4, 2, use_bias=True)
    x = torch.randn(32, 8)
    plain = router(x)
    with torch.no_grad():
        router.bias.copy_(torch.tensor([0.0, 0.0, 5.0, 5.0]))
    biased = router(x)
    assert set(biased.topk_idx.unique().tolist()) == {2, 3}
    torch.testing.assert_close(biased.topk_weight, plain.probs.gather(1, biased.topk_idx))


def test_update_router_bias_is_sign_of_mean_minus_load():
    routers = [Router(8, 4, 2, use_bias=True), Router(8, 4, 2, use_bias=True)]
    counts = torch.tensor([[10, 2, 2, 2], [4, 4, 4, 4]])
    update_router_bias(routers, counts, 0.5)
    torch.testing.assert_close(routers[0].bias, torch.tensor([-0.5, 0.5, 0.5, 0.5]))
    torch.testing.assert_close(routers[1].bias, torch.zeros(4))


def test_bias_stays_fp32_and_loads_into_weights_without_it():
    config = MulaConfig.from_name("mula-tiny-moe", num_layers=1, router_bias_update_rate=1e-3)
    model = Mula(config).to(torch.bfloat16)
    assert model.layers[0].mlp.router.bias.dtype == torch.float32
    plain = Mula(MulaConfig.from_name("mula-tiny-moe", num_layers=1))
    model.load_state_dict(plain.state_dict())  # e.g. imported OLMoE weights: balancing starts at 0
    assert torch.equal(model.layers[0].mlp.router.bias, torch.zeros(config.num_experts))


def test_export_refuses_a_non_zero_bias_and_keeps_a_zero_one(tmp_path):
    pytest.importorskip("transformers")
    config = MulaConfig.from_name("mula-tiny-moe", num_layers=1, router_bias_update_rate=1e-3)
    model = Mula(config)
    to_hf(model)  # an all-zero bias routes as OLMoE does: exported without it
    with torch.no_grad():
        model.layers[0].mlp.router.bias[3] = 0.25
    with pytest.raises(ValueError, match="transformers' OLMoE cannot express a router bias"):
        to_hf(model)
    with pytest.raises(ValueError, match="layers.0.mlp.router.bias is non-zero"):
        check_router_bias(model.state_dict())
    save_weights(model, tmp_path / "w.pt")
    with pytest.raises(ValueError, match="cannot express a router bias"):
        export_hf(tmp_path / "w.pt", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


class _Imbalance(L.Callback):
    """moe/load_imbalance as logged after each optimizer step (one micro-batch per step here)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(trainer.callback_metrics["moe/load_imbalance"]))


def _skewed_run(rate: float) -> list[float]:
    torch.manual_seed(0)
    module = MulaLightningModule(
        "mula-tiny-moe",
        overrides={**TINY, "router_bias_update_rate": rate},
        lr=1e-4,
        min_lr=1e-4,
        warmup_steps=0,
    )
    module.configure_model()
    with torch.no_grad():  # every token leans towards experts 0 and 1 through a shared direction d
        d = torch.nn.functional.normalize(torch.randn(TINY["hidden_size"]), dim=0)
        module.model.embed.weight.add_(0.1 * d)
        for _, layer in iter_moe_layers(module.model):
            layer.router.weight.normal_(0, 0.3)
            layer.router.weight[:2] += d
    batch = torch.randint(0, TINY["vocab_size"], (4, 33), generator=torch.Generator().manual_seed(0))
    record = _Imbalance()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=200,
        log_every_n_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    trainer.fit(module, DataLoader(list(batch) * 200, batch_size=4))
    return record.values


def test_bias_balancing_fixes_a_skewed_router_that_the_aux_loss_alone_does_not():
    aux_only, balanced = _skewed_run(0.0), _skewed_run(3e-3)
    assert len(balanced) == len(aux_only) == 200
    assert aux_only[0] > 3.0 and balanced[0] > 3.0  # the same skewed start
    assert max(balanced[-20:]) < 1.2, balanced[-20:]
    assert min(aux_only[-20:]) > 1.2, aux_only[-20:]


def test_global_scope_under_activation_checkpointing_has_the_same_gradients():
    """A recomputed MoE layer reuses its forward's global f (and counts its tokens once)."""
    config = MulaConfig.from_name("mula-tiny-moe", **TINY, aux_loss_scope="global", router_aux_loss_coef=1.0)
    batch = torch.randint(0, TINY["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(3))
    grads = []
    for checkpointing in ("none", ["moe"]):
        torch.manual_seed(0)
        model = Mula(config)
        model.set_activation_checkpointing(checkpointing)
        out = model(batch[:, :-1])
        (out.logits.square().mean() + out.aux_loss).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        layer = next(layer for _, layer in iter_moe_layers(model))
        assert int(layer.global_load._sum[-1]) == batch[:, :-1].numel()  # tokens counted once
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)
