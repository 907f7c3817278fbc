"""One file from a sharded checkpoint: its model weights as a Lightning-style `.ckpt` (`mula.checkpoint.
consolidate_checkpoint`). Above the sharded format (`sharded.py`) and the verification on read
(`reading.py`, which itself reads the sharded format's files), so that neither imports the other back.
"""

from __future__ import annotations

import os
from pathlib import Path

from mula.checkpoint.atomic import atomic_write, save_torch
from mula.checkpoint.reading import verify_for_reading
from mula.checkpoint.sharded import is_sharded_checkpoint, read_sharded_checkpoint


def consolidate_checkpoint(path: str | os.PathLike, output: str | os.PathLike, verify: bool = True) -> Path:
    """Write the model weights of a sharded checkpoint as one Lightning-style `.ckpt` file (one process).

    The result has the full stacked experts and the `mula_config` entry. `mula export-hf` and
    `mula.checkpoint.load_weights` also read the sharded directory directly; this is for tools that
    want a single file. Optimizer state is left out. The checkpoint is verified first
    (`mula.checkpoint.reading.verify_for_reading`; `verify=False` skips it).
    """
    path, output = Path(path), Path(output)
    if not is_sharded_checkpoint(path):
        raise ValueError(f"{path} is not a sharded XPUMoEStrategy checkpoint directory.")
    verify_for_reading(path, verify)
    checkpoint = read_sharded_checkpoint(path)
    output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(output) as tmp:
        save_torch(checkpoint, tmp)
    return output
