"""Host memory for CPU ranks: keep what a step frees for the next step, instead of handing it back to the
kernel and faulting it in again.

Torch's CPU allocator is glibc's malloc. glibc serves a block above its mmap threshold (128 KiB at
start) with a fresh mapping, returns it to the kernel on free, and gives the top of its heap back
whenever more than its trim threshold (128 KiB) lies free there. Every such block is page-faulted and
zeroed again the next time: a training step allocates and frees the same activations every
micro-batch, so it pays that every micro-batch. glibc raises both thresholds by itself when a large
mapped block is freed, so how often a process faults depends on what it happened to free before: on
this repository's CPU host, the same forward + backward took from 3,500 to 9,000 page faults a step in
one process and 50 in another that had freed a 16 MB matrix first, and ran 2-9 % slower. The
training rates `mula calibrate` measures would then depend on what the calibration ran before them.

`reuse_freed_host_memory` fixes both thresholds (blocks up to 32 MiB from the heap; a free heap top
kept up to 1 GiB): the reuse that PyTorch's and Intel's CPU tuning guides get by preloading jemalloc or
tcmalloc. The cost is memory a process keeps after its peak, which a training step reaches again
every step. `mula fit` applies it on CPU devices (`MulaLightningModule.on_fit_start`), and
`mula calibrate` on its CPU ranks, so that the two run alike. Nothing changes where the allocator is
not glibc's or the user has chosen one (LD_PRELOAD of another malloc, or glibc's malloc tunables in
GLIBC_TUNABLES).
"""

from __future__ import annotations

import ctypes
import os
import platform

MMAP_THRESHOLD = 32 << 20  # the most glibc accepts on 64-bit hosts (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


def reuse_freed_host_memory() -> bool:
    """Fix glibc malloc's mmap and trim thresholds for this process (module docstring); True when set,
    False where the allocator is not glibc's or the user chose its settings. Safe to call again."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if "malloc" in os.environ.get("LD_PRELOAD", "") or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    libc = ctypes.CDLL(None)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    # mallopt returns 1 on success; the mmap threshold first (glibc refuses values above its maximum)
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
