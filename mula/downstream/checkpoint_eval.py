"""Evaluate one checkpoint (any kind Mula reads) and record the results as JSON next to it.

`<checkpoint>.eval.json` holds the checkpoint's step and training tokens seen, and per task the
`limit` it was evaluated with, its metrics and per-example log-likelihoods (`mula.downstream.evaluate`).
A task already recorded with the same limit is not evaluated again; new tasks are added to the file
(written atomically, so an interrupted evaluation leaves the previous file).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mula.checkpoint import atomic_write_text, model_from_state_dict, read_checkpoint, verify_for_reading
from mula.data.tokenizer import LoadedTokenizer, load_tokenizer
from mula.downstream import check_limit
from mula.downstream.devices import EVAL_DTYPES, autocast_dtype, default_device
from mula.downstream.evaluate import evaluate
from mula.downstream.lm import MulaLM
from mula.downstream.tasks import ResolvedTasks
from mula.hf import tokenizer as hf_tokenizer
from mula.model.config import MulaConfig
from mula.model.kernels.backends import resolve_backend

RESULTS_SUFFIX = ".eval.json"


@dataclass
class EvalSettings:
    """How to evaluate: the tasks, the tokenizer (None: the run's), batch size, limit, device and dtype;
    with `strategy` (a recipe's `trainer.strategy` entry) at that layout over `devices` x `num_nodes` ranks."""

    tasks: ResolvedTasks
    tokenizer: str | None = None
    batch_size: int = 8
    limit: int | float | None = None
    device: str | None = None
    dtype: str = "auto"
    verify: bool = True
    strategy: dict[str, Any] | None = None
    devices: int = 1
    num_nodes: int = 1


def check_options(
    batch_size: int,
    device: str | None,
    dtype: str,
    devices: int = 1,
    num_nodes: int = 1,
    strategy: Any = None,
    limit: int | float | None = None,
) -> None:
    """Raise ValueError (one sentence) for a batch size, limit, device, dtype, process count or strategy
    that cannot work, before any work."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
    check_limit(limit)
    if devices < 1 or num_nodes < 1:
        raise ValueError(f"devices and num_nodes must be at least 1, got {devices} and {num_nodes}.")
    if strategy is None and devices * num_nodes > 1:
        raise ValueError(
            "devices x num_nodes > 1 needs --strategy (the layout to evaluate at, as a recipe's trainer.strategy)."
        )
    if strategy is not None:
        from mula.downstream.trainer_eval import strategy_from_spec

        strategy_from_spec(strategy)  # a bad class path or argument, now
    if dtype != "auto" and dtype not in EVAL_DTYPES:
        raise ValueError(f"dtype must be auto, float32 or bfloat16, got {dtype!r}.")
    if device is not None:
        try:
            kind = torch.device(device).type
        except RuntimeError:
            raise ValueError(
                f"device {device!r} is not a torch device (cpu, cuda, cuda:1, xpu, ...)."
            ) from None
        module = getattr(torch, kind, None)
        if kind != "cpu" and not (module is not None and module.is_available()):
            raise ValueError(f"device {device!r} is not available on this machine.")


def results_path(ckpt: Path) -> Path:
    """Where the results of `ckpt` are written: `<checkpoint>.eval.json`, next to it."""
    return ckpt.with_name(ckpt.name + RESULTS_SUFFIX)


def checkpoint_progress(ckpt: Path) -> tuple[int | None, int | None]:
    """(optimizer step, training tokens seen) recorded in a training checkpoint; None when not recorded."""
    from mula.data.datamodule import MulaDataModule

    state = hf_tokenizer.read_training_state(ckpt)
    if state is None:
        return None, None
    step = state.get("global_step")
    return (step if isinstance(step, int) else None), MulaDataModule.tokens_seen_in(state)


def read_results(ckpt: Path) -> dict[str, Any] | None:
    """The results recorded for `ckpt`, or None when it has none (or an unreadable file)."""
    try:
        record = json.loads(results_path(ckpt).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("tasks"), dict) else None


def pending_tasks(ckpt: Path, settings: EvalSettings) -> ResolvedTasks:
    """The tasks of `settings` not yet recorded for `ckpt` by the same harness with the same limit."""
    return settings.tasks.pending((read_results(ckpt) or {}).get("tasks", {}), settings.limit)


def checkpoint_config(ckpt: Path) -> MulaConfig:
    """The model config a checkpoint records, read without its tensors (a Lightning `.ckpt` or a sharded
    directory's `meta.pt`: `mula_config`; a Mula weights file: `config`)."""
    state = hf_tokenizer.read_training_state(ckpt) or {}
    entry = state.get("mula_config", state.get("config"))
    if not isinstance(entry, dict):
        raise ValueError(f"{ckpt} records no Mula model config (not a MulaLightningModule checkpoint).")
    return MulaConfig.from_dict(entry)


def load_tokenizer_for(ckpt: Path, config: MulaConfig, tokenizer: str | None) -> LoadedTokenizer:
    """`tokenizer` or the one the checkpoint's run recorded; it must fit the model's vocabulary."""
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    if tok is None:
        tok, reason = hf_tokenizer.resolve_tokenizer(ckpt, None)
        if tok is None:
            raise ValueError(f"{reason}; name it with --tokenizer PATH/tokenizer.json.")
    hf_tokenizer.check_fits(tok, config)
    return tok


def evaluate_checkpoint(
    ckpt: str | os.PathLike, settings: EvalSettings
) -> tuple[dict[str, Any] | None, list[str]]:
    """Evaluate the tasks of `settings` not yet recorded for `ckpt`; returns (the record, tasks evaluated now).

    Bad input (missing or corrupted checkpoint, a tokenizer larger than the model's vocabulary, a device or
    dtype the model cannot run on, a layout that cannot hold the model) raises FileNotFoundError /
    ValueError before the model is built. With `settings.strategy` every rank calls this; the other
    ranks than global rank 0 get (None, []) and write nothing, and the checkpoint is verified once the
    ranks are up, by global rank 0 alone (one read of it, not one per rank).
    """
    ckpt = Path(ckpt)
    if settings.strategy is None:
        verify_for_reading(ckpt, settings.verify)
    else:  # a layout that cannot hold the model: before reading any tensor
        from mula.downstream.trainer_eval import check_layout, evaluate_with_strategy, strategy_from_spec

        config = checkpoint_config(ckpt)
        check_layout(strategy_from_spec(settings.strategy), settings.devices * settings.num_nodes, config)
    todo = pending_tasks(ckpt, settings)
    record = read_results(ckpt) or {"checkpoint": ckpt.name, "tasks": {}}
    if not todo.all_names:
        return record, []
    if settings.strategy is not None:
        tok = load_tokenizer_for(ckpt, config, settings.tokenizer)
        results = evaluate_with_strategy(ckpt, config, tok, todo, settings)
        if results is None:
            return None, []  # not global rank 0: rank 0 records and reports
    else:
        results = _evaluate_on_one_device(ckpt, settings, todo)
    step, tokens = checkpoint_progress(ckpt)
    record.update(step=step, tokens_seen=tokens)
    for name, entry in results.items():
        record["tasks"][name] = {"limit": settings.limit, **entry}
    atomic_write_text(results_path(ckpt), json.dumps(record, indent=1) + "\n")
    return record, list(results)


def _evaluate_on_one_device(ckpt: Path, settings: EvalSettings, todo: ResolvedTasks) -> dict[str, Any]:
    """The whole model on one device (`settings.device`), read whole from the checkpoint."""
    config, state = read_checkpoint(ckpt, verify=False)  # verified by the caller
    tok = load_tokenizer_for(ckpt, config, settings.tokenizer)
    device = torch.device(settings.device) if settings.device else default_device()
    dtype = autocast_dtype(device, settings.dtype)
    if config.is_moe:
        resolve_backend(config.expert_backend, device, dtype or torch.float32)
    model = model_from_state_dict(config, state, source=str(ckpt)).to(device)
    bos = hf_tokenizer.special_token_ids(tok)["bos_token_id"]
    lm = MulaLM(model, tok, batch_size=settings.batch_size, autocast_dtype=dtype, prefix_token_id=bos)
    return evaluate(lm, todo, settings.limit)
