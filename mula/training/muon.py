"""Muon with Moonlight's rule (`model.optimizer: muon`): Muon for the blocks' matrices, AdamW for the rest.

The update of one matrix W [m, n] with gradient G and momentum buffer B (fp32), as `torch.optim.Muon`
computes it and Moonlight (arXiv 2502.16982) publishes it:

    B <- momentum * B + (1 - momentum) * G              (Nesterov momentum, torch's lerp form)
    U <- NS_k((1 - momentum) * G + momentum * B)         (k Newton-Schulz steps, quintic a, b, c)
    W <- W * (1 - lr * weight_decay) - lr * s * U        (decoupled decay; s: `adjust_lr`)

with s = 0.2 * sqrt(max(m, n)) for "match_rms_adamw" (the update's RMS matches AdamW's, so AdamW's
learning rate and weight decay carry over) or sqrt(max(1, m / n)) for "original" (Keller Jordan's).
Newton-Schulz runs in bfloat16 on the fp32 momentum, as torch's, Keller Jordan's and Moonlight's
implementations do: the iteration is built to be stable there. `ns_dtype="float32"` runs it in fp32
instead (twice the bytes and slower matmuls): bf16's rounding of the update is then gone, and with it
the update's sensitivity to the order a layout sums the gradients in (docs/muon.md), which is what the
suite's equality runs against one process need.

Which parameters are matrices is `mula.model.param_names.is_muon_param`; an expert stack is E matrices
(its fused gate_up 2E: `muon_matrix_shape`), each orthogonalised on its own. `MulaMuon` is one
`torch.optim.Optimizer` over both kinds of param group, so Lightning's LR scheduler scales both with
one lr, as Moonlight trains. `newton_schulz` and `muon_matrix_update` act on one matrix so that a
sharded optimizer can run them on the matrices a rank owns.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from mula.model.param_names import (
    MUON_NS_DTYPES,
    check_muon_ns_dtype,
    is_muon_param,
    is_no_decay,
    muon_matrix_shape,
)

ADJUST_LR = ("match_rms_adamw", "original")
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, as torch.optim.Muon's defaults
NS_EPS = 1e-7
NS_DTYPES = {
    name: getattr(torch, name) for name in MUON_NS_DTYPES
}  # `ns_dtype` -> what Newton-Schulz runs in
MUON_KEY = "muon"  # a param group whose parameters Muon trains carries {MUON_KEY: True}


def optimizer_param_groups(
    named_params: Iterable[tuple[str, Tensor]], weight_decay: float, no_decay: Sequence[str], optimizer: str
) -> list[dict[str, Any]]:
    """Param groups of `named_params`: decayed (`weight_decay`), then those matching the `no_decay` glob
    patterns (weight decay 0; kept, even empty, whenever `no_decay` names patterns, so every pipeline
    stage has the same groups). With `optimizer="muon"` these two hold AdamW's parameters, and two
    more, marked `{MUON_KEY: True}`, the Muon matrices (`is_muon_param`) in the same split, with the
    (rows, cols) of each parameter's matrices under "matrix_shapes" (`muon_matrix_shape`)."""
    muon = optimizer == "muon"
    groups: list[dict[str, Any]] = [
        {"params": [], "weight_decay": weight_decay},
        {"params": [], "weight_decay": 0.0},
    ]
    if muon:
        groups += [{**g, "params": [], MUON_KEY: True, "matrix_shapes": []} for g in groups]
    for name, p in named_params:
        group = groups[int(is_no_decay(name, no_decay)) + (2 if muon and is_muon_param(name, p.shape) else 0)]
        group["params"].append(p)
        if MUON_KEY in group:
            group["matrix_shapes"].append(muon_matrix_shape(name, p.shape))
    return [g for i, g in enumerate(groups) if no_decay or i % 2 == 0]


def check_muon_options(momentum: float, ns_steps: int, adjust_lr: str, ns_dtype: str = "bfloat16") -> None:
    """Refuse a Muon option outside its range, in one sentence naming it."""
    check_muon_ns_dtype(ns_dtype)
    if adjust_lr not in ADJUST_LR:
        raise ValueError(f"muon_adjust_lr must be one of {', '.join(ADJUST_LR)}, got {adjust_lr!r}.")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"muon_momentum must be in [0, 1), got {momentum}.")
    if not 1 <= ns_steps < 100:
        raise ValueError(f"muon_ns_steps must be between 1 and 99, got {ns_steps}.")


def is_muon_group(group: dict[str, Any]) -> bool:
    """Whether the parameters of param group `group` are Muon's matrices (else AdamW trains them)."""
    return bool(group.get(MUON_KEY, False))


def check_matrix_shapes(group: dict[str, Any]) -> None:
    """Give Muon param `group` its "matrix_shapes" (default: each parameter's last two dimensions) and
    refuse a parameter that does not hold whole matrices of its shape, in one sentence."""
    shapes = group.setdefault("matrix_shapes", [tuple(p.shape[-2:]) for p in group["params"]])
    for p, shape in zip(group["params"], shapes, strict=True):
        rows, cols = (*shape, 1, 1)[:2]
        if p.dim() < 2 or len(shape) != 2 or p.shape[-1] != cols or p.shape[-2] % rows:
            raise ValueError(
                f"A Muon parameter of shape {tuple(p.shape)} does not hold matrices of "
                f"{rows} x {cols}; Muon trains only the blocks' matrices."
            )


def adjusted_lr(lr: float, adjust_lr: str, rows: int, cols: int) -> float:
    """The step size of one [rows, cols] matrix's orthogonalised update (see the module docstring)."""
    if adjust_lr == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


def newton_schulz(update: Tensor, steps: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """The orthogonalised `update` [m, n] (about U V^T of its SVD), in `dtype` (bfloat16 as torch's):
    `steps` quintic Newton-Schulz iterations on the update scaled to a spectral norm of at most 1, on
    its wide side (X X^T is then the smaller Gram matrix). The same operations as torch.optim.Muon's,
    in its order."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def muon_matrix_update(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    ns_steps: int,
    adjust_lr: str,
    ns_dtype: str = "bfloat16",
) -> None:
    """One Muon step of one matrix `param` [m, n] in place, from its fp32 `grad` and fp32
    `momentum_buffer` (updated in place)."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    nesterov = grad.lerp(momentum_buffer, momentum)
    orthogonal = newton_schulz(nesterov, ns_steps, NS_DTYPES[ns_dtype])
    param.mul_(1 - lr * weight_decay)
    param.add_(orthogonal, alpha=-adjusted_lr(lr, adjust_lr, param.shape[0], param.shape[1]))


def muon_update(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    group: dict[str, Any],
    matrix_shape: Sequence[int] | None = None,
    ns_dtype: str = "bfloat16",
) -> None:
    """One Muon step of every matrix of `param` (a matrix, or a stack [..., m, n] of them) with the
    hyperparameters of its param `group`; `matrix_shape` (rows, cols) splits each of the stack's slices
    into several matrices (`mula.model.param_names.muon_matrix_shape`: a fused gate_up), default the
    last two dimensions. The three tensors have the same shape; `param` is updated in place."""
    rows, cols = matrix_shape if matrix_shape is not None else param.shape[-2:]
    options = {k: group[k] for k in ("lr", "weight_decay", "momentum", "ns_steps", "adjust_lr")}
    # matrix by matrix (never a batched Newton-Schulz): each matrix is computed exactly as alone
    for p, g, b in zip(*(t.view(-1, rows, cols) for t in (param, grad, momentum_buffer))):
        muon_matrix_update(p, g, b, **options, ns_dtype=ns_dtype)


class MulaMuon(torch.optim.Optimizer):
    """Muon for the param groups marked `{"muon": True}` (their parameters' matrices, see
    `muon_update`), `torch.optim.AdamW`'s update for the others, in one optimizer.

    Args:
        params: param groups (`MulaLightningModule.param_groups` with `optimizer="muon"`); a Muon group
            lists the (rows, cols) of its parameters' matrices under "matrix_shapes".
        lr, betas, eps, weight_decay: AdamW's, and Muon's lr and weight decay (Moonlight's one lr).
        momentum, ns_steps, adjust_lr: Muon's (`check_muon_options`).
        ns_dtype: what Newton-Schulz runs in, "bfloat16" (torch's) or "float32": a setting of the run,
            not a hyperparameter of the param groups (a checkpoint does not carry it).

    State: a Muon parameter keeps one fp32 "momentum_buffer" (4 bytes per element), an AdamW parameter
    torch AdamW's "step", "exp_avg" and "exp_avg_sq" (8 bytes per element in fp32). It is allocated
    here, not at the first step, so that a run short of memory stops before training and `mula plan
    --dry_run` measures it (`param_bytes`, `grad_buffer_bytes`, `state_bytes`).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        ns_steps: int = 5,
        adjust_lr: str = "match_rms_adamw",
        ns_dtype: str = "bfloat16",
    ) -> None:
        check_muon_options(momentum, ns_steps, adjust_lr, ns_dtype)
        self.ns_dtype = ns_dtype
        defaults = {
            "lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
            "momentum": momentum, "ns_steps": ns_steps, "adjust_lr": adjust_lr, MUON_KEY: False,
        }  # fmt: skip
        super().__init__(params, defaults)
        for group in self.param_groups:
            if is_muon_group(group):
                check_matrix_shapes(group)
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p, is_muon_group(group))

    def _init_state(self, p: Tensor, muon: bool) -> dict[str, Tensor]:
        state = self.state[p]
        if state:
            return state
        if muon:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        else:  # as torch.optim.AdamW initialises it: the step on the host, the moments like p
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def param_bytes(self) -> int:
        """Bytes of the parameters this optimizer updates (each whole on this rank)."""
        return sum(_local_bytes(p) for g in self.param_groups for p in g["params"])

    def grad_buffer_bytes(self) -> int:
        """Bytes of the gradients a step reads: one per parameter, of its shape and dtype (replicated path)."""
        return self.param_bytes()

    def state_bytes(self) -> int:
        """Bytes of the state tensors (momentum buffers, moments; not the 0-dim step counters)."""
        return sum(_local_bytes(t) for s in self.state.values() for t in s.values() if t.dim() > 0)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One update of every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if is_muon_group(group):
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        for p, shape in zip(group["params"], group["matrix_shapes"]):
            if p.grad is None:
                continue
            state = self._init_state(p, True)
            # the fp32 update of the fp32 parameter itself (bf16 weights are refused without masters)
            muon_update(p, p.grad.float(), state["momentum_buffer"], group, shape, self.ns_dtype)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self._init_state(p, False)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        # torch's functional AdamW: the kernel (single-tensor, foreach or fused) torch.optim.AdamW picks
        adamw(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )  # fmt: skip


def _local_bytes(t: Tensor) -> int:
    """Bytes of `t` on this rank (a DTensor's local shard)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()
