"""Downstream evaluation of the model a Lightning Trainer holds, laid out by its strategy.

`evaluate_trainer_model` is the one path both `callbacks.DownstreamEval` (during `fit`) and
`mula eval --strategy` (`evaluate_with_strategy`) take: `MulaLM` over the LightningModule's model,
under the trainer's precision. A strategy that spreads the model over ranks (`XPUMoEStrategy`:
experts, pipeline stages, tensor shards) provides `spread_forward()` (a `mula.downstream.lm.SpreadModel`)
and the documents are split over its data-parallel ranks; any other strategy (DDP, one device) holds
the whole model on every rank and lm-eval splits the documents over all ranks. lm-eval's request
handling runs on every rank, each on its share; global rank 0 gets the results. OLMo's tasks take the same
`MulaLM` (`mula.downstream.olmo_score`: documents split over the same ranks, the same lock step).

`evaluate_with_strategy` evaluates one checkpoint at a training layout: it builds a Trainer with the
recipe's `trainer.strategy` entry (`{class_path, init_args}`) over `devices` x `num_nodes` processes
(Lightning launches them, or torchrun / srun / mpiexec did, as for `mula fit`), a
`MulaLightningModule` of the checkpoint's config, and runs `trainer.test` on one dummy batch after
scoring in `on_test_start`. A sharded checkpoint is loaded by the strategy (`ckpt_path`: each rank
reads its experts and stages only, at any layout); a single file through `init_weights` on every rank.
"""

from __future__ import annotations

import pydoc
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from typing_extensions import override

from mula.data.tokenizer import LoadedTokenizer
from mula.downstream.tasks import ResolvedTasks
from mula.model.config import MulaConfig
from mula.training.strategy_contract import mula_strategy


def evaluate_trainer_model(
    trainer: L.Trainer,
    pl_module: L.LightningModule,
    tokenizer: LoadedTokenizer,
    tasks: ResolvedTasks,
    limit: int | float | None,
    batch_size: int,
    on_batch: Any = None,
) -> dict[str, Any]:
    """`mula.downstream.evaluate.evaluate` of `pl_module.model` across the trainer's ranks (every rank
    calls this); the results on global rank 0, {} elsewhere."""
    from mula.downstream.evaluate import evaluate
    from mula.downstream.lm import MulaLM
    from mula.hf import tokenizer as hf_tokenizer

    strategy = mula_strategy(trainer.strategy)
    spread = strategy.spread_forward() if strategy is not None else None
    lm = MulaLM(
        pl_module.model,
        tokenizer,
        batch_size=batch_size,
        prefix_token_id=hf_tokenizer.special_token_ids(tokenizer)["bos_token_id"],
        data_parallel=True,
        on_batch=on_batch,
        spread=spread,
    )
    try:
        with trainer.precision_plugin.forward_context():  # the trainer's precision (autocast or none)
            results = evaluate(lm, tasks, limit)
    finally:
        if spread is not None:
            spread.close()  # buffers kept for the evaluation's batch shapes, not for training
    return results if trainer.is_global_zero else {}


def strategy_from_spec(spec: Any) -> Any:
    """A Lightning strategy from a recipe's `trainer.strategy` entry `{class_path, init_args}` (checked,
    one sentence for a bad entry; the strategy checks its own arguments)."""
    from lightning.pytorch.strategies import Strategy

    if not isinstance(spec, dict) or not isinstance(spec.get("class_path"), str):
        raise ValueError(
            "strategy must be a recipe's trainer.strategy entry, e.g. "
            "{class_path: strategies.XPUMoEStrategy, init_args: {expert_parallel_size: 2}}."
        )
    cls = pydoc.locate(spec["class_path"])
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ValueError(
            f"strategy class_path {spec['class_path']!r} does not name a Lightning strategy class."
        )
    init_args = spec.get("init_args") or {}
    if not isinstance(init_args, dict):
        raise ValueError(f"strategy init_args must be a mapping, got {init_args!r}.")
    try:
        return cls(**init_args)
    except TypeError as err:  # an argument the class does not take
        raise ValueError(f"strategy {spec['class_path']}: {err}.") from None


def check_layout(strategy: Any, world_size: int, config: MulaConfig) -> None:
    """Raise ValueError (one sentence) when the strategy's layout cannot hold `config` on `world_size`
    ranks (sizes not dividing the world, experts not divisible by E, ...): before anything is loaded."""
    contract = mula_strategy(strategy)
    if contract is not None:
        contract.parallel_layout(world_size, config)


class _ScoreOnTestStart(L.Callback):
    """Verifies the checkpoint when the ranks are up (global rank 0 reads it, every rank gets its verdict,
    before the model is built) and scores the tasks once the strategy has set up and loaded the model."""

    def __init__(
        self,
        ckpt: Path,
        verify: bool,
        tokenizer: LoadedTokenizer,
        tasks: ResolvedTasks,
        limit: int | float | None,
        batch_size: int,
    ) -> None:
        self.ckpt, self.verify = ckpt, verify
        self.tokenizer, self.tasks, self.limit, self.batch_size = tokenizer, tasks, limit, batch_size
        self.results: dict[str, Any] = {}

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from mula.checkpoint import verify_for_reading

        problem = None
        if trainer.is_global_zero:
            try:
                verify_for_reading(self.ckpt, self.verify)
            except (ValueError, FileNotFoundError) as err:
                problem = str(err)
        problem = trainer.strategy.broadcast(problem)
        if problem is not None:
            raise ValueError(problem)

    @override
    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.results = evaluate_trainer_model(
            trainer, pl_module, self.tokenizer, self.tasks, self.limit, self.batch_size
        )


def evaluate_with_strategy(
    ckpt: Path,
    config: MulaConfig,
    tokenizer: LoadedTokenizer,
    tasks: ResolvedTasks,
    settings: Any,
) -> dict[str, Any] | None:
    """Evaluate `ckpt` at the layout of `settings.strategy` over `settings.devices` x `settings.num_nodes`
    ranks; the results on global rank 0, None on the other ranks."""
    from torch.utils.data import DataLoader

    from mula.checkpoint import is_sharded_checkpoint
    from mula.downstream.devices import autocast_dtype, default_device
    from mula.training.module import MulaLightningModule

    strategy = strategy_from_spec(settings.strategy)  # its layout checked against `config` by the caller
    device = torch.device(settings.device) if settings.device else default_device()
    precision = "bf16-mixed" if autocast_dtype(device, settings.dtype) == torch.bfloat16 else "32-true"
    # a sharded checkpoint through the strategy's own loading (each rank reads its part), else whole
    contract = mula_strategy(strategy)
    sharded = is_sharded_checkpoint(ckpt) and contract is not None
    module = MulaLightningModule(
        config,
        init_weights=None if sharded else str(ckpt),
        verify_init_weights=False,  # verified in the scorer's setup
    )
    scorer = _ScoreOnTestStart(ckpt, settings.verify, tokenizer, tasks, settings.limit, settings.batch_size)
    trainer = L.Trainer(
        accelerator=device.type,
        devices=settings.devices,
        num_nodes=settings.num_nodes,
        strategy=strategy,
        precision=precision,
        logger=False,
        callbacks=[scorer],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        inference_mode=False,  # no_grad is enough; pipeline stages and DTensors are built here
        limit_test_batches=1,
    )
    # the test loop runs its hooks only with a batch: one short sequence, its loss computed and dropped
    # two tokens per tensor-parallel and context-parallel rank: sequence parallelism and context
    # parallelism split the sequence over them
    world = settings.devices * settings.num_nodes
    layout = contract.parallel_layout(world, config) if contract is not None else None
    tokens = 2 * (layout.tp * layout.cp if layout is not None else 1)
    dummy = DataLoader([torch.zeros(tokens + 1, dtype=torch.long)], batch_size=1)
    with warnings.catch_warnings():  # Lightning's advice for test runs does not apply to this one
        warnings.filterwarnings("ignore", message=".*sync_dist=True.*")  # the dummy batch's test/loss
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint.*")
        trainer.test(module, dataloaders=dummy, ckpt_path=str(ckpt) if sharded else None, verbose=False)
    return scorer.results if trainer.is_global_zero else None
