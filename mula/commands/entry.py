"""The `mula` console script (also `python -m mula` and `python -m mula.cli`): one dispatch per subcommand.

    mula fit|validate|test ...   the LightningCLI of `mula.commands.lightning_cli` (`MulaCLI`)
    mula plan ...                the light reader (`mula.plan.recipe_reader`: no Lightning, well under a
                                 second) when it can read the command line, else `MulaCLI`'s parser
    mula bench ...               `mula.bench.command` (`MulaCLI`'s parser plus the benchmark's options)
    mula prepare|train-tokenizer|import-hf|export-hf|upcycle|eval|report|calibrate ...   `mula.commands.tools`, parsed by
                                 jsonargparse

Bad input raised by Mula before any work (`ValueError`, `FileNotFoundError`) is one line
`mula: error: ...` and exit status 2 on every path; `MULA_TRACEBACK=1` shows the traceback instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

TRAINER_SUBCOMMANDS = {
    "fit": "Train a model (auto-resumes the run directory's newest valid checkpoint).",
    "validate": "Run one validation epoch.",
    "test": "Run one test epoch.",
}
PLAN_HELP = "Predict per-rank memory and step time."
BENCH_HELP = "Measure tokens/s, MFU, MoE share and memory of a recipe's layout on random tokens."


def report_bad_input(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), with a ValueError / FileNotFoundError printed as one line and exit status 2."""
    try:
        return fn(*args)
    except (ValueError, FileNotFoundError) as e:
        if os.environ.get("MULA_TRACEBACK"):
            raise
        print(f"mula: error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)


def main(args: list[str] | None = None) -> None:
    """Entry point of the `mula` console script: run the subcommand named by the first argument."""
    argv = list(sys.argv[1:] if args is None else args)
    # W&B offline unless the user asks otherwise (WANDB_MODE=online, or `mode: online` in the recipe)
    os.environ.setdefault("WANDB_MODE", "offline")
    # before anything imports Lightning: ~1.8 s of CPU less start-up for this process and each rank it launches
    from mula.commands.lean_torchmetrics import skip_torchmetrics_optional_imports

    skip_torchmetrics_optional_imports()
    command = argv[0] if argv else None
    if command == "plan":
        from mula.plan.command import plan_without_lightning

        if not report_bad_input(plan_without_lightning, argv[1:]):
            from mula.commands.lightning_cli import plan

            report_bad_input(plan, argv[1:])
        return
    if command == "bench":
        from mula.bench.command import bench

        report_bad_input(bench, argv[1:])
        return
    if command in TRAINER_SUBCOMMANDS:
        from mula.commands.lightning_cli import MulaCLI
        from mula.training.lightning_compat import silence_lightning_deprecations

        silence_lightning_deprecations()

        report_bad_input(MulaCLI, argv)
        return
    from mula.commands.tools import run_tool, tools

    if command in tools():
        report_bad_input(run_tool, command, argv[1:])
        return
    _overview(argv)


def _overview(argv: list[str]) -> None:
    """`mula --help` (exit 0), or no or an unknown subcommand (usage and exit 2): jsonargparse lists the
    subcommands, each with its one-line help; each subcommand's own parser gives its options."""
    from jsonargparse import ArgumentParser

    from mula.commands.tools import summary, tools

    parser = ArgumentParser(prog="mula", description="Pretrain dense and MoE language models with Lightning.")
    subcommands = parser.add_subcommands()
    helps = {**TRAINER_SUBCOMMANDS, "plan": PLAN_HELP, "bench": BENCH_HELP}
    helps.update({name: summary(fn).splitlines()[0] for name, fn in tools().items()})
    for name, help in helps.items():
        subcommands.add_subcommand(name, ArgumentParser(prog=f"mula {name}"), help=help)
    parser.parse_args(argv)
    parser.error(f"unexpected arguments {argv}")  # only reached for a subcommand dispatched above
