"""`python -m mula ...` is the `mula` command."""

from mula.entry import main

main()
