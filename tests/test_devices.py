"""The one device lookup (mula/training/devices.py): the accelerator's name, the CPU's model and torch's
module of the device."""

from __future__ import annotations

import io
import platform

import torch

from mula.training import devices


def _cpuinfo(text: str):
    """A stand-in for `open` that serves `text` as /proc/cpuinfo."""

    def fake_open(path: str, *args, **kwargs):
        assert path == "/proc/cpuinfo"
        return io.StringIO(text)

    return fake_open


def test_cpu_model_and_flags_are_cpuinfos_else_the_platforms(monkeypatch):
    two_cores = (
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t: avx512f\n\n"
        "processor\t: 1\nmodel name\t: other\n"
    )
    monkeypatch.setattr(devices, "open", _cpuinfo(two_cores), raising=False)
    assert devices.cpu_model() == "Intel(R) Xeon(R) Processor" and devices.cpu_flags() == {"avx512f"}
    # no "model name" line (as on some ARM hosts), or no /proc/cpuinfo at all: what Python's platform says
    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(devices, "open", _cpuinfo("processor\t: 0\nBogoMIPS\t: 50.00\n"), raising=False)
    assert devices.cpu_model() == "aarch64"

    def missing(*args, **kwargs):
        raise FileNotFoundError("/proc/cpuinfo")

    monkeypatch.setattr(devices, "open", missing, raising=False)
    assert devices.cpu_model() == "aarch64" and devices.cpu_flags() == set()


def test_device_name_is_the_accelerators_or_the_cpus_model_and_threads(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"NVIDIA H200 ({device})")
    assert devices.device_name(torch.device("cuda", 1)) == "NVIDIA H200 (cuda:1)"
    monkeypatch.setattr(devices, "cpu_model", lambda: "AMD EPYC 7B13")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert devices.device_name(torch.device("cpu")) == "cpu (AMD EPYC 7B13, 3 threads)"
    assert devices.device_name(torch.device("meta")) == "meta"  # a device type torch names no device of


def test_device_module_is_an_accelerators_with_an_allocator_peak():
    assert devices.device_module(torch.device("cpu")) is None
    assert devices.device_module(torch.device("cuda")) is torch.cuda
