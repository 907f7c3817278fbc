"""Mula weights files (a config plus a state dict in one `.pt`) and reading any Mula checkpoint's weights.

Format: `torch.save({"format": "mula", "config": asdict(config), "state_dict": model.state_dict()})`.
`read_checkpoint` / `load_weights` also read a Lightning `.ckpt` written by `MulaLightningModule`
(config under "mula_config", parameters under "state_dict" with a "model." prefix), and a sharded
checkpoint directory (`mula.checkpoint.sharded`), gathered into full tensors in one process.
Both verify the checkpoint first (`mula.checkpoint.reading.verify_for_reading`), and `save_weights`
writes a manifest next to the weights file so that weights files verify like checkpoints do.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from mula.checkpoint.atomic import atomic_write, save_torch
from mula.checkpoint.manifest import WEIGHTS_REASON, build_manifest, manifest_path, write_manifest
from mula.checkpoint.reading import verify_for_reading
from mula.checkpoint.sharded import (
    DCP_METADATA_FILE,
    SHARDED_META_FILE,
    is_sharded_checkpoint,
    read_sharded_checkpoint,
)
from mula.model.config import MulaConfig
from mula.model.transformer import Mula

FORMAT = "mula"


def save_weights(model: Mula, path: str | os.PathLike) -> None:
    """Write `model`'s config and weights to `path` (a Mula weights file), atomically, then its manifest.

    The manifest (`<path>.manifest.json`, written last as for checkpoints) lets every reader verify
    the file; a stale one is removed first, so a crash in between leaves a file without a manifest
    (read with a warning), never one with a wrong manifest.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "config": dataclasses.asdict(model.config), "state_dict": model.state_dict()}
    manifest_path(path).unlink(missing_ok=True)
    with atomic_write(path) as tmp:
        save_torch(payload, tmp)
    write_manifest(path, build_manifest(path, step=0, reason=WEIGHTS_REASON))


def _read(path: Path) -> Any:
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {path} does not exist.")
    if path.is_dir():
        if is_sharded_checkpoint(path):
            return read_sharded_checkpoint(path)
        raise ValueError(
            f"{path} is a directory but not a sharded Mula checkpoint "
            f"(no {DCP_METADATA_FILE} and {SHARDED_META_FILE})."
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, AttributeError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path} is not a Mula checkpoint (torch.load failed: {first_line}).") from None


def _strip_prefixes(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Lightning keys `model.<name>` (and `model._orig_mod.<name>` after torch.compile) -> `<name>`."""
    out = {}
    for key, value in state_dict.items():
        if not key.startswith("model."):
            continue  # other module state (e.g. metrics) is not part of the model
        key = key[len("model.") :]
        out[key.removeprefix("_orig_mod.")] = value
    return out


def read_checkpoint(
    path: str | os.PathLike, verify: bool = True
) -> tuple[MulaConfig, dict[str, torch.Tensor]]:
    """(config, model state dict) from a Mula weights file or a MulaLightningModule checkpoint.

    `verify=False` skips the check against the manifest (`verify_for_reading`): for forensics, or
    when the caller verified the checkpoint already.
    """
    path = Path(path)
    verify_for_reading(path, verify)
    obj = _read(path)
    if isinstance(obj, dict) and obj.get("format") == FORMAT and "config" in obj and "state_dict" in obj:
        return MulaConfig.from_dict(obj["config"]), obj["state_dict"]
    if isinstance(obj, dict) and "mula_config" in obj and "state_dict" in obj:
        return MulaConfig.from_dict(obj["mula_config"]), _strip_prefixes(obj["state_dict"])
    raise ValueError(
        f"{path} is not a Mula checkpoint (expected a Mula weights file or a Lightning checkpoint "
        "with a 'mula_config' entry)."
    )


def model_from_state_dict(
    config: MulaConfig, state_dict: dict[str, torch.Tensor], source: str = "state dict"
) -> Mula:
    """Build a `Mula` for `config` holding exactly `state_dict` (no random init, no extra copy)."""
    with torch.device("meta"):
        model = Mula(config)
    expected = set(model.state_dict())
    got = set(state_dict)
    if config.tie_embeddings:
        got.add("lm_head.weight")  # a tied head may be saved once, under embed.weight
    if expected != got:
        missing, extra = sorted(expected - got), sorted(got - expected)
        raise ValueError(
            f"{source} does not match its config ({config.name}): missing {missing[:4]}, "
            f"unexpected {extra[:4]} (an expert-parallel shard or another architecture?)."
        )
    sd = dict(state_dict)
    if config.tie_embeddings:
        sd["lm_head.weight"] = sd["embed.weight"]
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(
            f"{source} does not match its config ({config.name}): {str(e).splitlines()[-1].strip()}"
        ) from None
    model.tie_weights()
    return model


def load_weights(path: str | os.PathLike, verify: bool = True) -> Mula:
    """Read a Mula weights file (or a MulaLightningModule `.ckpt`) into a `Mula` on the CPU (see `read_checkpoint`)."""
    config, state_dict = read_checkpoint(path, verify)
    return model_from_state_dict(config, state_dict, source=str(path))
