"""`python -m mula.cli ...` and `mula.cli.main([...])`: the `mula` command (`mula.commands.entry.main`), under the
module name torchrun and Lightning's launchers have always been given. `mula fit`'s LightningCLI is
`mula.commands.lightning_cli`; this module only runs the dispatcher, so nothing below it imports it back.
"""

from __future__ import annotations

from mula.commands.entry import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
