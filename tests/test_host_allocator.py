"""`mula.training.host_allocator`: CPU ranks keep freed host memory in the heap (glibc's malloc thresholds fixed)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from mula.training import host_allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# In a fresh interpreter: the bytes glibc holds in mappings of their own after allocating a 16 MiB tensor,
# and the free bytes its heap keeps after the tensor is freed (mallinfo2: glibc >= 2.33).
_PROBE = """
import ctypes, json, sys
import torch
from mula.training.host_allocator import reuse_freed_host_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
applied = reuse_freed_host_memory() if sys.argv[1] == "1" else False
before = libc.mallinfo2().hblkhd
x = torch.ones(4 << 20)  # 16 MiB: above glibc's initial mmap threshold of 128 KiB
held = libc.mallinfo2().hblkhd - before
del x
print(json.dumps({"applied": applied, "mapped": held, "kept": libc.mallinfo2().fordblks}))
"""


def _probe(apply: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, "1" if apply else "0"], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_freed_blocks_stay_in_the_heap_for_the_next_step():
    import ctypes

    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("glibc older than 2.33 (no mallinfo2)")
    default, fixed = _probe(False), _probe(True)
    # glibc's default: a 16 MiB block gets a mapping of its own, unmapped (and faulted in again) on free
    assert not default["applied"] and default["mapped"] >= 16 << 20 and default["kept"] < 16 << 20
    # fixed thresholds: the block comes from the heap and stays there, free, for the next allocation
    assert fixed["applied"] and fixed["mapped"] == 0
    assert fixed["kept"] >= 16 << 20


@pytest.mark.parametrize(
    "env", [{"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}]
)
def test_a_users_own_allocator_choice_is_left_alone(monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert host_allocator.reuse_freed_host_memory() is False


def test_cpu_training_keeps_freed_memory(monkeypatch):
    """`mula fit` on a CPU device applies it as training starts."""
    import lightning.pytorch as L
    import torch

    from mula.training.module import MulaLightningModule

    calls = []
    monkeypatch.setattr("mula.training.module.reuse_freed_host_memory", lambda: calls.append(True) or True)
    module = MulaLightningModule("mula-tiny-dense", overrides=dict(num_layers=1, hidden_size=16, num_heads=1))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(torch.randint(0, 64, (1, 9)), batch_size=1))
    assert calls == [True]
