"""Staging a checkpoint's state into host memory for an asynchronous save.

``dcp.async_save`` writes a *staged* copy of the state while training changes the live tensors. Its
default stager cannot copy the sharded optimizer's state (DTensors whose local part is torch's
``LocalShardsWrapper``, which has no ``zeros_like``), so ``HostStager`` copies it itself: every
tensor cloned into host memory, a DTensor rebuilt around a host copy of its local part (a
``LocalShardsWrapper`` chunk by chunk), anything else deep-copied (optimizer hyperparameters change
every step). The copy holds one rank's whole checkpoint state: host bytes the planner counts.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import Tensor

from mula.torch_compat import local_shards_wrapper_class


def _host_copy(tensor: Tensor) -> Tensor:
    return tensor.detach().to("cpu", copy=True)


def stage_to_host(obj: Any) -> Any:
    """A copy of ``obj`` (a state dict) that later in-place updates of the live tensors do not reach."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        local = obj.to_local()
        shards_wrapper = local_shards_wrapper_class()
        if isinstance(local, shards_wrapper):
            offsets = [tuple(o) for o in local.local_offsets()]
            local = shards_wrapper([_host_copy(c) for c in local.local_shards()], offsets)
        else:
            local = _host_copy(local)
        return DTensor.from_local(
            local, obj.device_mesh, obj.placements, shape=obj.shape, stride=obj.stride(), run_check=False
        )
    if isinstance(obj, Tensor):
        return _host_copy(obj)
    if isinstance(obj, dict):
        return {k: stage_to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(stage_to_host(v) for v in obj)
    return copy.deepcopy(obj)


class HostStager:
    """A ``torch.distributed.checkpoint.staging.AsyncStager``: synchronous staging with ``stage_to_host``."""

    # staging is complete when stage() returns; a private member of torch's AsyncStager protocol
    # (mula.torch_compat.DEFINED_FOR_TORCH), without which isinstance(stager, AsyncStager) fails
    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        """Nothing to wait for after ``stage``."""
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The staged copy of ``state_dict``."""
        return stage_to_host(state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to do: ``stage`` copies synchronously."""

    def close(self) -> None:
        """Nothing to release."""


def staged_bytes(obj: Any) -> int:
    """Bytes of the tensors ``stage_to_host`` copies from ``obj`` (a DTensor's local part, every chunk of
    a ``LocalShardsWrapper``): the host memory a staged copy takes, and the bytes this rank holds."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return staged_bytes(obj.to_local())
    if isinstance(obj, local_shards_wrapper_class()):
        return sum(c.numel() * c.element_size() for c in obj.local_shards())
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(staged_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(staged_bytes(v) for v in obj)
    return 0


__all__ = ["HostStager", "stage_to_host", "staged_bytes"]
