"""The AdamW update on flat fp32 shards (decoupled weight decay, no amsgrad/maximize)."""

from __future__ import annotations

import torch
from torch import Tensor

_FUSED_DEVICES: set[str] | None = None


def adamw_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    step: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
) -> None:
    """Decoupled-weight-decay Adam on lists of flat fp32 tensors; ``step`` is already incremented.

    Uses torch's fused kernel (one pass over memory) where the device has one, else the same math as
    ``torch.optim.AdamW(foreach=True)``."""
    global _FUSED_DEVICES
    if _FUSED_DEVICES is None:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        _FUSED_DEVICES = set(_get_fused_kernels_supported_devices())
    device = params[0].device
    if device.type in _FUSED_DEVICES and hasattr(torch, "_fused_adamw_"):
        torch._fused_adamw_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            [step] * len(params),
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
        )
        return
    n = float(step)
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    step_size = lr / (1 - beta1**n)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, (1 - beta2**n) ** 0.5)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -step_size)
