"""The private torch names Mula relies on, each reached here and only here.

torch may move, rename or drop a private name in any release, so each one Mula uses is named once, in
this module, beside the torch versions it is tested with (`TESTED_TORCH`, "major.minor" of the oldest
and the newest). `PRIVATE_NAMES` maps every private torch name to the entry of this module that uses
it, and tests/test_torch_compat.py checks that each resolves on the installed torch and that no other
module of mula/, strategies/ or callbacks/ imports or reads one. A torch that lost one of the names
imported at the top of this module fails on import with one sentence naming it and the tested range.

Heavy private packages (dynamo, inductor, `torch.testing._internal`, DTensor's internals) are imported
inside the functions that need them, as their call sites did: importing this module costs `import torch`
and torch's functional collectives only. `import mula` and the torch-free planner never import it.

Private names Mula's own classes define for torch, rather than read off it, are in `DEFINED_FOR_TORCH`.
Public names that only some torch releases (or builds) have are read here too, each with its stand-in
where it is missing (`VERSION_SHIMS`), so no other module asks torch for a name by a string.
Lightning's private names are not here: mula/training/lightning_compat.py holds those.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

TESTED_TORCH = ("2.11", "2.13")  # "major.minor" of the oldest and the newest torch Mula is tested with


def _unsupported(name: str, error: Exception) -> ImportError:
    """The one-sentence error for a torch that lacks one of the private names below."""
    return ImportError(
        f"Mula uses a private part of torch that torch {torch.__version__} does not have ({name}: {error}); "
        f"Mula is tested with torch {TESTED_TORCH[0]} to {TESTED_TORCH[1]}, install a version in that range."
    )


def _attribute(owner: Any, name: str) -> Any:
    """`owner.name`, failing with `_unsupported` instead of an AttributeError deep inside a run."""
    try:
        return getattr(owner, name)
    except AttributeError as e:
        raise _unsupported(f"{getattr(owner, '__name__', owner)}.{name}", e) from e


try:
    # Differentiable functional collectives (no public home yet): context and tensor parallelism call
    # them, and tensor parallelism's activations arrive as their lazily waited tensors.
    import torch.distributed._functional_collectives as _funcol
except ImportError as e:
    raise _unsupported("torch.distributed._functional_collectives", e) from e

try:
    # The base class of a mode that sees every aten op as it is dispatched (no public home yet): the
    # host-sync meter (`mula.host_sync`). Light: torch imports it itself.
    import torch.utils._python_dispatch as _python_dispatch
except ImportError as e:
    raise _unsupported("torch.utils._python_dispatch", e) from e

# torch's private name (a dotted path from `torch`) -> the entry of this module that uses it
PRIVATE_NAMES: dict[str, str] = {
    "torch._C._current_graph_task_id": "running_backward",
    "torch._inductor.config.fx_graph_cache": "enable_compile_caches",
    "torch._functorch.config.enable_autograd_cache": "enable_compile_caches",
    "torch._dynamo.config.nested_graph_breaks": "allow_nested_graph_breaks",
    "torch._dynamo.utils.counters": "graph_break_count",
    "torch._dynamo.callback.callback_handler": "dynamo_callback_handler",
    "torch._dynamo.callback.CallbackTrigger.DYNAMO": "triggered_by_dynamo",
    "torch._guards.CompileContext.current_compile_id": "current_compile_id",
    "torch._grouped_mm": "private_grouped_mm",
    "torch._fused_adamw_": "fused_adamw_",
    "torch.optim.optimizer._get_fused_kernels_supported_devices": "fused_adamw_devices",
    "torch._foreach_add_": "foreach_add_",
    "torch._foreach_addcdiv_": "foreach_addcdiv_",
    "torch._foreach_addcmul_": "foreach_addcmul_",
    "torch._foreach_div_": "foreach_div_",
    "torch._foreach_lerp_": "foreach_lerp_",
    "torch._foreach_mul_": "foreach_mul_",
    "torch._foreach_norm": "foreach_norm",
    "torch._foreach_sqrt": "foreach_sqrt",
    "torch.ops._c10d_functional.all_reduce": "c10d_functional_ops",
    "torch.ops._c10d_functional.wait_tensor": "c10d_functional_ops",
    "torch.distributed.distributed_c10d._resolve_process_group": "resolve_process_group",
    "torch.distributed.ProcessGroup._allgather_base": "PROCESS_GROUP_BASE_METHODS",
    "torch.distributed.ProcessGroup._reduce_scatter_base": "PROCESS_GROUP_BASE_METHODS",
    "torch.distributed._functional_collectives.AsyncCollectiveTensor": "AsyncCollectiveTensor",
    "torch.distributed._functional_collectives.all_gather_tensor_autograd": "all_gather_tensor_autograd",
    "torch.distributed._functional_collectives.all_to_all_single_autograd": "all_to_all_single_autograd",
    "torch.distributed._functional_collectives.all_reduce": "functional_all_reduce",
    "torch.distributed._functional_collectives.all_reduce_backward": "FUNCTIONAL_ALL_REDUCE_HAS_BACKWARD",
    "torch.distributed.device_mesh.DeviceMesh._flatten": "flatten_mesh",
    "torch.distributed.tensor.DTensor._local_tensor": "dtensor_local_tensor",
    "torch.distributed.tensor._shards_wrapper.LocalShardsWrapper": "local_shards_wrapper_class",
    "torch.distributed.tensor._utils.compute_local_shape_and_global_offset": "local_shape_and_global_offset",
    "torch.testing._internal.distributed.fake_pg.FakeStore": "fake_store",
    "torch.utils._python_dispatch.TorchDispatchMode": "TorchDispatchMode",
    "torch.ops.aten._local_scalar_dense": "private_aten_ops",
    "torch.ops.aten._unique": "private_aten_ops",
    "torch.ops.aten._unique2": "private_aten_ops",
    "torch.ops.aten._to_copy": "private_aten_ops",
    "torch.ops.aten._index_put_impl_": "private_aten_ops",
}

# torch's public name that some releases or builds lack (a dotted path from `torch`) -> the entry of this
# module that reads it, with its stand-in where it is missing
VERSION_SHIMS: dict[str, str] = {
    "torch.distributed.reduce_scatter_single": "reduce_scatter_single",
    "torch.distributed.all_gather_single": "all_gather_single",
    "torch.distributed.is_xccl_available": "xccl_available",
    "torch.nn.functional.grouped_mm": "public_grouped_mm",
    "torch.xpu": "xpu_available",
}

# Private members of torch classes that Mula's classes define themselves -> the torch class that has it.
# An override or a protocol member cannot be called through a function here, so each is declared.
DEFINED_FOR_TORCH: dict[str, str] = {
    # mula.model.moe.router.Router: keeps its balancing bias fp32 under `.to(dtype)`
    "_apply": "torch.nn.Module",
    # mula.model.moe.router.Router: fills a missing balancing bias when loading older weights
    "_load_from_state_dict": "torch.nn.Module",
    # mula.checkpoint.staging.HostStager: a member of the AsyncStager protocol, which
    # `dcp.async_save` checks with isinstance
    "_synchronize_after_execute": "torch.distributed.checkpoint.staging.AsyncStager",
}


# --- autograd


def running_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread (`_current_graph_task_id`).

    A forward run inside backward is activation checkpointing's recompute: MoE balancing must see the
    same expert frequencies there as in the first forward, and must not count its tokens twice.
    """
    return torch._C._current_graph_task_id() != -1


# --- torch.compile: configuration and counters


def enable_compile_caches() -> None:
    """Switch on Inductor's FX graph cache and AOTAutograd's cache for this process.

    Their defaults may change between releases; a resumed run must find the graphs its first run cached
    (`mula.model.compile.use_cache_dir`). The settings live in private config modules.
    """
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True


def allow_nested_graph_breaks() -> None:
    """Set dynamo's `nested_graph_breaks` for this process: a graph break inside a nested call (the MoE
    layer's routed experts) splits only that frame, not also its callers' (the compiled block's)."""
    import torch._dynamo.config

    torch._dynamo.config.nested_graph_breaks = True


def graph_break_count() -> int:
    """Graph breaks dynamo has counted in this process (`torch._dynamo.utils.counters`), which
    `CompileWatch` reports; torch has no public counter of them."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def dynamo_callback_handler() -> Any:
    """Dynamo's registry of compile start/end callbacks, the one hook torch gives to time compilations
    and count recompilations (`CompileWatch`)."""
    from torch._dynamo.callback import callback_handler

    return callback_handler


def triggered_by_dynamo(args: Any) -> bool:
    """Whether a compile callback's `args` report a dynamo compilation (`CallbackTrigger.DYNAMO`), as
    opposed to a lazily compiled backward graph or another trigger: `CompileWatch` counts only those."""
    from torch._dynamo.callback import CallbackTrigger

    return args.callback_trigger == CallbackTrigger.DYNAMO


def current_compile_id() -> Any:
    """The `CompileId` of the compilation in progress, or None (`torch._guards.CompileContext`): its
    `frame_compile_id` above 0 tells `CompileWatch` a frame is compiled again (a recompilation)."""
    from torch._guards import CompileContext

    return CompileContext.current_compile_id()


# --- kernels and optimizer math


def private_grouped_mm() -> Callable[..., torch.Tensor] | None:
    """`torch._grouped_mm`, or None: the grouped GEMM of torch 2.8-2.9, before it became public as
    `torch.nn.functional.grouped_mm` (the `torch` expert kernel backend's fallback)."""
    return getattr(torch, "_grouped_mm", None)


def fused_adamw_devices() -> set[str]:
    """Device types with torch's fused AdamW kernel (`fused_adamw_`); empty where torch has none.

    Mula's sharded optimizer runs AdamW itself on flat shards, so it calls the kernel directly and asks
    torch's own (private) list of the devices that have it.
    """
    if not hasattr(torch, "_fused_adamw_"):
        return set()
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return set(_get_fused_kernels_supported_devices())


fused_adamw_: Callable[..., None] | None = getattr(torch, "_fused_adamw_", None)
"""torch's fused AdamW kernel (one pass over memory), as `torch.optim.AdamW(fused=True)` calls it:
the sharded optimizer's update on the devices of `fused_adamw_devices`."""

# torch's multi-tensor ("foreach") kernels, as `torch.optim.AdamW(foreach=True)` and
# `clip_grad_norm_` call them: the sharded optimizer's AdamW elsewhere, and AnomalyGuard's norms.
foreach_add_ = _attribute(torch, "_foreach_add_")
"""In-place add over a list of tensors (AdamW's denominator + eps)."""
foreach_addcdiv_ = _attribute(torch, "_foreach_addcdiv_")
"""In-place `x += value * a / b` over lists of tensors (AdamW's parameter update)."""
foreach_addcmul_ = _attribute(torch, "_foreach_addcmul_")
"""In-place `x += value * a * b` over lists of tensors (AdamW's second moment)."""
foreach_div_ = _attribute(torch, "_foreach_div_")
"""In-place division over a list of tensors (AdamW's bias correction)."""
foreach_lerp_ = _attribute(torch, "_foreach_lerp_")
"""In-place linear interpolation over lists of tensors (AdamW's first moment)."""
foreach_mul_ = _attribute(torch, "_foreach_mul_")
"""In-place multiply over a list of tensors (AdamW's weight decay and second-moment decay)."""
foreach_norm = _attribute(torch, "_foreach_norm")
"""The 2-norm of each tensor of a list, in few kernels (AnomalyGuard's finiteness check)."""
foreach_sqrt = _attribute(torch, "_foreach_sqrt")
"""Square root of each tensor of a list (AdamW's denominator)."""


# --- the dispatcher: a mode that sees every aten op, and the private ops it looks for

TorchDispatchMode = _attribute(_python_dispatch, "TorchDispatchMode")
"""The base class of a mode whose `__torch_dispatch__` sees every aten op run while it is entered (after
autograd, on every thread autograd runs on): the host-sync meter counts the ops that make a device wait."""


def private_aten_ops() -> dict[str, Any]:
    """The aten ops with a private name that the host-sync meter (`mula.host_sync`) looks for, by name:
    `_local_scalar_dense` (`.item()`, `int()`, `float()`, `bool()` of a tensor), `_unique` / `_unique2`
    (`torch.unique`), `_to_copy` (`.to()` / `.cpu()`: a device-to-host copy) and `_index_put_impl_` (an
    assignment through a boolean mask)."""
    aten = torch.ops.aten
    return {
        "_local_scalar_dense": aten._local_scalar_dense,
        "_unique": aten._unique,
        "_unique2": aten._unique2,
        "_to_copy": aten._to_copy,
        "_index_put_impl_": aten._index_put_impl_,
    }


# --- public names of some torch releases (VERSION_SHIMS)

reduce_scatter_single: Callable[..., Any] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)
"""Reduce-scatter of one flat tensor: torch >= 2.10's name, `reduce_scatter_tensor` before (torch >= 2.4)."""

all_gather_single: Callable[..., Any] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)
"""All-gather into one flat tensor: torch >= 2.10's name, `all_gather_into_tensor` before (torch >= 2.4)."""


def xccl_available() -> bool:
    """Whether this torch has the XCCL backend for Intel GPUs (`is_xccl_available`, torch >= 2.8)."""
    available = getattr(dist, "is_xccl_available", None)
    return bool(available is not None and available())


def public_grouped_mm() -> Callable[..., torch.Tensor] | None:
    """`torch.nn.functional.grouped_mm` (torch >= 2.10), or None (`private_grouped_mm` is older torch's)."""
    return getattr(torch.nn.functional, "grouped_mm", None)


def xpu_available() -> bool:
    """Whether torch has its XPU module (`torch.xpu`, native since 2.4, else from IPEX) and sees an Intel
    GPU through it."""
    xpu = getattr(torch, "xpu", None)
    return xpu is not None and bool(xpu.is_available())


# --- collectives


def c10d_functional_ops() -> Any:
    """torch's `_c10d_functional` op namespace (`all_reduce`, `wait_tensor`): the ops DTensor and
    Ulysses attention issue, which `mula calibrate` times as they are launched in training."""
    return torch.ops._c10d_functional


PROCESS_GROUP_BASE_METHODS = {
    "_allgather_base": "all_gather_single",
    "_reduce_scatter_base": "reduce_scatter_single",
}
"""The process group's private methods an all-gather into one tensor or a reduce-scatter from one ends in
under torch releases whose `torch.distributed` has no `all_gather_single` / `reduce_scatter_single`,
each with the public method it stands for (`mula.bench.collectives` counts the bytes of both)."""


def resolve_process_group(name: str) -> Any:
    """The process group a functional collective names by its string (`mula.bench.collectives` reads its
    size and this rank's place in it)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


AsyncCollectiveTensor = _attribute(_funcol, "AsyncCollectiveTensor")
"""The lazily waited result of a functional collective (tensor parallelism's activations): the memory
meter waits on it to reach the tensor that holds storage."""

all_gather_tensor_autograd = _attribute(_funcol, "all_gather_tensor_autograd")
"""All-gather whose backward reduce-scatters the gradients: context parallelism's key/value gather."""

all_to_all_single_autograd = _attribute(_funcol, "all_to_all_single_autograd")
"""All-to-all whose backward is the reverse all-to-all: Ulysses context parallelism's head exchange."""

functional_all_reduce = _attribute(_funcol, "all_reduce")
"""Functional all-reduce, differentiable where `FUNCTIONAL_ALL_REDUCE_HAS_BACKWARD`: the sums of
tensor-parallel norms."""

FUNCTIONAL_ALL_REDUCE_HAS_BACKWARD: bool = hasattr(_funcol, "all_reduce_backward")
"""Whether `functional_all_reduce` has a backward (newer torch); else tensor parallelism uses the
deprecated `torch.distributed.nn.functional.all_reduce`."""


# --- device meshes and DTensors


def flatten_mesh(mesh: Any, name: str) -> Any:
    """`mesh` (a DeviceMesh or a slice of named dimensions) flattened into one dimension called `name`
    (`DeviceMesh._flatten`): torch's only way to make a mesh dimension spanning several others, from
    which the data-parallel, stage and world groups of the parallel layout are taken."""
    return mesh._flatten(name)


def dtensor_local_tensor(dtensor: Any) -> torch.Tensor:
    """The tensor a DTensor wraps (`DTensor._local_tensor`), not a copy or an alias of it.

    `.data` and `to_local()` do not reach it, and the sharded optimizer re-points a DTensor parameter's
    local shard into its flat buffers by setting this tensor's `.data`.
    """
    return dtensor._local_tensor


def local_shards_wrapper_class() -> type:
    """torch's `LocalShardsWrapper`: a DTensor's local part made of several chunks at given offsets.

    The sharded optimizer's state of a parameter can be several non-contiguous pieces on one rank; DCP
    saves and loads such a DTensor, and the checkpoint stager copies it chunk by chunk.
    """
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    return LocalShardsWrapper


def local_shape_and_global_offset(shape: Any, mesh: Any, placements: Any) -> tuple[Any, Any]:
    """(local shape, global offset) of this rank's shard of a DTensor of `shape` on `mesh` with
    `placements` (`compute_local_shape_and_global_offset`): where a tensor-parallel parameter's local
    box lies in the global tensor, for the sharded optimizer's checkpoint layout."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(shape, mesh, placements)


def fake_store() -> Any:
    """A new store for the "fake" process-group backend (`torch.testing._internal`), which `mula plan
    --dry-run` uses to build one rank of a large layout in a single process without peers."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


__all__ = [
    "DEFINED_FOR_TORCH",
    "FUNCTIONAL_ALL_REDUCE_HAS_BACKWARD",
    "PROCESS_GROUP_BASE_METHODS",
    "PRIVATE_NAMES",
    "TESTED_TORCH",
    "VERSION_SHIMS",
    "AsyncCollectiveTensor",
    "TorchDispatchMode",
    "all_gather_single",
    "all_gather_tensor_autograd",
    "all_to_all_single_autograd",
    "allow_nested_graph_breaks",
    "c10d_functional_ops",
    "current_compile_id",
    "dtensor_local_tensor",
    "dynamo_callback_handler",
    "enable_compile_caches",
    "fake_store",
    "flatten_mesh",
    "foreach_add_",
    "foreach_addcdiv_",
    "foreach_addcmul_",
    "foreach_div_",
    "foreach_lerp_",
    "foreach_mul_",
    "foreach_norm",
    "foreach_sqrt",
    "functional_all_reduce",
    "fused_adamw_",
    "fused_adamw_devices",
    "graph_break_count",
    "local_shape_and_global_offset",
    "local_shards_wrapper_class",
    "private_aten_ops",
    "private_grouped_mm",
    "public_grouped_mm",
    "reduce_scatter_single",
    "resolve_process_group",
    "running_backward",
    "triggered_by_dynamo",
    "xccl_available",
    "xpu_available",
]
