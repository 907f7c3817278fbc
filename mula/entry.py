"""The `mula` console script: `mula plan` read without Lightning when its command line allows
(`mula.plan.recipe_reader`, well under a second), every other command by the LightningCLI of `mula.cli`.

Bad input raised by Mula before any work (`ValueError`, `FileNotFoundError`) is one line
`mula: error: ...` and exit status 2 on both paths; `MULA_TRACEBACK=1` shows the traceback instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any


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
    """Entry point of the `mula` console script (and of `python -m mula`)."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] == ["plan"]:
        from mula.plan.command import plan_without_lightning

        if report_bad_input(plan_without_lightning, argv[1:]):
            return
    from mula.cli import main as cli_main

    cli_main(args)
