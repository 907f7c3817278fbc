"""strategies.optim.adamw.adamw_update on flat fp32 tensors vs torch.optim.AdamW, over a few steps."""

from __future__ import annotations

import pytest
import torch

from strategies.optim import adamw
from strategies.optim.adamw import adamw_update


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_update_matches_torch_adamw(fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not fused:  # the foreach fallback of devices without torch's fused kernel
        monkeypatch.setattr(adamw, "_FUSED_DEVICES", set())
    torch.manual_seed(0)
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    ref = [torch.nn.Parameter(torch.randn(n)) for n in (7, 33)]
    mine = [p.detach().clone() for p in ref]
    exp_avgs = [torch.zeros_like(p) for p in mine]
    exp_avg_sqs = [torch.zeros_like(p) for p in mine]
    step = torch.zeros(())
    opt = torch.optim.AdamW(ref, **hyper, foreach=False)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in mine]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
        step.add_(1)
        beta1, beta2 = hyper["betas"]
        adamw_update(
            mine, grads, exp_avgs, exp_avg_sqs, step, lr=hyper["lr"], beta1=beta1, beta2=beta2,
            weight_decay=hyper["weight_decay"], eps=hyper["eps"],
        )  # fmt: skip
    for p, q in zip(ref, mine):
        torch.testing.assert_close(q, p.detach(), rtol=1e-6, atol=1e-7)
