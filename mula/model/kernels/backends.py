"""Backend registry for the expert kernels: which implementations exist and which one `auto` picks.

Every backend computes the same three grouped products over rows sorted by expert
(`GroupedOps`); autograd and the fused SwiGLU MLP are written once on top of them
(`mula.model.kernels.autograd`). Only the loop reference keeps plain autograd, so it stays an
independent check of the hand-written backward passes.

`auto` chooses per device type and dtype:
  cuda  -> `torch` when torch's grouped GEMM passes its probe for the dtype (CUTLASS kernels tuned by
           NVIDIA, e.g. bf16 on sm80+), else `triton`, else `loop`;
  xpu   -> `triton` when Triton has its Intel XPU backend, else `torch` if its probe passes, else `loop`;
  cpu and others -> `torch` when `torch._grouped_mm` passes a one-off probe for that device and dtype
           (fwd + both backward products against a reference), else `loop`. On CPU the `torch`
           backend's expert MLP runs as batched GEMMs over bucketed padded experts
           (`mula.model.kernels.padded`); its grouped GEMMs serve `grouped_mm` and other devices.
These are untimed defaults for GPUs (no GPU was available when they were written); `backend=` in
the recipe (MulaConfig.expert_backend) overrides them.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from mula.model.config import check_backend_name
from mula.model.kernels import torch_gmm
from mula.torch_compat import xpu_available


@dataclass(frozen=True)
class GroupedOps:
    """The raw (autograd-free) grouped products of one backend; `counts` is [E] long on x's device.

    fwd(x [T,K], w [E,N,K], counts) -> [T,N]: rows of expert e times w[e].T (the forward and dX=dY@W
        with w viewed as [E,K,N] through `transpose_w=True`).
    wgrad(dy [T,N], x [T,K], counts) -> [E,N,K]: dW[e] = dy_e.T @ x_e (zeros for experts with no rows).
    """

    name: str
    fwd: Callable[[Tensor, Tensor, Tensor, bool], Tensor]
    wgrad: Callable[[Tensor, Tensor, Tensor], Tensor]
    # Optional fused SwiGLU epilogues (None -> GEMM + separate elementwise ops):
    # swiglu_fwd(x, gate_up, counts) -> (h [T,2I], a [T,I]);
    # swiglu_bwd(dy, down, h, counts) -> (dh [T,2I], a [T,I]).
    swiglu_fwd: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None
    swiglu_bwd: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None


def triton_available(device: torch.device) -> bool:
    """True when Triton can run kernels on `device` (CPU only through TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if device.type == "cpu":
        return os.environ.get("TRITON_INTERPRET") == "1"
    if device.type == "cuda":
        return torch.cuda.is_available()
    if device.type == "xpu":
        return _triton_has_xpu()
    return False


@functools.cache
def _triton_has_xpu() -> bool:
    """Triton ships its Intel XPU backend as `triton.backends.intel` (intel-xpu-backend-for-triton)."""
    try:
        from triton.backends import backends as triton_backends
    except ImportError:
        return False
    return "intel" in triton_backends and xpu_available()


@functools.cache
def torch_grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """One-off probe: does torch's grouped GEMM run here, for the forward and both backward products?

    Builds differ (no CPU kernel before 2.8, Hopper-only CUDA kernels in 2.8, dtype gaps), so we ask the
    build itself on a tiny problem with aligned shapes (misaligned ones are padded by the backend) and a
    zero-row expert, and compare with the loop; any error or mismatch means "use another backend".
    """
    if torch_gmm.grouped_mm_fn() is None:
        return False
    # The answer is cached for the process, so the probe must not depend on the caller's state: under
    # autocast the fp32 reference products would run in 16 bits and the check would fail for good.
    with contextlib.ExitStack() as stack:
        if torch.amp.is_autocast_available(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
        stack.enter_context(torch.no_grad())
        return _probe_grouped_mm(device_type, dtype)


def _probe_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    try:
        device = torch.device(device_type)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(24, 16, generator=gen).to(device, dtype)
        w = torch.randn(3, 32, 16, generator=gen).to(device, dtype)
        dy = torch.randn(24, 32, generator=gen).to(device, dtype)
        counts = torch.tensor([10, 0, 14], device=device)
        y = torch_gmm.fwd(x, w, counts, False)
        dx = torch_gmm.fwd(dy, w, counts, True)
        dw = torch_gmm.wgrad(dy, x, counts)
        xs, dys = x.float().split([10, 0, 14]), dy.float().split([10, 0, 14])
        y_ref = torch.cat([a @ w[e].float().t() for e, a in enumerate(xs)])
        dx_ref = torch.cat([g @ w[e].float() for e, g in enumerate(dys)])
        dw_ref = torch.stack([g.t() @ a for g, a in zip(dys, xs)])
        tol = 1e-4 if dtype == torch.float32 else 0.1
        return all(
            torch.allclose(a.float(), b, atol=tol * 16, rtol=tol)
            for a, b in ((y, y_ref), (dx, dx_ref), (dw, dw_ref))
        )
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """Turn `auto` into a concrete backend for this device and dtype; check explicit names are usable."""
    check_backend_name(backend)
    if backend == "auto":
        if device.type == "xpu" and triton_available(device):
            return "triton"
        if torch_grouped_mm_supported(device.type, dtype):
            return "torch"
        if device.type == "cuda" and triton_available(device):
            return "triton"
        return "loop"
    if backend == "triton" and not triton_available(device):
        raise ValueError(
            f"Expert backend 'triton' cannot run on {device.type} here (needs CUDA, XPU with Triton's XPU "
            "backend, or TRITON_INTERPRET=1 for CPU tensors); use backend='auto'."
        )
    if backend == "torch" and not torch_grouped_mm_supported(device.type, dtype):
        raise ValueError(
            f"Expert backend 'torch' is not supported by this torch build for {device.type}/{dtype}; "
            "use backend='auto'."
        )
    return backend


def grouped_ops(backend: str) -> GroupedOps:
    """The raw grouped products of a concrete (non-auto, non-loop) backend."""
    if backend == "torch":
        return GroupedOps("torch", torch_gmm.fwd, torch_gmm.wgrad)
    if backend == "triton":
        from mula.model.kernels import triton_gmm

        return GroupedOps(
            "triton", triton_gmm.fwd, triton_gmm.wgrad, triton_gmm.swiglu_fwd, triton_gmm.swiglu_bwd
        )
    raise ValueError(f"Backend {backend!r} has no raw grouped ops (expected 'torch' or 'triton').")
