"""`python -m mula ...` is the `mula` command."""

from mula.commands.entry import main

main()
