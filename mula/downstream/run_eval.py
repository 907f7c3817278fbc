"""Evaluate the checkpoints of a run directory, log the results to the run's loggers, plot accuracy.

A run directory (`trainer.default_root_dir`) holds `checkpoints/step=N.ckpt` (the ones
`callbacks.FaultTolerantCheckpoint` kept) and `version_N/config.yaml` (its resolved configuration).
`evaluate_run` evaluates every complete checkpoint in step order, skipping tasks already recorded in
`<checkpoint>.eval.json`; new results are logged, against the checkpoint's step (and with its
`tokens_seen`), to loggers built from the run's own `trainer.logger` configuration (the CSV logger
writes a new `version_N`, the W&B logger continues the run's W&B run), and `downstream_eval.png`
plots each task's accuracy over tokens seen from every record in the run, pruned checkpoints' included.
"""

from __future__ import annotations

import logging
import os
import pydoc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mula.checkpoint import list_checkpoints
from mula.downstream.checkpoint_eval import RESULTS_SUFFIX, EvalSettings, evaluate_checkpoint, read_results
from mula.downstream.evaluate import metric_keys
from mula.downstream.plot import plot_accuracy

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
PLOT_FILE = "downstream_eval.png"


def run_dir_of(ckpt: Path) -> Path | None:
    """The run directory of a checkpoint in `<run>/checkpoints/`, None for a file elsewhere."""
    parent = ckpt.absolute().parent
    return parent.parent if parent.name == CHECKPOINT_DIR else None


def run_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints (those with a manifest), oldest first; raises when there is none."""
    ckpt_dir = run_dir / CHECKPOINT_DIR
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a run directory: it has no {CHECKPOINT_DIR}/ directory.")
    found = [e.path for e in reversed(list_checkpoints(ckpt_dir)) if e.manifest.exists()]
    if not found:
        raise ValueError(
            f"{ckpt_dir} holds no complete checkpoint (step=N.ckpt with its manifest) to evaluate."
        )
    return found


def evaluate_run(
    run_dir: str | os.PathLike,
    settings: EvalSettings,
    report: Callable[[Path, dict[str, Any], list[str]], None],
) -> Path | None:
    """Evaluate every checkpoint of `run_dir` (see the module docstring); returns the plot's path (None: no plot).

    `report(checkpoint, record, tasks evaluated now)` is called after each checkpoint.
    """
    run_dir = Path(run_dir)
    if not _evaluate_and_log(run_checkpoints(run_dir), run_dir, settings, report):
        return None  # another rank than global rank 0 of a multi-rank evaluation
    plot = run_dir / PLOT_FILE
    return plot if plot_accuracy(list(iter_run_results(run_dir)), plot) else None


def evaluate_one(
    ckpt: str | os.PathLike, settings: EvalSettings, report: Callable[[Path, dict[str, Any], list[str]], None]
) -> None:
    """Evaluate one checkpoint; a checkpoint of a run directory logs its new results to the run's loggers."""
    _evaluate_and_log([Path(ckpt)], run_dir_of(Path(ckpt)), settings, report)


def _evaluate_and_log(
    checkpoints: list[Path],
    run_dir: Path | None,
    settings: EvalSettings,
    report: Callable[[Path, dict[str, Any], list[str]], None],
) -> bool:
    """Evaluate, log and report each checkpoint; False on the ranks other than global rank 0 of a
    multi-rank evaluation (`settings.strategy`), which evaluate but neither log nor report."""
    loggers: list[Any] | None = None  # built on the first new result: a re-run that adds nothing logs nothing
    reporting = not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)
    for ckpt in checkpoints:
        record, evaluated = evaluate_checkpoint(ckpt, settings)
        reporting = reporting and record is not None
        if not reporting:
            continue
        if evaluated and run_dir is not None:
            loggers = run_loggers(run_dir) if loggers is None else loggers
            log_record(loggers, record, evaluated)
        report(ckpt, record, evaluated)
    for logger in loggers or []:
        logger.finalize("success")
    return reporting


def iter_run_results(run_dir: Path) -> Iterator[dict[str, Any]]:
    """Every results record in the run's checkpoint directory, pruned checkpoints' included."""
    for path in sorted((run_dir / CHECKPOINT_DIR).glob(f"*{RESULTS_SUFFIX}")):
        record = read_results(path.with_name(path.name.removesuffix(RESULTS_SUFFIX)))
        if record is not None:
            yield record


def log_record(loggers: list[Any], record: dict[str, Any], tasks: list[str]) -> None:
    """Log the metrics of `tasks` in `record` against its step, with its tokens seen."""
    if record.get("step") is None:
        return  # a weights file has no place on a training curve
    metrics = metric_keys({t: record["tasks"][t] for t in tasks})
    if record.get("tokens_seen") is not None:
        metrics["eval/tokens_seen"] = float(record["tokens_seen"])
    for logger in loggers:
        logger.log_metrics(metrics, step=record["step"])
        logger.save()


def run_loggers(run_dir: Path) -> list[Any]:
    """The loggers of the run's newest `version_N/config.yaml`, writing into `run_dir` ([] when it has none).

    A W&B logger continues the run's newest W&B run (`wandb/latest-run`) when there is one.
    """
    import yaml
    from lightning.pytorch.loggers import Logger, WandbLogger

    configs = sorted(run_dir.glob("version_*/config.yaml"), key=lambda p: int(p.parent.name.split("_")[-1]))
    if not configs:
        return []
    entries = (yaml.safe_load(configs[-1].read_text()) or {}).get("trainer", {}).get("logger")
    loggers = []
    for entry in entries if isinstance(entries, list) else [entries]:
        cls = pydoc.locate(entry.get("class_path", "")) if isinstance(entry, dict) else None
        if not (isinstance(cls, type) and issubclass(cls, Logger)):
            continue
        # unset (None) arguments keep their defaults; W&B warns about some deprecated ones merely being passed
        init_args = {k: v for k, v in (entry.get("init_args") or {}).items() if v is not None}
        init_args["save_dir"] = str(run_dir)
        if issubclass(cls, WandbLogger):
            run_id = _latest_wandb_id(run_dir)
            if run_id is not None:
                init_args.update(id=run_id, resume="allow")
        loggers.append(cls(**init_args))
    return loggers


def _latest_wandb_id(run_dir: Path) -> str | None:
    """The id of the run's newest W&B run: `wandb/latest-run` -> `(offline-)run-<date>-<id>`."""
    latest = run_dir / "wandb" / "latest-run"
    if not latest.exists():
        return None
    return latest.resolve().name.rsplit("-", 1)[-1]
