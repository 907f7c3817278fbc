"""Which device a rank runs on: torch's module for an accelerator, and the device's name.

One lookup for every reader, and the one place that asks torch's device modules for members only some
backends have: `callbacks.Throughput` (the published peak of the device's name, a step's end),
`callbacks.MemoryMetrics` and `mula bench` (the allocator's peak and device events), `mula eval`
(bf16 on an accelerator that has it), `mula bench`'s table and `mula calibrate`'s machine file (which
device or CPU measured them), and the benchmarks.
"""

from __future__ import annotations

import platform
from typing import Any

import torch


def device_module(device: torch.device) -> Any:
    """torch.cuda / torch.xpu for an accelerator with an allocator peak and events, else None (CPU)."""
    module = getattr(torch, device.type, None)
    return module if device.type != "cpu" and hasattr(module, "max_memory_allocated") else None


def bf16_supported(device: torch.device) -> bool:
    """Whether an accelerator computes in bfloat16 (its module's `is_bf16_supported`; False on a CPU or
    a device module without it)."""
    if device.type == "cpu":
        return False
    module = torch.get_device_module(device.type)
    return hasattr(module, "is_bf16_supported") and bool(module.is_bf16_supported())


def _cpuinfo(key: str) -> str | None:
    """The first value of `key` in /proc/cpuinfo (the first core's), or None (no such line, or no Linux)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's "model name"), else what Python's platform knows."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo's "flags": avx512f, amx_tile, ...); none where unknown."""
    return set((_cpuinfo("flags") or "").split())


def device_name(device: torch.device) -> str:
    """The accelerator's name as torch reports it (e.g. 'NVIDIA H100 80GB HBM3'), or on a CPU its model
    and the torch threads this process computes with: 'cpu (<model>, <N> threads)'."""
    if device.type == "cpu":
        return f"cpu ({cpu_model()}, {torch.get_num_threads()} threads)"
    module = getattr(torch, device.type, None)
    return module.get_device_name(device) if hasattr(module, "get_device_name") else device.type
