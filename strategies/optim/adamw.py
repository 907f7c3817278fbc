"""The AdamW update on flat fp32 shards (decoupled weight decay, no amsgrad/maximize): the kernel
(``adamw_update``) and one bucket shard's update by param group (``shard_runs``, ``update_runs``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mula import torch_compat
from mula.layout.flat_buffers import Segment

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
    found_inf: Tensor | None = None,
) -> None:
    """Decoupled-weight-decay Adam on lists of flat fp32 tensors; ``step`` is already incremented.

    ``found_inf`` (a 0-dim float tensor on the device, 1 to skip): the update is a no-op when it is
    non-zero, decided on the device (no host read), as torch's fused kernel does under a GradScaler.
    Uses torch's fused kernel (one pass over memory) where the device has one, else the same math as
    ``torch.optim.AdamW(foreach=True)`` (then a skip keeps the old values with ``torch.where``)."""
    global _FUSED_DEVICES
    if _FUSED_DEVICES is None:
        _FUSED_DEVICES = torch_compat.fused_adamw_devices()
    device = params[0].device
    if device.type in _FUSED_DEVICES:
        torch_compat.fused_adamw_(
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
            found_inf=found_inf,
        )
        return
    # (where ``found_inf`` can skip: one copy of the shard's state held, put back after a skip)
    state = (*params, *exp_avgs, *exp_avg_sqs)
    kept = [t.clone() for t in state] if found_inf is not None else None
    n = max(float(step), 1.0)  # (a first step skipped: step 0, its result is put back)
    torch_compat.foreach_mul_(params, 1 - lr * weight_decay)
    torch_compat.foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch_compat.foreach_mul_(exp_avg_sqs, beta2)
    torch_compat.foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    step_size = lr / (1 - beta1**n)
    denom = torch_compat.foreach_sqrt(exp_avg_sqs)
    torch_compat.foreach_div_(denom, (1 - beta2**n) ** 0.5)
    torch_compat.foreach_add_(denom, eps)
    torch_compat.foreach_addcdiv_(params, exp_avgs, denom, -step_size)
    if kept is not None:
        skip = found_inf != 0
        for new, old in zip(state, kept):
            new.copy_(torch.where(skip, old, new))


@dataclass
class ShardRun:
    """A maximal range of one bucket shard whose parameters share a param group."""

    group: int
    lo: int
    hi: int


def shard_runs(segments: Sequence[Segment]) -> list[ShardRun]:
    """Merge consecutive segments of one param group (padding between them has zero gradient and
    stays zero under AdamW, so it can ride along) into as few update calls as possible."""
    runs: list[ShardRun] = []
    for s in segments:
        end = s.shard_start + s.length
        if runs and runs[-1].group == s.slot.entry.group:
            runs[-1].hi = end
        else:
            runs.append(ShardRun(s.slot.entry.group, s.shard_start, end))
    return runs


def update_runs(
    runs: Sequence[ShardRun],
    state: tuple[Tensor, Tensor, Tensor],
    grads: Tensor,
    step: Tensor,
    param_groups: Sequence[dict[str, Any]],
    found_inf: Tensor | None = None,
) -> None:
    """AdamW on one bucket's shard: ``runs`` (from ``shard_runs``) of the bucket's ``state`` =
    (master, exp_avg, exp_avg_sq) and ``grads`` (all over that shard), one vectorised call per param
    group with that group's lr, betas, eps and weight decay; none where ``found_inf`` is non-zero."""
    master, exp_avg, exp_avg_sq = state
    by_group: dict[int, list[list[Tensor]]] = {}
    for run in runs:
        lo, hi = run.lo, run.hi
        lists = by_group.setdefault(run.group, [[], [], [], []])
        g = grads[lo:hi]
        lists[0].append(master[lo:hi])
        lists[1].append(g if g.dtype == torch.float32 else g.float())
        lists[2].append(exp_avg[lo:hi])
        lists[3].append(exp_avg_sq[lo:hi])
    for gi, (p, g, m, v) in by_group.items():
        group = param_groups[gi]
        beta1, beta2 = group["betas"]
        adamw_update(
            p,
            g,
            m,
            v,
            step,
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            weight_decay=float(group["weight_decay"]),
            eps=float(group["eps"]),
            found_inf=found_inf,
        )
