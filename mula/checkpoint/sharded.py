"""The sharded checkpoint directory format: ``torch.distributed.checkpoint`` (DCP) shards plus ``meta.pt``.

A directory holds the DCP files (``*.distcp`` and DCP's ``.metadata`` index, which DCP writes after
all shards) with the tensors -- the LightningModule's state dict under ``"state_dict"``, expert
stacks as whole ``[E_total, ...]`` tensors, plus whatever optimizer state the writer adds -- and
``meta.pt``, the non-tensor rest of Lightning's checkpoint dict (loops, schedulers, callbacks,
``mula_config``), written atomically by rank 0 after the shards. Neither file says the checkpoint is
committed; the manifest does (see ``mula.checkpoint``). The strategy-side part (which tensors, how
they are laid out across ranks) lives in ``strategies/sharded_state.py``.
"""

from __future__ import annotations

import io
import math
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from mula.checkpoint.atomic import atomic_write, save_torch
from mula.checkpoint.staging import HostStager

SHARDED_META_FILE = "meta.pt"  # the non-tensor part (Lightning's own name for it)
DCP_METADATA_FILE = ".metadata"  # DCP's index of the shards
MODEL_KEY = "state_dict"  # the LightningModule's tensors, as in a single-file Lightning checkpoint
SHARDED_SKIP = ("optimizer_states", "lr_schedulers", "loops", "callbacks")  # not needed for weights


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """True for a directory of DCP shards (with their ``.metadata`` index) plus the ``meta.pt`` file."""
    path = Path(path)
    return path.is_dir() and (path / DCP_METADATA_FILE).is_file() and (path / SHARDED_META_FILE).is_file()


def write_sharded_checkpoint(
    path: Path, tensors: dict[str, Any], meta: dict[str, Any], is_global_zero: bool
) -> None:
    """Write a sharded checkpoint directory (collective: every rank calls it with its own shards).

    ``tensors`` goes to DCP (each rank writes its part), ``meta`` to ``meta.pt`` (rank 0, atomically).
    """
    if path.is_file():
        raise ValueError(f"Checkpoint path {path} is an existing file; sharded checkpoints are directories.")
    path.mkdir(parents=True, exist_ok=True)
    # a rank's write error is raised on every rank by DCP itself
    dcp.save(tensors, storage_writer=FileSystemWriter(str(path)))
    error: Exception | None = None
    if is_global_zero:
        try:
            with atomic_write(path / SHARDED_META_FILE) as tmp:
                save_torch(meta, tmp)
        except Exception as err:  # re-raised after the barrier, which the other ranks are waiting in
            error = err
    if dist.is_initialized():
        dist.barrier()
    if error is not None:
        raise error


def start_sharded_write(
    path: Path, tensors: dict[str, Any], meta: dict[str, Any], is_global_zero: bool, group: Any
) -> Future:
    """Begin writing a sharded checkpoint directory in the background (collective); returns a future
    that completes when this rank's shards (and, on rank 0, ``meta.pt``) are written.

    ``dcp.async_save`` stages ``tensors`` into host memory (``staging.HostStager``) before it returns (training may change
    the live tensors from then on) and writes them from a background thread, running its own
    collectives over ``group``, which must have a CPU backend (gloo) and must not be the group the
    training step uses (two threads must never interleave collectives on one group). ``meta`` is
    serialised now, for the same reason, and written after the shards.
    """
    if path.is_file():
        raise ValueError(f"Checkpoint path {path} is an existing file; sharded checkpoints are directories.")
    path.mkdir(parents=True, exist_ok=True)
    meta_bytes = None
    if is_global_zero:
        buffer = io.BytesIO()
        torch.save(meta, buffer)
        meta_bytes = buffer.getvalue()
    upload = dcp.async_save(
        tensors, storage_writer=FileSystemWriter(str(path)), process_group=group, async_stager=HostStager()
    )
    if isinstance(upload, AsyncSaveResponse):  # what async_save returns with a custom stager
        upload = upload.upload_completion
    done: Future = Future()

    def finish(future: Future) -> None:  # in DCP's writer thread, once the shards are written
        try:
            future.result()
            if meta_bytes is not None:
                with atomic_write(path / SHARDED_META_FILE) as tmp:
                    Path(tmp).write_bytes(meta_bytes)
            done.set_result(None)
        except BaseException as err:  # noqa: BLE001 (handed to whoever waits for the future)
            done.set_exception(err)

    upload.add_done_callback(finish)
    return done


def saved_keys(path: str | os.PathLike) -> set[str]:
    """The flattened names of every tensor (and DCP-pickled object) stored in a sharded checkpoint."""
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def tensor_bytes_by_writer(path: str | os.PathLike) -> tuple[dict[int, int], int]:
    """(tensor bytes each rank wrote, bytes of every saved tensor counted once) of a sharded checkpoint,
    from DCP's index: the first sums to the second exactly when no two ranks wrote the same bytes.

    A rank's bytes are the tensor payload of the chunks in its files (``__<rank>_<n>.distcp``), without
    the files' framing and the pickled non-tensor entries.
    """
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    chunk_bytes: dict[tuple[str, tuple[int, ...]], int] = {}
    total = 0
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        itemsize = md.properties.dtype.itemsize
        total += math.prod(md.size) * itemsize
        for chunk in md.chunks:
            chunk_bytes[(fqn, tuple(chunk.offsets))] = math.prod(chunk.sizes) * itemsize
    written: dict[int, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        rank = int(info.relative_path.split("_")[2])  # FileSystemWriter names a rank's files __<rank>_<n>
        written[rank] = written.get(rank, 0) + chunk_bytes.get((index.fqn, tuple(index.offset or ())), 0)
    return written, total


def read_sharded_meta(path: str | os.PathLike, weights_only: bool = True) -> dict[str, Any]:
    """The non-tensor part of a sharded checkpoint (Lightning's loops, schedulers, ``mula_config``, ...)."""
    return torch.load(Path(path) / SHARDED_META_FILE, map_location="cpu", weights_only=weights_only)


def read_sharded_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A sharded checkpoint as one Lightning-style dict with the full model state dict (one process).

    Every model tensor is read whole (expert stacks in global expert order); optimizer, scheduler and
    loop state are left out, since they only matter for resuming, which the strategy does sharded.
    """
    path = Path(path)
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    prefix = f"{MODEL_KEY}."
    weights = {
        key[len(prefix) :]: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    dcp.load({MODEL_KEY: weights}, checkpoint_id=path, no_dist=True)
    meta = read_sharded_meta(path)
    return {**{k: v for k, v in meta.items() if k not in SHARDED_SKIP}, MODEL_KEY: weights}
