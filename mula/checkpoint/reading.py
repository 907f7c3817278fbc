"""Verification on every read: the one rule every reader of a user-named checkpoint applies first.

Resume and rollback pick checkpoints themselves (``discovery``, with their own ``verify`` mode);
this module is for paths a user names: ``mula export-hf --ckpt``, ``init_weights``, ``--ckpt_path``
and ``load_weights`` / ``read_checkpoint``. The rule (``verify_for_reading``):

- a checkpoint with a manifest (``<checkpoint>.manifest.json``, next to it or next to the file a
  symlink such as ``last.ckpt`` points at) is checked against it -- every file present, with its
  size and checksum -- and refused when it does not match;
- a checkpoint named ``step=N.ckpt`` (written by ``callbacks.FaultTolerantCheckpoint``, which writes
  the manifest last as its completion marker) without a manifest is refused: its save did not finish;
- any other checkpoint without a manifest (a ``trainer.save_checkpoint`` file, a weights file copied
  without its manifest) is read with a one-line warning that it cannot be verified.

``verify=False`` (``--verify false`` on the command line) skips all of it, to read a damaged
checkpoint on purpose (forensics).
"""

from __future__ import annotations

import logging
import os
import zipfile
from collections.abc import Callable
from pathlib import Path

from mula.checkpoint import group_verify
from mula.checkpoint.discovery import is_checkpoint_name
from mula.checkpoint.manifest import WEIGHTS_REASON, Verify, manifest_path, read_manifest, verify_checkpoint
from mula.checkpoint.sharded import DCP_METADATA_FILE, SHARDED_META_FILE, is_sharded_checkpoint

log = logging.getLogger(__name__)

_NO_VERIFY = "`--verify false` (verify=False) reads it anyway"
# ckpt_path values Lightning resolves itself rather than reading a path
_LIGHTNING_CKPT_KEYWORDS = ("best", "last", "hpc")


def refusal(path: str | os.PathLike, problem: str) -> str:
    """The sentence a reader refuses a checkpoint that failed verification with."""
    return f"Checkpoint {path} failed verification: {problem}; {_NO_VERIFY}."


def verify_for_reading(
    path: str | os.PathLike,
    verify: bool = True,
    defer: bool = False,
    verifier: Callable[[Path, Verify], str | None] = verify_checkpoint,
) -> None:
    """Refuse to read a corrupted or incomplete checkpoint (see the module docstring for the rule).

    Raises FileNotFoundError when ``path`` does not exist and ValueError, with one sentence saying
    why, when it fails verification; warns when it has no manifest to be verified against.
    ``defer``: check the manifest and sizes only and leave the checksums pending for the ranks of the
    process group to verify together where the checkpoint is loaded (``settle.settle``), so that
    a multi-rank launch reads it once in total instead of once per process. ``verifier``:
    ``group_verify.verify_on_ranks`` to verify with the process group (a collective).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {path} does not exist.")
    if not verify:
        return
    target = path.resolve()  # last.ckpt -> step=N.ckpt, whose manifest is next to it
    for candidate in dict.fromkeys((target, path.absolute())):
        if manifest_path(candidate).exists():
            problem = verifier(candidate, "size" if defer else "checksum")
            if problem is not None:
                raise ValueError(refusal(path, problem))
            if defer:
                group_verify.defer(path, "named")
            return
    if is_checkpoint_name(target.name):
        raise ValueError(
            f"Checkpoint {path} has no manifest {manifest_path(target).name}, so the save that wrote it "
            f"did not complete; {_NO_VERIFY}."
        )
    log.warning("Checkpoint %s has no manifest: it cannot be verified, reading it as it is.", path)


def check_ckpt_path(
    ckpt_path: str | os.PathLike | None, verify: bool = True, defer_sharded: bool = False
) -> None:
    """Check a trainer's ``ckpt_path`` before any work: verified, and a checkpoint at all.

    A file must be a ``torch.save`` archive (which Lightning writes) other than a Mula weights file, a
    directory a sharded checkpoint; anything else (a text file, a truncated file, another directory,
    ``mula import-hf`` output) raises ValueError with one
    sentence instead of a traceback from deep inside the strategy's loading code. Lightning's keywords
    (``best``, ``last``, ``hpc``, ``registry[:name]``) and URLs are left to Lightning.
    ``defer_sharded`` (``mula fit/validate/test``): a sharded checkpoint's checksums are left to
    ``XPUMoEStrategy.load_checkpoint``, where the ranks verify it together (``group_verify``).
    """
    if ckpt_path is None:
        return
    name = str(ckpt_path)
    registry = name.lower() == "registry" or name.lower().startswith("registry:")
    if name in _LIGHTNING_CKPT_KEYWORDS or registry or "://" in name:
        return
    path = Path(ckpt_path)
    if path.is_dir() and not is_sharded_checkpoint(path):
        raise ValueError(
            f"ckpt_path {path} is a directory but not a sharded checkpoint "
            f"(no {DCP_METADATA_FILE} and {SHARDED_META_FILE})."
        )
    if path.is_file() and not zipfile.is_zipfile(path):
        raise ValueError(
            f"ckpt_path {path} is not a checkpoint (not a torch.save archive: truncated, or another kind of file)."
        )
    # a sharded checkpoint is loaded by the strategy once the process group exists: its checksums can wait
    verify_for_reading(path, verify, defer=defer_sharded and is_sharded_checkpoint(path))
    if manifest_path(path.resolve()).exists() and read_manifest(path.resolve()).reason == WEIGHTS_REASON:
        raise ValueError(
            f"ckpt_path {path} is a Mula weights file, not a training checkpoint; start from it with "
            "--model.init_weights instead."
        )
