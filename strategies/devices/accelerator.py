"""Intel GPU (XPU) support for Lightning: an accelerator on native `torch.xpu` and backend choice.

`XPUAccelerator` is registered under the name "xpu" when `strategies` is imported, so a recipe can say
`trainer.accelerator: xpu`. Lightning builds its mixed-precision plugin with `device="cuda"` for any
accelerator it does not know, which would make bf16 autocast a silent no-op on XPU tensors; the
accelerator's `setup` re-points the plugin at "xpu". intel-extension-for-pytorch is not needed (it is
retired); on old stacks where only it provides `torch.xpu`, it is imported if present.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry
from lightning.pytorch.plugins.precision import MixedPrecision
from typing_extensions import override

from mula import torch_compat
from mula.training.lightning_compat import _AcceleratorRegistry


def xpu_available() -> bool:
    """True when torch can see at least one Intel GPU (natively, or via the legacy IPEX extension)."""
    if _native_xpu_count() > 0:
        return True
    try:  # old stacks: torch.xpu is provided by intel-extension-for-pytorch
        importlib.import_module("intel_extension_for_pytorch")
    except ImportError:
        return False
    return _native_xpu_count() > 0


def _native_xpu_count() -> int:
    try:
        return int(torch.xpu.device_count()) if torch_compat.xpu_available() else 0
    except RuntimeError:  # a driver present but unusable counts as no device
        return 0


def process_group_backend(device: torch.device) -> str:
    """The collective backend for a device type: xccl for XPU, nccl for CUDA, gloo for CPU."""
    if device.type == "xpu":
        if torch_compat.xccl_available():
            return "xccl"
        try:  # torch < 2.8 on Intel GPUs: oneCCL bindings register the "ccl" backend
            importlib.import_module("oneccl_bindings_for_pytorch")
            return "ccl"
        except ImportError as error:
            raise ValueError(
                "This torch build has no XCCL backend for Intel GPUs; install a torch with XPU support >= 2.8."
            ) from error
    if device.type == "cuda":
        return "nccl"
    if device.type == "cpu":
        return "gloo"
    raise ValueError(
        f"No collective backend known for device type {device.type!r}; pass process_group_backend."
    )


def fix_mixed_precision_device(precision_plugin: Any, device_type: str) -> None:
    """Point Lightning's autocast plugin at `device_type` (it defaults to cuda for unknown accelerators)."""
    if not isinstance(precision_plugin, MixedPrecision) or precision_plugin.device == device_type:
        return
    precision_plugin.device = device_type
    if precision_plugin.scaler is not None:  # fp16: the loss scaler must live on the same device type
        precision_plugin.scaler = torch.amp.GradScaler(device=device_type)


class XPUAccelerator(Accelerator):
    """Lightning accelerator for Intel GPUs (XPU tiles) using native `torch.xpu`."""

    @override
    def setup_device(self, device: torch.device) -> None:
        """Make `device` current for this process."""
        if device.type != "xpu":
            raise ValueError(f"XPUAccelerator needs an xpu device, got {device}.")
        torch.xpu.set_device(device)

    @override
    def setup(self, trainer: Any) -> None:
        """Fix the mixed-precision plugin's autocast device before training starts."""
        fix_mixed_precision_device(trainer.precision_plugin, "xpu")

    @override
    def get_device_stats(self, device: Any) -> dict[str, Any]:
        """torch.xpu memory statistics of `device`."""
        return dict(torch.xpu.memory_stats(device))

    @override
    def teardown(self) -> None:
        """Release cached device memory."""
        if _native_xpu_count() > 0:
            torch.xpu.empty_cache()

    @staticmethod
    @override
    def parse_devices(devices: int | str | list[int]) -> list[int]:
        """Device indices from Lightning's `devices` flag: an int count, -1/"auto" for all, "0,2", or a list."""
        available = _native_xpu_count()
        if isinstance(devices, str):
            devices = devices.strip()
            if devices in ("-1", "auto"):
                devices = -1
            elif "," in devices:
                devices = [int(d) for d in devices.split(",") if d.strip()]
            else:
                devices = int(devices)
        if isinstance(devices, int):
            if devices == -1:
                devices = available
            if devices <= 0:
                raise ValueError(f"devices must be a positive number of XPUs, -1 or 'auto', got {devices}.")
            indices = list(range(devices))
        else:
            indices = [int(d) for d in devices]
        if not indices or max(indices) >= available:
            raise ValueError(f"Requested XPU devices {indices} but torch sees {available} XPU device(s).")
        return indices

    @staticmethod
    @override
    def get_parallel_devices(devices: list[int]) -> list[torch.device]:
        """torch devices for the parsed indices."""
        return [torch.device("xpu", i) for i in devices]

    @staticmethod
    @override
    def auto_device_count() -> int:
        """Number of visible XPU devices (tiles)."""
        return _native_xpu_count()

    @staticmethod
    @override
    def is_available() -> bool:
        """Whether an Intel GPU is usable."""
        return xpu_available()

    @staticmethod
    @override
    def name() -> str:
        """Registry name: `accelerator: xpu`."""
        return "xpu"

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: _AcceleratorRegistry) -> None:
        """Register as "xpu" with Lightning's accelerator registry."""
        accelerator_registry.register(cls.name(), cls, description=cls.__name__, override=True)


def register() -> None:
    """Register the XPU accelerator with Lightning (idempotent; done on `import strategies`)."""
    entry = dict.get(
        AcceleratorRegistry, XPUAccelerator.name()
    )  # dict.get: the registry's get() instantiates
    if entry is None or entry["accelerator"] is not XPUAccelerator:
        XPUAccelerator.register_accelerators(AcceleratorRegistry)
