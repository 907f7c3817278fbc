"""The `mula` command: LightningCLI for fit / validate / test, plus the data and weights tools.

    mula fit -c recipes/mula-tiny-moe.yaml [-c recipes/strategies/ddp.yaml] [--trainer.max_steps=10]
    mula prepare --help | mula train-tokenizer --help | mula import-hf --help | mula export-hf --help
    mula plan --help | mula eval --help | mula report RUN_DIR

Every subcommand is parsed by the same jsonargparse parser (so `-c file.yaml`, `--print_config` and
`--help` work alike everywhere). A run's loggers write under its run directory,
`trainer.default_root_dir`, with its checkpoints. A `ValueError` or `FileNotFoundError` raised by
Mula before training starts (bad preset, missing data, tokenizer larger than the model, ...) is
printed as one line `mula: error: ...` with exit status 2; set `MULA_TRACEBACK=1` to see the
traceback instead. The same errors after the first training step are crashes: traceback and exit
status 1.
"""

from __future__ import annotations

import inspect
import os
import pydoc
import sys
from collections.abc import Callable
from typing import Any

import lightning.pytorch as L
import torch
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from mula.checkpoint import auto_resume_ckpt_path, check_ckpt_path, lock_run_dir_before_launch
from mula.config import MulaConfig
from mula.data import MulaDataModule
from mula.entry import report_bad_input
from mula.kernels.backends import resolve_backend
from mula.module import MulaLightningModule, check_master_weights


def import_hf(hf_dir: str, output: str) -> None:
    """Convert a Hugging Face OLMoE / OLMo model directory into a Mula weights file.

    Args:
        hf_dir: Directory with config.json and the weights (*.safetensors or pytorch_model*.bin).
        output: Mula weights file to write (.pt); it must not exist yet. Train from it with
            `--model.init_weights=<output>`.
    """
    from mula.hf import import_hf as _import_hf

    model = _import_hf(hf_dir, output)
    print(f"mula: wrote {output} ({model.config.name}, {model.config.num_params() / 1e9:.2f}B parameters)")


def export_hf(
    ckpt: str, output: str, dtype: str | None = None, tokenizer: str | None = None, verify: bool = True
) -> None:
    """Write a Mula checkpoint (Lightning .ckpt or Mula weights file) as a Hugging Face model directory.

    Args:
        ckpt: A checkpoint written by `mula fit` (runs/<name>/.../checkpoints/*.ckpt) or by `mula import-hf`.
        output: Directory to create (must not exist); loadable with transformers' AutoModelForCausalLM
            and, with a tokenizer, AutoTokenizer.
        dtype: float32, bfloat16 or float16 (default: the checkpoint's dtype).
        tokenizer: The tokenizer.json to ship with the model (or a directory holding one); default: the
            one the run that wrote `ckpt` was trained with.
        verify: Check `ckpt` against its manifest first and refuse a corrupted or incomplete one
            (docs/resilience.md); false exports it as it is, for forensics.
    """
    from mula.hf import export_hf as _export_hf

    no_tokenizer = _export_hf(ckpt, output, dtype=dtype, tokenizer=tokenizer, verify=verify)
    print(f"mula: wrote {output}")
    if no_tokenizer:
        print(
            f"mula: warning: no tokenizer exported: {no_tokenizer}; AutoTokenizer cannot load {output} "
            "until you export again with --tokenizer PATH/tokenizer.json.",
            file=sys.stderr,
        )


def evaluate(
    tasks: str | None = None,
    ckpt: str | None = None,
    run: str | None = None,
    include_path: str | None = None,
    tokenizer: str | None = None,
    batch_size: int = 8,
    limit: int | float | None = None,
    device: str | None = None,
    dtype: str = "auto",
    verify: bool = True,
) -> None:
    """Evaluate a checkpoint, or every checkpoint of a run, on lm-evaluation-harness tasks (the `eval` extra).

    Results are printed, written as <checkpoint>.eval.json next to each checkpoint (tasks already
    recorded there are not evaluated again) and logged to the run's loggers as eval/<task>/<metric>
    against the checkpoint's step; --run also plots each task's accuracy over tokens seen
    (<run>/downstream_eval.png).

    Args:
        tasks: Comma-separated lm-eval task names (arc_easy,hellaswag,...; downloaded on first use) and/or
            local task YAML files in lm-eval's custom-task format (offline with local JSONL data).
        ckpt: One checkpoint: a Lightning .ckpt, a Mula weights file or a sharded checkpoint directory.
        run: A run directory (trainer.default_root_dir): every checkpoint in its checkpoints/, in step order.
        include_path: A directory of task YAML files whose task names --tasks may then use.
        tokenizer: The tokenizer.json to use (or a directory holding one); default: the one the run trained with.
        batch_size: Sequences per forward pass.
        limit: Evaluate only the first N documents of each task (a fraction of them below 1), for quick checks.
        device: cpu, cuda, xpu, cuda:1, ...; default: the first accelerator present, else the CPU.
        dtype: auto (bf16 autocast on an accelerator that has it, fp32 on the CPU), float32 or bfloat16.
        verify: Check each checkpoint against its manifest first and refuse a corrupted one.
    """
    from pathlib import Path

    from mula.downstream import require_lm_eval

    require_lm_eval()
    from mula.downstream.checkpoint_eval import EvalSettings, check_options
    from mula.downstream.run_eval import evaluate_one, evaluate_run
    from mula.downstream.tasks import resolve_tasks

    if (ckpt is None) == (run is None):
        raise ValueError("give exactly one of --ckpt (one checkpoint) and --run (every checkpoint of a run).")
    check_options(batch_size, device, dtype)
    target = Path(ckpt or run)  # type: ignore[arg-type]
    if not target.exists():
        raise FileNotFoundError(f"{'Checkpoint' if ckpt else 'Run directory'} {target} does not exist.")
    settings = EvalSettings(
        tasks=resolve_tasks(tasks or [], include_path),
        tokenizer=tokenizer,
        batch_size=batch_size,
        limit=limit,
        device=device,
        dtype=dtype,
        verify=verify,
    )
    if ckpt is not None:
        evaluate_one(target, settings, _print_results)
        return
    plot = evaluate_run(target, settings, _print_results)
    if plot is not None:
        print(f"mula: wrote {plot}")


def _print_results(ckpt: Any, record: dict[str, Any], evaluated: list[str]) -> None:
    """One table per checkpoint: task, metric, value (tasks recorded by an earlier run marked as such)."""
    tokens = record.get("tokens_seen")
    print(f"{ckpt}: step {record.get('step')}" + (f", {tokens:,} tokens seen" if tokens is not None else ""))
    for task, entry in record["tasks"].items():
        note = "" if task in evaluated else "  (recorded earlier)"
        for name, value in entry["metrics"].items():
            print(f"  {task:<28} {name:<16} {value:.4f}{note}")


def report(run_dir: str, output: str | None = None) -> None:
    """Write a run's plots (losses, learning rate, tokens/s, MFU, expert load) as PNG files from its CSV files.

    Args:
        run_dir: The run directory (trainer.default_root_dir: its newest version_N/metrics.csv is read)
            or the directory holding metrics.csv (and moe_load.csv, for the expert load).
        output: Directory for the PNG files (default: plots/ next to metrics.csv).
    """
    from mula.report import write_report

    for path in write_report(run_dir, output):
        print(f"mula: wrote {path}")


def _tools() -> dict[str, Callable[..., Any]]:
    """Non-training subcommands: name -> function whose signature and docstring define the arguments."""
    from mula.data.prepare import prepare
    from mula.data.tokenizer import train_tokenizer

    return {
        "prepare": prepare,
        "train-tokenizer": train_tokenizer,
        "import-hf": import_hf,
        "export-hf": export_hf,
        "eval": evaluate,
        "report": report,
    }


# tools whose required arguments are positional (`mula report RUN_DIR`)
POSITIONAL_TOOLS = ("report",)


def _summary(fn: Callable[..., Any]) -> str:
    """The docstring up to its Args section (the per-argument text becomes each option's help)."""
    doc = inspect.cleandoc(fn.__doc__ or "")
    return doc.split("\nArgs:")[0].strip()


class MulaSaveConfig(SaveConfigCallback):
    """Saves the resolved config as config.yaml in the run directory (next to metrics.csv), as
    LightningCLI does, and adds it to the files of the W&B run."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Resolve the run directory on every rank (`trainer.log_dir` is a collective), then save."""
        self._log_dir = trainer.log_dir
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Upload (or, offline, stage for `wandb sync`) the saved config.yaml with each W&B run (rank 0 only)."""
        from lightning.pytorch.loggers import WandbLogger

        path = os.path.join(self._log_dir, self.config_filename)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and os.path.isfile(path):
                logger.experiment.save(path, base_path=self._log_dir, policy="now")


class MulaCLI(LightningCLI):
    """LightningCLI over `MulaLightningModule` + `MulaDataModule` with Mula's extra subcommands."""

    def __init__(self, args: list[str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("auto_configure_optimizers", False)  # the module owns AdamW + schedule
        kwargs.setdefault("parser_kwargs", {"prog": "mula"})
        kwargs.setdefault("save_config_callback", MulaSaveConfig)
        super().__init__(MulaLightningModule, MulaDataModule, args=args, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Trainer subcommands (predict is not offered: Mula is for pretraining)."""
        return {
            "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
            "validate": {"model", "dataloaders", "datamodule"},
            "test": {"model", "dataloaders", "datamodule"},
        }

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        """The trainer subcommands, then one subcommand per tool function, in the same parser."""
        super()._add_subcommands(parser, **kwargs)
        self._tool_fns = _tools()
        for name, fn in self._tool_fns.items():
            sub = self.init_parser(description=_summary(fn))
            sub.add_function_arguments(fn, as_group=False, as_positional=name in POSITIONAL_TOOLS)
            self._subcommand_parsers[name] = sub
            parser._subcommands_action.add_subcommand(name, sub, help=_summary(fn).splitlines()[0])
        self._subcommand_parsers["fit"].add_argument(
            "--restart_from_scratch",
            type=bool,
            default=False,
            help="When every checkpoint of the run directory is invalid, train from step 0 instead of"
            " stopping (exit 2). A valid checkpoint is still resumed from.",
        )
        self._add_plan_subcommand(parser)

    def _add_plan_subcommand(self, parser: LightningArgumentParser) -> None:
        """`mula plan`: the trainer/model/data options of `mula fit` plus the planner's, and the start-of-run
        memory check's options on `mula fit` (`mula.plan.command`)."""
        from mula.plan.command import add_plan_arguments, run_plan

        plan = self.init_parser(description=_summary(run_plan))
        self._add_arguments(plan)
        add_plan_arguments(plan)
        self._subcommand_parsers["plan"] = plan
        self._tool_fns["plan"] = run_plan
        parser._subcommands_action.add_subcommand("plan", plan, help="Predict per-rank memory and step time.")
        fit = self._subcommand_parsers["fit"]
        fit.add_argument(
            "--memory_check",
            type=bool,
            default=True,
            help="Stop (exit 2) before allocating anything when `mula plan` predicts more bytes per rank than"
            " the device has (on CPU: host RAM over the local ranks); false starts anyway.",
        )
        fit.add_argument(
            "--device_memory_gb",
            type=float | None,
            default=None,
            help="Device memory for the start-of-run check, in GB (default: the device's own).",
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Every logger writes into the run directory: its save_dir follows trainer.default_root_dir.

        A link, so a recipe or flag never sets save_dir itself: a run's files move with its directory.
        `--verify` decides whether `--ckpt_path` and `--model.init_weights` are verified against their
        manifests before they are read (docs/resilience.md); it is the module's `verify_init_weights`.
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

    def _parse_ckpt_path(self) -> None:
        """Check an explicit `--ckpt_path` before LightningCLI reads its hyperparameters from it.

        It must be a checkpoint that verifies (`check_ckpt_path`): a corrupted one, or something that
        is not a checkpoint at all, is bad input (exit 2) before any work, not a traceback.
        """
        subcommand = self.config.get("subcommand")
        if subcommand in self.subcommands():
            config = self.config[subcommand]
            check_ckpt_path(config.get("ckpt_path"), verify=config.verify)
        super()._parse_ckpt_path()

    def before_instantiate_classes(self) -> None:
        """Name the W&B run after its run directory unless the recipe names it."""
        if not self._is_tool():
            name_wandb_run(self.config[self.subcommand].trainer)

    def _is_tool(self) -> bool:
        return getattr(self, "subcommand", None) in getattr(self, "_tool_fns", {})

    def _set_seed(self) -> None:
        """Seeding only matters to the trainer subcommands."""
        if not self._is_tool():
            super()._set_seed()

    def instantiate_classes(self) -> None:
        """Tools build no trainer, model or data module."""
        if not self._is_tool():
            super().instantiate_classes()

    def _run_subcommand(self, subcommand: str) -> None:
        """Run a tool with its parsed arguments, or a trainer subcommand as LightningCLI does."""
        if not self._is_tool():
            try:
                super()._run_subcommand(subcommand)
            except (ValueError, FileNotFoundError) as e:
                # bad input is caught before the first step; an error after it is a crash (exit 1,
                # with traceback, which scripts/mula-resilient restarts), not a configuration problem
                if self.trainer is not None and self.trainer.global_step > 0:
                    raise RuntimeError(f"training failed at step {self.trainer.global_step}: {e}") from e
                raise
            return
        args = self.config[subcommand].as_dict()
        args.pop("config", None)  # the -c option itself
        self._tool_fns[subcommand](**args)

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
        self._check_model_inputs()
        self._check_memory()
        lock_run_dir_before_launch(self.trainer)
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") is None:
            path = auto_resume_ckpt_path(self.trainer, bool(config.get("restart_from_scratch")))
            if path is not None:
                self.trainer.ckpt_path = path

    def _check_memory(self) -> None:
        """Stop before any allocation when the predicted per-rank bytes exceed the device (`--memory_check`)."""
        config = self.config[self.subcommand]
        if not config.get("memory_check", True):
            return
        from mula.plan.command import check_fit_memory

        sections = {
            k: config[k].as_dict() if config.get(k) is not None else {} for k in ("trainer", "model", "data")
        }
        check_fit_memory(
            **sections, world_size=self.trainer.world_size, device_memory_gb=config.get("device_memory_gb")
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
        check_master_weights(str(self.trainer.precision), self.trainer.strategy)


def run_dir(default_root_dir: str | None) -> str:
    """The run directory: trainer.default_root_dir, or the working directory as for Lightning."""
    return default_root_dir or os.getcwd()


def name_wandb_run(trainer_config: Any) -> None:
    """Give each unnamed W&B logger in `trainer_config.logger` the run directory's name."""
    from lightning.pytorch.loggers import WandbLogger

    loggers = trainer_config.logger  # a list, one logger, or a bool / None
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        if not isinstance(logger, Namespace):
            continue
        init_args = logger.get("init_args")
        cls = pydoc.locate(logger.get("class_path", ""))
        is_wandb = isinstance(cls, type) and issubclass(cls, WandbLogger)
        if is_wandb and init_args is not None and init_args.get("name") is None:
            init_args.name = os.path.basename(os.path.normpath(run_dir(trainer_config.default_root_dir)))


def check_expert_backend(config: MulaConfig, trainer: L.Trainer) -> None:
    """Fail before any work when the recipe's expert backend cannot run on the trainer's device/precision."""
    if config.is_moe:
        precision = str(trainer.precision)
        dtype = (
            torch.bfloat16 if "bf16" in precision else torch.float16 if "16" in precision else torch.float32
        )
        resolve_backend(config.expert_backend, trainer.strategy.root_device, dtype)


def main(args: list[str] | None = None) -> None:
    """Entry point of the `mula` console script."""
    # W&B offline unless the user asks otherwise (WANDB_MODE=online, or `mode: online` in the recipe)
    os.environ.setdefault("WANDB_MODE", "offline")
    report_bad_input(MulaCLI, args)


if __name__ == "__main__":
    main()
