"""The `mula` training command: LightningCLI for fit / validate / test, and the full parser of `mula plan`.

    mula fit -c recipes/mula-tiny-moe.yaml [-c recipes/strategies/ddp.yaml] [--trainer.max_steps=10]

`mula.commands.entry` dispatches the subcommands (the tools live in `mula.commands.tools`); every parser is
jsonargparse's (so `-c file.yaml`, `--print_config` and `--help` work alike everywhere). A run's
loggers write under its run directory, `trainer.default_root_dir`, with its checkpoints. A `ValueError` or `FileNotFoundError` raised by
Mula before training starts (bad preset, missing data, tokenizer larger than the model, ...) is
printed as one line `mula: error: ...` with exit status 2; set `MULA_TRACEBACK=1` to see the
traceback instead. The same errors after the first training step are crashes: traceback and exit
status 1.
"""

from __future__ import annotations

import importlib.util
import os
import pydoc
import shutil
import sys
from typing import Any

import lightning.pytorch as L
import torch
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from mula.checkpoint import auto_resume_ckpt_path, check_ckpt_path, lock_run_dir_before_launch
from mula.commands.constructor_refusals import constructor_refusals
from mula.data import MulaDataModule
from mula.layout.parallel_layout import ParallelLayout
from mula.layout.run_check import RunSettings, check_run
from mula.model.config import MulaConfig
from mula.model.kernels.backends import resolve_backend
from mula.training.lightning_compat import leave_wandb_anonymous_unset
from mula.training.model_summary import StepFlopsSummary
from mula.training.module import MulaLightningModule
from mula.training.progress_bar import StepProgressBar
from mula.training.strategy_contract import mula_strategy


class MulaSaveConfig(SaveConfigCallback):
    """Saves the resolved config as config.yaml in the run directory (next to metrics.csv), as
    LightningCLI does, and adds it to the files of the W&B run."""

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Resolve the run directory on every rank (`trainer.log_dir` is a collective), then save."""
        self._log_dir = trainer.log_dir
        super().setup(trainer, pl_module, stage)

    @override
    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Upload (or, offline, stage for `wandb sync`) the saved config.yaml with each W&B run (rank 0 only):
        a copy in the run's files directory, which W&B uploads with the run (`wandb.save` would symlink it
        and say so on every run). A disabled W&B run (`WANDB_MODE=disabled`) has no files directory: nothing
        to stage."""
        from lightning.pytorch.loggers import WandbLogger

        path = os.path.join(self._log_dir, self.config_filename)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and os.path.isfile(path):
                files = logger.experiment.dir
                if os.path.isdir(files):
                    shutil.copy2(path, os.path.join(files, self.config_filename))


class MulaCLI(LightningCLI):
    """LightningCLI over `MulaLightningModule` + `MulaDataModule`: `mula fit|validate|test ARGS`.

    `mula.commands.entry` dispatches the trainer subcommands here (`args` starts with the subcommand, as for
    LightningCLI) and every other subcommand elsewhere; this class customises LightningCLI through its
    public hooks only.
    """

    def __init__(self, args: list[str] | None = None, **kwargs: Any) -> None:
        argv = sys.argv[1:] if args is None else args
        # the command line as given, for the options of its subcommand and the recipe reader's check
        self.argv: list[str] | None = [str(a) for a in argv] if isinstance(argv, list) else None
        # the trainer subcommand, first on the command line (none without subcommands: run=False)
        self.command = self.argv[0] if self.argv and kwargs.get("run", True) else None
        kwargs.setdefault("auto_configure_optimizers", False)  # the module owns AdamW + schedule
        kwargs.setdefault("parser_kwargs", {"prog": "mula"})
        kwargs.setdefault("save_config_callback", MulaSaveConfig)
        already_running = current_wandb_run()
        failed = True
        try:
            super().__init__(MulaLightningModule, MulaDataModule, args=argv, **kwargs)
            failed = False
        finally:
            finish_wandb_run(already_running, exit_code=1 if failed else 0)

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        """Trainer subcommands (predict is not offered: Mula is for pretraining)."""
        return {
            "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
            "validate": {"model", "dataloaders", "datamodule"},
            "test": {"model", "dataloaders", "datamodule"},
        }

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Every logger writes into the run directory, `--verify`, and the options of `mula fit` alone.

        The loggers' save_dir is a link from trainer.default_root_dir, so a recipe or flag never sets
        save_dir itself: a run's files move with its directory. `--verify` decides whether `--ckpt_path`
        and `--model.init_weights` are verified against their manifests before they are read
        (docs/resilience.md); it is the module's `verify_init_weights`. LightningCLI calls this for each
        trainer subcommand's parser; the options of `fit` alone go on them only when the command line
        runs `fit` (the other subcommands' parsers then go unused).
        """
        parser.link_arguments("trainer.default_root_dir", "trainer.logger.init_args.save_dir", run_dir)
        parser.add_argument(
            "--verify",
            type=bool,
            default=True,
            help="Verify --ckpt_path and --model.init_weights against their manifests and refuse a "
            "corrupted or incomplete checkpoint; false reads them as they are (forensics).",
        )
        parser.link_arguments("verify", "model.verify_init_weights")
        if self.command == "fit":
            add_fit_arguments(parser)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse, then check an explicit `--ckpt_path` before LightningCLI reads its hyperparameters from it.

        It must be a checkpoint that verifies (`check_ckpt_path`): a corrupted one, or something that
        is not a checkpoint at all, is bad input (exit 2) before any work, not a traceback. (`args` is
        the command line `mula.commands.entry` received, so LightningCLI's warning about `args` next to a
        non-empty sys.argv does not apply.)
        """
        self.config = (
            parser.parse_object(args) if isinstance(args, (dict, Namespace)) else parser.parse_args(args)
        )
        subcommand = self.config.get("subcommand")
        if subcommand in self.subcommands():
            config = self.config[subcommand]
            check_ckpt_path(config.get("ckpt_path"), verify=config.verify, defer_sharded=True)

    @override
    def before_instantiate_classes(self) -> None:
        """Name the W&B run after its run directory unless the recipe names it; a strategy given as a class
        path alone (`--trainer.strategy=strategies.XPUMoEStrategy`) is that class with its defaults."""
        trainer = self.config[self.subcommand].trainer
        name_wandb_run(trainer)
        strategy_class_path(trainer)

    @override
    def instantiate_classes(self) -> None:
        """LightningCLI's instantiation, with a sentence a recipe's class (the strategy, a callback) raises in
        its constructor reported as that sentence alone (`mula.commands.constructor_refusals`)."""
        with constructor_refusals():
            super().instantiate_classes()

    @override
    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        """LightningCLI's trainer, with `StepProgressBar` (optimizer steps against max_steps) as its progress
        bar unless the recipe turns the bar off or names a progress bar of its own, and `StepFlopsSummary`
        (the model's FLOPs per step, not Lightning's 0) as its model summary on the same terms; a W&B
        logger's `wandb.init` is not given `anonymous` unless the recipe sets it (wandb warns on every run
        that the setting has no effect)."""
        # (no subcommand: `mula plan` and `mula bench` parse one configuration without one)
        config = (self.config_init[self.subcommand] if self.subcommand else self.config_init).trainer
        callbacks = config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        added: list[Any] = []
        shows_bar = config.get("enable_progress_bar") is not False
        if shows_bar and not any(isinstance(c, ProgressBar) for c in callbacks):
            added.append(StepProgressBar())
        shows_summary = config.get("enable_model_summary") is not False
        if shows_summary and not any(isinstance(c, ModelSummary) for c in callbacks):
            added.append(StepFlopsSummary())
        if added:
            kwargs.setdefault("callbacks", [*callbacks, *added])
        trainer = super().instantiate_trainer(**kwargs)
        from lightning.pytorch.loggers import WandbLogger

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                leave_wandb_anonymous_unset(logger)
        return trainer

    def fit(
        self, model: L.LightningModule, datamodule: L.LightningDataModule | None = None, **kwargs: Any
    ) -> None:
        """`trainer.fit` (LightningCLI runs a method of the CLI named after the subcommand in place of the
        trainer's): a ValueError / FileNotFoundError after the first step is a crash, not bad input.

        Bad input is caught before the first step (exit 2); an error after it is a crash (exit 1, with
        traceback, which scripts/mula-resilient restarts), not a configuration problem.
        """
        try:
            self.trainer.fit(model, datamodule=datamodule, **kwargs)
        except (ValueError, FileNotFoundError) as e:
            if self.trainer.global_step > 0:
                raise RuntimeError(f"training failed at step {self.trainer.global_step}: {e}") from e
            raise

    # model-vs-data checks (missing data, tokenizer vocab, seq_len) before the trainer starts any work
    def before_fit(self) -> None:
        """Check that the data fits the model, lock the run directory, and resume the run when it has checkpoints.

        The lock (`mula.checkpoint.lock`) comes before anything reads or writes the run directory: a
        second run on it stops here with one sentence naming the holder (exit 2). Without
        `--ckpt_path`, a checkpoint callback that offers `resume_checkpoint_path`
        (`callbacks.FaultTolerantCheckpoint`) names the newest valid checkpoint of the run directory,
        so re-running the same command continues an interrupted run; if the run has checkpoints and
        none is valid, it stops (exit 2) unless `--restart_from_scratch=true` (docs/resilience.md).
        """
        self._check_recipe_reader()
        self._check_model_inputs()
        self._check_memory()
        lock_run_dir_before_launch(self.trainer)
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") is None:
            path = auto_resume_ckpt_path(self.trainer, bool(config.get("restart_from_scratch")))
            if path is not None:
                self.trainer.ckpt_path = path

    def _check_recipe_reader(self) -> None:
        """Once per run: `mula plan`'s light reader reads this command line as jsonargparse did, or a warning
        reports the bug (`mula.plan.reader_check.reader_mismatch`); the run goes on with jsonargparse's parse,
        which is the one it uses either way."""
        if self.argv is None or self.argv[:1] != ["fit"]:
            return  # settings given as a dict, or options before `fit`: not a command line `mula plan` takes
        from mula.plan.reader_check import reader_mismatch
        from mula.plan.recipe_reader import SECTIONS

        config = self.config[self.subcommand]
        options = [k for k in vars(config) if k not in (*SECTIONS, "config", "seed_everything", "verify")]
        message = reader_mismatch(self.argv[1:], self._sections(), options, self.trainer.world_size)
        if message is not None:
            rank_zero_warn(message)

    def _sections(self) -> dict[str, dict[str, Any]]:
        """The parsed trainer, model and data sections as plain dicts (what the planner reads)."""
        config = self.config[self.subcommand]
        return {
            k: config[k].as_dict() if config.get(k) is not None else {} for k in ("trainer", "model", "data")
        }

    def _check_memory(self) -> None:
        """Stop before any allocation when the predicted per-rank bytes exceed the device (`--memory_check`)."""
        config = self.config[self.subcommand]
        if not config.get("memory_check", True):
            return
        from mula.plan.command import check_fit_memory

        check_fit_memory(
            **self._sections(),
            world_size=self.trainer.world_size,
            device_memory_gb=config.get("device_memory_gb"),
        )

    def before_validate(self) -> None:
        """Check that the data fits the model before validating."""
        self._check_model_inputs()

    def before_test(self) -> None:
        """Check that the data fits the model before testing."""
        self._check_model_inputs()

    def _check_model_inputs(self) -> None:
        """The data fits the model and the expert backend runs on the trainer's device and precision."""
        self.datamodule.validate_against(self.model.config)
        check_expert_backend(self.model.config, self.trainer)
        strategy = mula_strategy(self.trainer.strategy)
        layout = (
            ParallelLayout(None) if strategy is None else strategy.parallel_layout(self.trainer.world_size)
        )
        check_run(
            RunSettings(
                layout, precision=str(self.trainer.precision),
                fp32_masters=strategy is not None and strategy.keeps_fp32_master_weights,
                strategy=type(self.trainer.strategy).__name__,
                offload=strategy is not None and strategy.offloads_optimizer, optimizer=self.model.optimizer,
            )
        )  # fmt: skip


class PlanCLI(MulaCLI):
    """The full parser of `mula plan ARGS`: `mula fit`'s trainer/model/data options plus the planner's
    (`mula.plan.command`), for the command lines the light reader leaves to it; it builds nothing."""

    def __init__(self, args: list[str]) -> None:
        super().__init__(
            args=list(args),
            run=False,
            parser_kwargs={"prog": "mula plan"},
            load_from_checkpoint_support=False,
        )

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """`mula fit`'s own options (links, `--verify`) and the planner's."""
        from mula.plan.command import add_plan_arguments

        super().add_arguments_to_parser(parser)
        add_plan_arguments(parser)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse; planning draws no random numbers, so LightningCLI is told not to seed (nor to say so)."""
        super().parse_arguments(parser, args)
        self.config.seed_everything = False

    @override
    def before_instantiate_classes(self) -> None:
        """Nothing: no run directory, no W&B run."""

    @override
    def instantiate_classes(self) -> None:
        """Nothing: the planner reads the parsed values."""

    def run(self) -> dict[str, Any]:
        """Plan the parsed command line (`mula.plan.command.run_plan`) and return the plan."""
        from mula.plan import command

        args = self.config.as_dict()
        args.pop("config", None)  # the -c option itself
        return command.run_plan(**args)


def plan(args: list[str]) -> dict[str, Any]:
    """`mula plan ARGS` through the full parser (the light reader could not read ARGS exactly)."""
    return PlanCLI(args).run()


def add_fit_arguments(parser: LightningArgumentParser) -> None:
    """The options of `mula fit` that LightningCLI does not have: resuming and the start-of-run memory check."""
    parser.add_argument(
        "--restart_from_scratch",
        type=bool,
        default=False,
        help="When every checkpoint of the run directory is invalid, train from step 0 instead of"
        " stopping (exit 2). A valid checkpoint is still resumed from.",
    )
    parser.add_argument(
        "--memory_check",
        type=bool,
        default=True,
        help="Stop (exit 2) before allocating anything when `mula plan` predicts more bytes per rank than"
        " the device has (on CPU: host RAM over the local ranks); false starts anyway.",
    )
    parser.add_argument(
        "--device_memory_gb",
        type=float | None,
        default=None,
        help="Device memory for the start-of-run check, in GB (default: the device's own).",
    )


def run_dir(default_root_dir: str | None) -> str:
    """The run directory: trainer.default_root_dir, or the working directory as for Lightning."""
    return default_root_dir or os.getcwd()


def name_wandb_run(trainer_config: Any) -> None:
    """Give each unnamed W&B logger in `trainer_config.logger` the run directory's name; refuse one when
    wandb is not installed (it is the `wandb` extra)."""
    from lightning.pytorch.loggers import WandbLogger

    loggers = trainer_config.logger  # a list, one logger, or a bool / None
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        if not isinstance(logger, Namespace):
            continue
        init_args = logger.get("init_args")
        cls = pydoc.locate(logger.get("class_path", ""))
        is_wandb = isinstance(cls, type) and issubclass(cls, WandbLogger)
        if is_wandb and importlib.util.find_spec("wandb") is None:
            raise ValueError(
                "the recipe logs to Weights & Biases (trainer.logger names WandbLogger) but wandb is not "
                "installed: pip install 'mula[wandb]' (scripts/setup.sh does), or set trainer.logger without it."
            )
        if is_wandb and init_args is not None and init_args.get("name") is None:
            init_args.name = os.path.basename(os.path.normpath(run_dir(trainer_config.default_root_dir)))


def current_wandb_run() -> Any:
    """The W&B run in progress in this process, or None (also when nothing has imported wandb)."""
    wandb = sys.modules.get("wandb")
    return None if wandb is None else wandb.run


def finish_wandb_run(already_running: Any, exit_code: int) -> None:
    """Finish the W&B run this command started, if it started one (`already_running` is the run in
    progress before it: a run the caller started, which Lightning's WandbLogger reuses, is theirs to end).

    Lightning's WandbLogger leaves its run open when training ends. A second `mula fit` in the same
    process (a notebook, a sweep, the test suite) would then log into the first run and its directory.
    """
    run = current_wandb_run()
    if run is not None and run is not already_running:
        run.finish(exit_code=exit_code)


def strategy_class_path(trainer_config: Any) -> None:
    """Turn `trainer_config.strategy` given as a dotted path to a `Strategy` class into that class with
    its defaults: jsonargparse keeps such a string as a string (the Trainer's `strategy` is `str |
    Strategy`), and Lightning would then look it up as a registered strategy name and fail."""
    from lightning.pytorch.strategies import Strategy

    name = trainer_config.get("strategy")
    if isinstance(name, str) and "." in name:
        cls = pydoc.locate(name)
        if isinstance(cls, type) and issubclass(cls, Strategy):
            trainer_config.strategy = Namespace(class_path=name, init_args=Namespace())


def check_expert_backend(config: MulaConfig, trainer: L.Trainer) -> None:
    """Fail before any work when the recipe's expert backend cannot run on the trainer's device/precision."""
    if config.is_moe:
        precision = str(trainer.precision)
        dtype = (
            torch.bfloat16 if "bf16" in precision else torch.float16 if "16" in precision else torch.float32
        )
        resolve_backend(config.expert_backend, trainer.strategy.root_device, dtype)
